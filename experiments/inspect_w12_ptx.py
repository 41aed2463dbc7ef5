"""Compile the W12 kernel and its twin for one shape and count what the generated PTX does per path.

    XLA_FLAGS=--xla_dump_to=/tmp/d PYTHONPATH=. python3 experiments/inspect_w12_ptx.py /tmp/d

Counts shared-memory stores/loads, ldmatrix, mma/wgmma (and whether wgmma takes its first operand from
registers), integer ops and PRMT/LOP3 in each kernel's PTX: the evidence for where a decoded tile goes.
Needs a GPU (XLA writes the PTX at compile time).
"""

from __future__ import annotations

import glob
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import w12_matmul as km  # noqa: E402
from specpilot.formats import w12  # noqa: E402

PATTERNS = {
    "st.shared": r"\bst\.shared", "ld.shared": r"\bld\.shared", "ldmatrix": r"\bldmatrix", "stmatrix": r"\bstmatrix",
    "cp.async": r"\bcp\.async\.(?:ca|cg)", "tma": r"cp\.async\.bulk", "mma.sync": r"\bmma\.sync",
    "wgmma": r"\bwgmma\.mma_async", "wgmma_regA": r"wgmma\.mma_async[^;]*\{[^}]*\}\s*,\s*\{", "ld.global": r"\bld\.global",
    "prmt": r"\bprmt", "lop3": r"\blop3", "shl/shr": r"\bsh[lr]\.", "and/or/xor": r"\b(?:and|or|xor)\.b",
    "add.s32": r"\badd\.s32", "cvt": r"\bcvt\.", "shfl": r"\bshfl\.",
}


def main(dump_dir: str) -> None:
    k, n = 4096, 12288
    w = (0.02 * jax.random.normal(jax.random.PRNGKey(0), (k, n), jnp.float32)).astype(jnp.bfloat16)
    enc = w12.encode_device(w)
    for m in (1, 16):
        x = jax.random.normal(jax.random.PRNGKey(1), (m, k), jnp.bfloat16)
        for path in ("mma", "mma_t"):
            jax.block_until_ready(km.w12_matmul(x, enc, path=path))
            jax.block_until_ready(km.bf16_matmul(x, w, path=path))
    files = sorted(glob.glob(os.path.join(dump_dir, "*.ptx")))
    print(f"{len(files)} PTX files")
    for f in files:
        text = open(f).read()
        for entry in re.split(r"(?=\.visible \.entry)", text)[1:]:
            name = re.match(r"\.visible \.entry (\S+?)\(", entry)
            counts = {key: len(re.findall(p, entry)) for key, p in PATTERNS.items()}
            if not (counts["mma.sync"] or counts["wgmma"]):
                continue
            print(os.path.basename(f)[:60], name.group(1) if name else "?", len(entry.splitlines()), "lines")
            print("   ", "  ".join(f"{key}={v}" for key, v in counts.items() if v))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("XLA_DUMP_DIR", "/tmp/xla_dump"))
