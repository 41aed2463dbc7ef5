"""Byte-level BPE tokenizer: trained on the corpus with `tokenizers`, or loaded from any `tokenizer.json`,
with the special tokens the drafter and padding need (docs/design/data-training.md).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specpilot import atomic_io

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN, PAD_TOKEN)
# Names other tokenizer.json files use for the same roles, tried in order.
EOS_ALIASES = (EOS_TOKEN, "<|im_end|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")
PAD_ALIASES = (PAD_TOKEN, "<pad>", "[PAD]")


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the special-token ids the decoders and trainers need."""

    tokenizer: Tokenizer
    eos_id: int
    mask_id: int | None
    pad_id: int

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # Rust-side parallel encoding: tokenizing the whole stdlib takes seconds, not minutes.
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        if path.suffix != ".json":
            path = path / "tokenizer.json"
        atomic_io.write_text(path, self.tokenizer.to_str(pretty=True))
        return path


def _byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, max_bytes: int | None = 8_000_000,
                    min_frequency: int = 2) -> TextTokenizer:
    """Train a byte-level BPE on `texts` (at most `max_bytes` of them) with the special tokens first."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must cover 256 bytes + {len(SPECIAL_TOKENS)} specials, got {vocab_size}")
    if max_bytes is not None:
        texts = _take_bytes(texts, max_bytes)
    tok = _byte_level_bpe()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return from_tokenizer(tok)


def _take_bytes(texts: Iterable[str], max_bytes: int) -> Iterable[str]:
    total = 0
    for text in texts:
        if total >= max_bytes:
            return
        total += len(text.encode())
        yield text


def _first_id(tok: Tokenizer, names: Iterable[str]) -> int | None:
    return next((i for i in (tok.token_to_id(n) for n in names) if i is not None), None)


def from_tokenizer(tok: Tokenizer, eos_token: str | None = None, mask_token: str | None = None,
                   pad_token: str | None = None) -> TextTokenizer:
    """Wrap a `tokenizers.Tokenizer`, finding special ids by the given names or the usual aliases."""
    eos = _first_id(tok, [eos_token] if eos_token else EOS_ALIASES)
    if eos is None:
        raise ValueError(f"tokenizer has no end-of-text token (tried {eos_token or EOS_ALIASES})")
    mask = _first_id(tok, [mask_token or MASK_TOKEN])
    pad = _first_id(tok, [pad_token] if pad_token else PAD_ALIASES)
    # Without a pad token, eos pads: prompts carry explicit lengths, so padding ids are never read.
    return TextTokenizer(tokenizer=tok, eos_id=eos, mask_id=mask, pad_id=eos if pad is None else pad)


def load_tokenizer(path: str | Path, eos_token: str | None = None, mask_token: str | None = None,
                   pad_token: str | None = None) -> TextTokenizer:
    """Load a Hugging Face `tokenizer.json` (a file, or a folder holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exception for a file it cannot parse
        raise ValueError(f"{path} is not a readable tokenizer.json: {e}") from e
    return from_tokenizer(tokenizer, eos_token, mask_token, pad_token)
