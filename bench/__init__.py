"""Benchmark CLIs, run from a checkout: ``python -m bench.<name>`` from the repository root.

- ``bench.latency``: decode tokens/s of specjet and of Hugging Face transformers ``generate`` on the
  same weights, prompts and token counts, at several batch sizes.
- ``bench.gsm8k``: GSM8K accuracy and throughput, in SGLang's format.
- ``bench.compare``: several engine configurations side by side on the same requests.
- ``bench.json``: schema-valid JSON on the JSON-schema dev set: validity, TTFT, TPOT, tokens/s and accept
  length per configuration (speculation, grammar-aware drafting, overlap), against unconstrained decoding.

- ``bench.pause``: short requests after the engine idled (an agent app's sporadic calls), per loop.

``bench.common`` holds what they share: the engine-argument flags, the GSM8K and JSON-schema prompts,
concurrent generation, the machine and the report header. Recorded figures go to ``bench/RESULTS.md``.
"""
