"""llama.cpp (through llama-cpp-python, the optional ``bench-llamacpp`` extra) as a timed system of
bench.latency, on the GGUF file specjet's default model comes from: the CPU peer users compare with.

Same interface as bench.latency's HF system: ``generate(batch, N)`` runs each request greedily (top-k 1)
for exactly N tokens, EOS ignored; under a JSON schema (llama.cpp's own schema-to-grammar converter)
until the grammar ends the object (its EOS), N at most. llama-cpp-python decodes one sequence at a
time, so the system is timed at batch size 1 only (``max_batch_size``).

llama.cpp's grammar parser aborts the whole process on some JSONSchemaBench schemas, so each schema's
grammar is first built in a child process; a schema that kills the child is reported and its requests
are left out of llama.cpp's figures (``supports``), not the benchmark.
"""
from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys

from specjet.kernels.openmp_teams import release_calling_thread_team

INSTALL_HINT = "pip install -e '.[bench-llamacpp]' (llama-cpp-python, built from source where no wheel exists)"


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def require() -> None:
    if not available():
        raise SystemExit(f"--llamacpp needs llama-cpp-python: {INSTALL_HINT}")


_CHECK = """
import sys
from llama_cpp import LlamaGrammar
LlamaGrammar.from_json_schema(sys.stdin.read(), verbose=False)
"""


@functools.lru_cache(maxsize=None)
def grammar_survives(schema: str) -> bool:
    """Whether llama.cpp builds a grammar for ``schema`` without taking its process down."""
    proc = subprocess.run([sys.executable, "-c", _CHECK], input=schema, capture_output=True, text=True, timeout=120)
    return proc.returncode == 0


class LlamaCppSystem:
    name = "llama.cpp"
    max_batch_size = 1

    def __init__(self, gguf_path: str, n_threads: int, n_ctx: int = 4096):
        from llama_cpp import Llama, LlamaGrammar

        self._grammar_type = LlamaGrammar
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                         n_batch=512, verbose=False)
        self.eos = self.llm.token_eos()
        self.skipped: set[str] = set()  # schemas llama.cpp cannot turn into a grammar

    def supports(self, workload) -> bool:
        if not workload.constrained:
            return True
        bad = {p.json_schema for p in workload.prompts if not grammar_survives(p.json_schema)}
        self.skipped |= bad
        return not bad

    @functools.lru_cache(maxsize=None)
    def _grammar(self, schema: str):
        return self._grammar_type.from_json_schema(schema, verbose=False)

    def generate(self, batch, max_new_tokens: int) -> list[dict]:
        outs = []
        for prompt in batch:
            grammar = self._grammar(prompt.json_schema) if prompt.json_schema is not None else None
            ids: list[int] = []
            # reset=True keeps the longest prefix of the previous request's KV (the chat template's
            # start), as in both timed passes alike.
            for token in self.llm.generate(prompt.ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                           repeat_penalty=1.0, grammar=grammar, reset=True):
                if grammar is not None and token == self.eos:
                    break
                ids.append(token)
                if len(ids) == max_new_tokens:
                    break
            if not ids or (grammar is None and len(ids) != max_new_tokens):
                raise RuntimeError(f"llama.cpp returned {len(ids)} tokens, not {max_new_tokens}")
            outs.append({"output_ids": ids, "meta_info": {"completion_tokens": len(ids)}})
        # llama.cpp runs OpenMP on this thread with the libgomp torch loaded; a team left here would
        # put specjet's compute-thread workers to sleep between regions (kernels/openmp_teams.py).
        release_calling_thread_team()
        return outs

    def spec_totals(self) -> None:
        return None

    def close(self) -> None:
        self.llm.close()
