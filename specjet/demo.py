"""`python -m specjet.demo`: a JSON object generated under a JSON schema with the default model."""
from __future__ import annotations

import json
import time

import specjet

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


def main() -> None:
    started = time.perf_counter()
    with specjet.Engine() as engine:  # SmolLM2-135M-Instruct, embedded; converted once, then cached
        loaded = time.perf_counter()
        prompt = engine.apply_chat_template("Describe a pet as a JSON object with its name, species, age and toys.")
        out = engine.generate(prompt, {"json_schema": SCHEMA, "temperature": 0, "max_new_tokens": 128})
        obj = json.loads(out["text"])
        info = out["meta_info"]
        print(json.dumps(obj, indent=2))
        print(f"# {info['completion_tokens']} tokens in {info['e2e_latency']:.2f}s "
              f"(finish: {info['finish_reason']['type']}; engine start {loaded - started:.1f}s)")


if __name__ == "__main__":
    main()
