"""Pallas GPU kernels of specpilot, behind one dispatch.

- `dispatch`: chooses an implementation per op (`matmul`, `gated_delta_rule`, `tree_gated_delta_rule`,
  `tree_attention`, `prepare_params`, `choice`, `OpChoice`).
- `gated_delta_rule`: linear attention's recurrence token by token on Pallas' Triton backend, and its reference.
- `tree_gated_delta_rule`: the same recurrence over a token tree (each node from its parent), and its
  reference.
- `tree_attention`: tree-verification attention (prefix split over the cache + the masked tree block) on
  Pallas' Triton backend, and its reference (the model's attention).
- `w12_mosaic`: the W12 decode-matmul kernel and its bf16 twin on Mosaic GPU (Hopper), the runs' kernel.
- `w12_matmul`: the same product on Pallas' Triton backend, any CUDA GPU.
- `common`: what both share (the fixed-order split sum, exception-list operands).
"""
