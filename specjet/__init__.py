"""specjet: fast schema-valid LLM generation.

    import specjet
    with specjet.Engine() as engine:  # the embedded default model, SmolLM2-135M-Instruct
        out = engine.generate("Name a colour.", {"max_new_tokens": 16, "temperature": 0})
"""
from specjet.engine import Engine, EngineArgs, QueueFullError
from specjet.engine.structured import function_tool, parse_output
from specjet.scheduler.sampling_params import SamplingParams

__all__ = ["Engine", "EngineArgs", "QueueFullError", "SamplingParams", "function_tool", "parse_output"]
__version__ = "0.1.0"
