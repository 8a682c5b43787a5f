"""Public API: Engine and its arguments."""
from specjet.engine.args import EngineArgs
from specjet.engine.engine import Engine
from specjet.scheduler.scheduler import QueueFullError

__all__ = ["Engine", "EngineArgs", "QueueFullError"]
