"""An OpenAI-compatible HTTP server over one ``specjet.Engine`` (``specjet serve``).

protocol.py (request and response models), chat.py (parameters, chat template, tool calls),
app.py (FastAPI routes and errors), errors.py, metrics.py (Prometheus text), cli.py (flags).
"""
