"""Training jobs for specjet's draft models (``python -m specjet.train <job>``); CPU-friendly, cached, resumable."""
