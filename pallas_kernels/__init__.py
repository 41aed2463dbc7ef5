"""Pallas GPU kernels of specpilot, behind one dispatch (`dispatch`: an implementation per op). The
kernels: the gated delta rule token by token (`gated_delta_rule`) and over a tree
(`tree_gated_delta_rule`), tree-verification attention (`tree_attention`), ragged chain attention
(`ragged_attention`), and the W12 decode-matmul on Mosaic GPU (`w12_mosaic`, the runs' kernel) and on
the Triton backend (`w12_matmul`), with what those two share (`common`). Design notes:
docs/design/kernels.md.
"""
