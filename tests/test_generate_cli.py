"""The generation command line on a checkpoint written by save_hf (and errors on bad input)."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from specpilot.decoding.ar import generate
from specpilot.models import dense
from specpilot.models.checkpoint import save_hf

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "experiments" / "generate.py"


def test_cli_generates_what_the_api_generates(tmp_path, tiny_cfg):
    params = dense.init(jax.random.key(1), tiny_cfg, dtype=jnp.float32, std=0.5)
    save_hf(params, tiny_cfg, tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, str(CLI), "--checkpoint", str(tmp_path / "ckpt"),
                           "--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "8", "--dtype", "float32"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ids = [int(t) for t in proc.stdout.strip().split(",")]
    want = generate(dense.target(tiny_cfg, jnp.float32), params, [[3, 1, 4, 1, 5]], 8).tokens[0].tolist()
    assert ids == want


def test_cli_rejects_bad_input(tmp_path):
    proc = subprocess.run([sys.executable, str(CLI), "--checkpoint", str(tmp_path / "missing"),
                           "--prompt-ids", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "does not exist" in proc.stderr
