"""Requests, batches, KV pools and allocator, the event loop."""
