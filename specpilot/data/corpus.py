"""Text corpus: a folder of files (by default the interpreter's standard library), split by file into
train / held-out by a hash of each path, and packed into token sequences whose batch order is a pure
function of (seed, step) (docs/design/data-training.md).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

DEFAULT_PATTERNS = ("**/*.py",)
# fnmatch patterns on the relative POSIX path. Test suites are long, repetitive and vary between builds;
# site-packages holds whatever happens to be installed.
DEFAULT_EXCLUDE = ("site-packages/*", "*/site-packages/*", "test/*", "*/test/*", "tests/*", "*/tests/*",
                   "idle_test/*", "*/idle_test/*", "lib2to3/*", "__pycache__/*", "*/__pycache__/*")


def default_root() -> Path:
    """The running interpreter's standard library source folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str, heldout_fraction: float, salt: str = "specpilot") -> str:
    """'train' or 'heldout' for a relative path, from a hash of the path alone."""
    digest = hashlib.sha256(f"{salt}:{relpath}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    return "heldout" if u < heldout_fraction else "train"


def read_text(path: Path) -> str:
    """File contents as text; undecodable bytes become U+FFFD instead of raising."""
    return path.read_bytes().decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A folder of text files split into train and held-out by relative path."""

    root: Path
    train_files: tuple[str, ...]  # relative POSIX paths, sorted
    heldout_files: tuple[str, ...]

    def files(self, split: str) -> tuple[str, ...]:
        if split == "train":
            return self.train_files
        if split == "heldout":
            return self.heldout_files
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")

    def texts(self, split: str, max_bytes: int | None = None) -> Iterator[str]:
        """Texts of one split in sorted path order, stopping once `max_bytes` have been yielded."""
        total = 0
        for rel in self.files(split):
            if max_bytes is not None and total >= max_bytes:
                return
            text = read_text(self.root / rel)
            if text.strip():
                total += len(text.encode())
                yield text

    def num_bytes(self, split: str) -> int:
        return sum((self.root / rel).stat().st_size for rel in self.files(split))


def load_corpus(root: str | Path | None = None, patterns: Sequence[str] = DEFAULT_PATTERNS,
                exclude: Sequence[str] = DEFAULT_EXCLUDE, heldout_fraction: float = 0.05,
                salt: str = "specpilot") -> Corpus:
    """List the files of `root` (default: the stdlib) matching `patterns` and split them by path hash."""
    root = default_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    found: set[str] = set()
    for pattern in patterns:
        for path in root.glob(pattern):
            if not path.is_file():
                continue
            rel = path.relative_to(root).as_posix()
            if not any(fnmatch.fnmatch(rel, ex) for ex in exclude):
                found.add(rel)
    if not found:
        raise FileNotFoundError(f"no files under {root} match {list(patterns)} (excluding {list(exclude)})")
    train, heldout = [], []
    for rel in sorted(found):
        (heldout if split_of(rel, heldout_fraction, salt) == "heldout" else train).append(rel)
    return Corpus(root=root, train_files=tuple(train), heldout_files=tuple(heldout))


def pack(docs: Iterable[Sequence[int]], seq_len: int, eos_id: int) -> np.ndarray:
    """Concatenate token documents, each followed by `eos_id`, into windows [N, seq_len] int32."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    parts = []
    for doc in docs:
        parts.append(np.asarray(doc, np.int32))
        parts.append(np.asarray([eos_id], np.int32))
    flat = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    n = len(flat) // seq_len
    return flat[: n * seq_len].reshape(n, seq_len)


def batch_at(data: np.ndarray, step: int, batch_size: int, seed: int) -> np.ndarray:
    """Batch number `step` of an endless shuffled pass over the rows of `data` [N, T] -> [B, T].

    Each epoch is a fresh permutation drawn from (seed, epoch); a step never depends on earlier calls,
    so a resumed run sees exactly the batches an uninterrupted one would.
    """
    n = data.shape[0]
    if n < batch_size:
        raise ValueError(f"{n} packed sequences cannot fill a batch of {batch_size}; use more data "
                         f"or a smaller batch/seq_len")
    per_epoch = n // batch_size
    epoch, index = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    return data[perm[index * batch_size:(index + 1) * batch_size]]


def packed_split(corpus: Corpus, tokenizer, split: str, seq_len: int,
                 max_bytes: int | None = None) -> np.ndarray:
    """Tokenize one split (`tokenizer.encode_batch`, `tokenizer.eos_id`) and pack it: [N, seq_len]."""
    texts = list(corpus.texts(split, max_bytes=max_bytes))
    return pack(tokenizer.encode_batch(texts), seq_len, tokenizer.eos_id)
