"""Benchmark CLIs, run from a checkout: ``python -m bench.<name>`` from the repository root.

- ``bench.latency``: decode tokens/s of specjet and of Hugging Face transformers ``generate`` on the
  same weights, prompts and token counts, at several batch sizes.

``bench.common`` holds what they share: the engine-argument flags and the GSM8K prompts. Recorded
figures go to ``bench/RESULTS.md``.
"""
