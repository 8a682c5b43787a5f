"""Speculative decoding ("spec v2", SGLang's name for the overlap-capable speculative path).

config.py       SpecConfig: every drafter's parameters and defaults (SpecConfig.from_args)
drafter.py      the Drafter protocol and its inputs (SpecInput, DraftRequest)
eagle_drafter.py  EAGLE-2 trees from a trained head (EAGLE-3 fused features when the head has them)
ngram.py        n-gram tries from the request's own text
hybrid.py       EAGLE trees with the request's n-gram path merged in
dflash_drafter.py  DFLASH: a chain from one block forward of a DFlash draft (context KV from target features)
draft_runner.py  the drafters' fixed-shape forwards on padded batch buckets (CUDA graphs on CUDA)
grammar_guide.py  a constrained request's grammar as drafting and verification use it
tree_verifier.py  one target forward over every tree, the accepted path, KV moved into place
speculator.py   one speculative iteration: propose, mask, verify, after_verify
"""
