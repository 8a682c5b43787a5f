"""`python -m specjet.demo`: a JSON object generated under a JSON schema with the default model, by the engine a
user gets with no arguments: its GGUF weights, and guided drafting (the request under a schema verifies NGRAM trees
of the grammar's forced text and its own n-grams, no draft model), which decodes such a request at batch 1 as
fast as the trained drafters here and faster than EAGLE (bench/RESULTS.md, session 62)."""
from __future__ import annotations

import json
import time

import specjet
from specjet.kernels.cpu_features import describe_cpu

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "species": {"type": "string", "enum": ["cat", "dog", "rabbit"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "favourite_toys": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "species", "age", "favourite_toys"],
}
PROMPT = "Describe a pet as a JSON object with its name, species, age and toys."


def main() -> int:
    started = time.perf_counter()
    # SmolLM2-135M-Instruct, embedded; converted once, then cached. Greedy output is plain decoding's.
    with specjet.Engine() as engine:
        loaded = time.perf_counter()
        prompt = engine.apply_chat_template(PROMPT)
        params = {"json_schema": SCHEMA, "temperature": 0, "max_new_tokens": 128}
        engine.generate(prompt, dict(params, max_new_tokens=2))  # warm-up: compiles the grammar, first kernels
        out = engine.generate(prompt, params)
        info = out["meta_info"]
        if info["finish_reason"]["type"] != "stop":  # cut (max_new_tokens) before its object closed: no JSON yet
            print(out["text"])
            print(f"# the reply was cut after {info['completion_tokens']} tokens before its object closed "
                  f"({info['finish_reason']})")
            return 1
        obj = json.loads(out["text"])
        dtype = str(engine.worker.runner.dtype).removeprefix("torch.")
        print(json.dumps(obj, indent=2))
        print(f"# {info['completion_tokens']} tokens in {info['e2e_latency']:.2f}s: "
              f"{info['completion_tokens'] / info['e2e_latency']:.1f} tokens/s, "
              f"accept length {info['spec_accept_length']:.2f} (finish: {info['finish_reason']['type']})")
        print(f"# guided drafting, {engine.worker.runner.quantization or dtype} weights on {describe_cpu()}; "
              f"engine start {loaded - started:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
