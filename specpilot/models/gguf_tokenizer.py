"""A Hugging Face `tokenizer.json` + `tokenizer_config.json` rebuilt from a GGUF file's tokenizer metadata:
byte-level BPE only, text split as llama.cpp splits it for the named pre-tokenizer, special tokens and
the chat template carried over. Design notes: docs/design/models.md.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

# GPT-2's split (what `ByteLevel(use_regex=True)` applies).
_GPT2 = "gpt2"
_DIGITS_GPT2 = "digits+gpt2"
# Llama 3's split: contractions, letters with one leading non-letter, numbers in threes, punctuation
# runs, newlines, other whitespace.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's: Llama 3's with every digit on its own.
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

PRE_TOKENIZER_SPLITS = {
    "smollm": _DIGITS_GPT2, "starcoder": _DIGITS_GPT2, "refact": _DIGITS_GPT2, "codeshell": _DIGITS_GPT2,
    "gpt2": _GPT2, "mpt": _GPT2, "olmo": _GPT2,
    "llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "llama-v3": _LLAMA3_REGEX,
    "smaug-bpe": _LLAMA3_REGEX, "dbrx": _LLAMA3_REGEX, "falcon3": _LLAMA3_REGEX,
    "qwen2": _QWEN2_REGEX, "deepseek-r1-qwen": _QWEN2_REGEX, "megrez": _QWEN2_REGEX,
}


class TokenizerMetadataError(ValueError):
    """GGUF tokenizer metadata that does not describe a tokenizer we can build."""


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)}
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _byte_alphabet()
_ALPHABET = frozenset(_BYTE_TO_CHAR.values())


def _spelled(token: str) -> str:
    """The token as a byte-level vocabulary spells it."""
    if set(token) <= _ALPHABET:
        return token
    return "".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str):
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        raise TokenizerMetadataError(
            f"unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: "
            f"{', '.join(sorted(PRE_TOKENIZER_SPLITS))}")
    if split == _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == _DIGITS_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _require(meta: dict[str, Any], key: str):
    if key not in meta:
        raise TokenizerMetadataError(f"missing metadata key {key!r}")
    return meta[key]


def _token_for(meta: dict[str, Any], tokens: list[str], name: str) -> str | None:
    index = meta.get(f"tokenizer.ggml.{name}")
    if index is None:
        return None
    if not 0 <= int(index) < len(tokens):
        raise TokenizerMetadataError(f"tokenizer.ggml.{name}={index} is outside the vocabulary "
                                     f"of {len(tokens)} tokens")
    return tokens[int(index)]


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The `tokenizers.Tokenizer` that the `tokenizer.*` metadata (key -> value) describes."""
    kind = _require(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerMetadataError(f"unsupported tokenizer tokenizer.ggml.model={kind!r}; only "
                                     f"'gpt2' (byte-level BPE) is supported")
    pre = _pre_tokenizer(_require(meta, "tokenizer.ggml.pre"))
    tokens = [str(t) for t in _require(meta, "tokenizer.ggml.tokens")]
    merges = [str(m) for m in _require(meta, "tokenizer.ggml.merges")]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    if len(types) != len(tokens):
        raise TokenizerMetadataError(f"tokenizer.ggml.token_type has {len(types)} entries for "
                                     f"{len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        spelled = _spelled(token)
        if spelled in vocab:
            raise TokenizerMetadataError(f"tokens {vocab[spelled]} and {index} are both spelled "
                                         f"{spelled!r} in the byte-level vocabulary")
        vocab[spelled] = index
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise TokenizerMetadataError(f"merge {merge!r} is not two space-separated tokens")
        pairs.append((parts[0], parts[1]))
    try:
        bpe = models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                         end_of_word_suffix="", fuse_unk=False)
    except Exception as e:  # the Rust side names the merge whose tokens are not in the vocabulary
        raise TokenizerMetadataError(f"merges do not fit the vocabulary: {e}") from e
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, types) if kind == CONTROL and set(t) <= _ALPHABET]
    plain = [AddedToken(t, normalized=False, special=False)
             for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in vocab]
    tok.add_special_tokens(special)
    tok.add_tokens(plain)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise TokenizerMetadataError("added tokens grew the vocabulary past the file's "
                                     f"{len(tokens)} tokens")
    tok.post_processor = _post_processor(meta, tokens)
    return tok


def _post_processor(meta: dict[str, Any], tokens: list[str]):
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if not (add_bos or add_eos):
        return processors.ByteLevel(trim_offsets=False)
    ends = []
    for flag, name in ((add_bos, "bos_token_id"), (add_eos, "eos_token_id")):
        if flag:
            token = _token_for(meta, tokens, name)
            if token is None:
                raise TokenizerMetadataError(f"tokenizer.ggml.add_{name[:3]}_token is set but "
                                             f"tokenizer.ggml.{name} is missing")
            ends.append((token, int(meta[f"tokenizer.ggml.{name}"])))
    bos = [ends[0][0]] if add_bos else []
    eos = [ends[-1][0]] if add_eos else []
    single = [*bos, "$A", *eos]
    pair = [*bos, "$A", *eos, *bos, "$B", *eos]
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                         special_tokens=sorted(set(ends)))


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: special tokens by string, BOS/EOS flags, the chat template."""
    tokens = [str(t) for t in _require(meta, "tokenizer.ggml.tokens")]
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    for role, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        out[role] = _token_for(meta, tokens, key)
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        out["chat_template"] = str(template)
    return out
