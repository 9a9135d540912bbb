"""Operations shared by several mechanisms: causal scans, chunked recurrences, block-sparse attention.

A mechanism file imports the interface (``longattn.attention.base``) and the operations here, never another
mechanism; the operations import nothing of the mechanisms. One module per family of algebra.
"""
