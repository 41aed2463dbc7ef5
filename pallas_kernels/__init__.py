"""Pallas GPU kernels of specpilot, behind one dispatch.

- `dispatch`: chooses an implementation per op (`matmul`, `gated_delta_rule`, `prepare_params`, `choice`,
  `OpChoice`).
- `gated_delta_rule`: linear attention's recurrence token by token on Pallas' Triton backend, and its reference.
- `w12_mosaic`: the W12 decode-matmul kernel and its bf16 twin on Mosaic GPU (Hopper), the runs' kernel.
- `w12_matmul`: the same product on Pallas' Triton backend, any CUDA GPU.
- `common`: what both share (the fixed-order split sum, exception-list operands).
"""
