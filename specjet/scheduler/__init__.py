"""The scheduler thread: requests and KV bookkeeping (scheduler.py), the compute side (worker.py),
and the loops that drive both (event_loops.py)."""
