"""W12 decode + matmul on the Mosaic GPU backend (Hopper: TMA, wgmma), and its bf16 twin, exact against the
twin, the runs' fastest W12 and bf16 decode paths (`dispatch.matmul`'s "mosaic"): weight layouts
(`layout`), the compiled decode (`ptx`), the kernel body and call (`kernel`), and the public functions
and references (`api`). Design notes: docs/design/kernels.md.
"""

from pallas_kernels.w12_mosaic.api import (DEFAULT, W12MosaicConfig, bf16_mosaic_partials, default_block_k,
                                           default_split, default_stages, fold_x, mosaic_matmul, prepare_twin,
                                           prepare_w12, sum_rows, twin_mosaic_reference, w12_mosaic_partials,
                                           w12_mosaic_reference)
from pallas_kernels.w12_mosaic.layout import (BN, MAX_SLOTS, SLOT_ALIGN, TwinNK, W12NK, check_shape, chunk_order,
                                              decode_nk, exception_slots, mma_order, storage_bytes, tile_twin,
                                              to_nk, untile_twin, xor_tile_chunks)

__all__ = ["BN", "DEFAULT", "MAX_SLOTS", "SLOT_ALIGN", "TwinNK", "W12MosaicConfig", "W12NK",
           "bf16_mosaic_partials", "check_shape", "chunk_order", "decode_nk", "default_block_k", "default_split",
           "default_stages", "exception_slots", "fold_x", "mma_order", "mosaic_matmul", "prepare_twin",
           "prepare_w12", "storage_bytes", "sum_rows", "tile_twin", "to_nk", "twin_mosaic_reference",
           "untile_twin", "w12_mosaic_partials", "w12_mosaic_reference", "xor_tile_chunks"]
