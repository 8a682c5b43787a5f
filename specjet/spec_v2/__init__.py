"""Speculative decoding: drafters (EAGLE, EAGLE-3, DFlash, n-gram), tree building and verification."""
