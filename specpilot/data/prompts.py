"""Held-out prompt sets for the embedded pair: prompts drawn deterministically from held-out files, cut at
token boundaries, every prompt the same length, saved as JSON (whole or not at all) to pin a benchmark
(docs/design/data-training.md).
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import numpy as np

from specpilot import atomic_io
from specpilot.data.corpus import Corpus, read_text
from specpilot.data.tokenizer import TextTokenizer

KINDS = ("function", "prefix")


@dataclasses.dataclass(frozen=True)
class PromptSet:
    tokens: np.ndarray  # [N, P] int32, every prompt exactly P tokens
    continuations: np.ndarray  # [N, C] int32 the file's own next tokens (padded with -1 past its end)
    sources: tuple[str, ...]  # "relative/path.py:line" of each cut

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def as_lists(self) -> list[list[int]]:
        return self.tokens.tolist()

    def texts(self, tokenizer: TextTokenizer) -> list[str]:
        return [tokenizer.decode(row) for row in self.tokens]

    def save(self, path: str | Path) -> Path:
        return atomic_io.write_json(path, {"tokens": self.tokens.tolist(),
                                           "continuations": self.continuations.tolist(),
                                           "sources": list(self.sources)})

    @classmethod
    def load(cls, path: str | Path) -> "PromptSet":
        data = json.loads(Path(path).read_text())
        return cls(tokens=np.asarray(data["tokens"], np.int32).reshape(len(data["sources"]), -1),
                   continuations=np.asarray(data["continuations"], np.int32).reshape(
                       len(data["sources"]), -1),
                   sources=tuple(data["sources"]))


def _docstring_cuts(text: str) -> list[tuple[int, int]]:
    """(char offset just after each function docstring, its line) for functions with a body after it."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):  # files for other Python versions, or NUL bytes
        return []
    lines = text.splitlines(keepends=True)
    starts = np.cumsum([0] + [len(line) for line in lines])
    cuts = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        doc = node.body[0]
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)) or doc.end_lineno is None:
            continue
        line = lines[doc.end_lineno - 1]
        col = len(line.encode()[:doc.end_col_offset].decode(errors="replace"))  # ast columns are bytes
        cuts.append((int(starts[doc.end_lineno - 1]) + col, doc.end_lineno))
    return sorted(cuts)


def _candidates(text: str, ids: list[int], offsets: list[tuple[int, int]], kind: str, prompt_len: int,
                stride: int) -> list[tuple[int, int]]:
    """(token index of the cut, line) candidates in one file."""
    if kind == "prefix":
        return [(i, text.count("\n", 0, offsets[i][0]) + 1)
                for i in range(prompt_len, len(ids), stride)]
    token_starts = np.asarray([o[0] for o in offsets])
    out = []
    for char, line in _docstring_cuts(text):
        i = int(np.searchsorted(token_starts, char, side="left"))  # first token starting at/after cut
        if prompt_len <= i < len(ids):
            out.append((i, line))
    return out


def make_prompts(corpus: Corpus, tokenizer: TextTokenizer, num_prompts: int = 64, prompt_len: int = 96,
                 continuation_len: int = 128, kind: str = "function", split: str = "heldout",
                 prefix_stride: int = 512) -> PromptSet:
    """`num_prompts` prompts of exactly `prompt_len` tokens from one split of the corpus."""
    if kind not in KINDS:
        raise ValueError(f"prompt kind must be one of {KINDS}, got {kind!r}")
    found: list[tuple[list[int], list[int], str]] = []
    for rel in corpus.files(split):
        text = read_text(corpus.root / rel)
        enc = tokenizer.tokenizer.encode(text, add_special_tokens=False)
        ids = enc.ids
        for i, line in _candidates(text, ids, enc.offsets, kind, prompt_len, prefix_stride):
            cont = ids[i:i + continuation_len]
            found.append((ids[i - prompt_len:i], cont + [-1] * (continuation_len - len(cont)),
                          f"{rel}:{line}"))
    if len(found) < num_prompts:
        raise ValueError(f"only {len(found)} {kind!r} prompts of {prompt_len} tokens in the {split} "
                         f"split, {num_prompts} requested; use a shorter prompt_len, more held-out "
                         f"files (heldout_fraction) or kind='prefix'")
    picks = np.unique(np.linspace(0, len(found) - 1, num_prompts).round().astype(int))
    chosen = [found[i] for i in picks]
    return PromptSet(tokens=np.asarray([c[0] for c in chosen], np.int32).reshape(len(chosen), prompt_len),
                     continuations=np.asarray([c[1] for c in chosen], np.int32).reshape(
                         len(chosen), continuation_len),
                     sources=tuple(c[2] for c in chosen))
