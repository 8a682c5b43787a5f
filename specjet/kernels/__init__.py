"""Numerical ops. Each has a torch reference; where it pays on CUDA, a Triton kernel beside it.

This package imports nothing from the rest of specjet. Device dispatch (CUDA -> Triton,
otherwise the torch reference) happens here and nowhere else.
"""
