"""Public API: Engine and its arguments."""
from specjet.engine.args import EngineArgs
from specjet.engine.engine import Engine

__all__ = ["Engine", "EngineArgs"]
