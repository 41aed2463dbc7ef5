"""Benchmark prompt sets made of text: a model folder's tokenizer, special tokens and chat template
(`ModelText`, read as transformers reads them), and the named sets `chat`, `humaneval` and
`humaneval_chat`, each tokenized with the target's own tokenizer and cut the same way on every machine
(docs/design/data-training.md).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from specpilot.data import humaneval
from specpilot.data.chat import chat_prompt_ids, stdlib_requests
from specpilot.data.corpus import load_corpus
from specpilot.data.tokenizer import EOS_ALIASES, TextTokenizer, load_tokenizer

CHAT_SETS = ("chat", "humaneval_chat")  # need a chat template
TEXT_SETS = ("chat", "humaneval", "humaneval_chat")  # need a tokenizer
SPECIAL_ROLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


class PromptSetError(ValueError):
    """A prompt set that cannot be built for this model and these settings."""


@dataclasses.dataclass(frozen=True)
class ModelText:
    """What turns text into a model's prompts: its tokenizer, chat template and special tokens."""

    tokenizer: TextTokenizer
    chat_template: str | None = None
    special_tokens: dict = dataclasses.field(default_factory=dict)  # role -> token string


def _token_string(value) -> str | None:
    if isinstance(value, dict):  # a serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template(value) -> str | None:
    if isinstance(value, list):  # [{"name": ..., "template": ...}]: transformers' default is "default"
        value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}.get("default")
    return value if isinstance(value, str) and value else None


def read_tokenizer_config(directory: str | Path) -> dict:
    path = Path(directory) / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PromptSetError(f"{path} is not JSON: {e}") from e
    if not isinstance(config, dict):
        raise PromptSetError(f"{path} holds no JSON object")
    return config


def chat_template(directory: str | Path) -> str | None:
    """The folder's chat template (chat_template.jinja, else tokenizer_config.json's), or None."""
    jinja = Path(directory) / TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8") or None
    return _template(read_tokenizer_config(directory).get("chat_template"))


def has_tokenizer(directory: str | Path) -> bool:
    return (Path(directory) / "tokenizer.json").is_file()


def eos_token_id(folder) -> int | None:
    """The end-of-sequence id of a Hugging Face model folder, or None if it names none: tokenizer_config.json's
    `eos_token` looked up in tokenizer.json, else config.json's `eos_token_id` (the first of a list), else
    the first usual eos name (`data.tokenizer.EOS_ALIASES`) tokenizer.json has."""
    folder = Path(folder)

    def read(name):
        path = folder / name
        return json.loads(path.read_text()) if path.is_file() else {}

    tok_path = folder / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_path)) if tok_path.is_file() else None
    eos = read("tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if tok is not None and isinstance(eos, str) and tok.token_to_id(eos) is not None:
        return tok.token_to_id(eos)
    ids = read("config.json").get("eos_token_id")
    ids = ids[0] if isinstance(ids, list) and ids else ids
    if isinstance(ids, int) and not isinstance(ids, bool):
        return ids
    if tok is not None:
        return next((tok.token_to_id(n) for n in EOS_ALIASES if tok.token_to_id(n) is not None), None)
    return None


def load_model_text(directory: str | Path) -> ModelText:
    """The tokenizer, chat template and special tokens of a Hugging Face model folder. Its end-of-sequence
    token is `eos_token_id`'s (the one generation stops at), whichever file names it."""
    directory = Path(directory)
    config = read_tokenizer_config(directory)
    special = {role: tok for role in SPECIAL_ROLES if (tok := _token_string(config.get(role))) is not None}
    if "eos_token" not in special:
        eos = eos_token_id(directory)
        if eos is not None:
            name = Tokenizer.from_file(str(directory / "tokenizer.json")).id_to_token(eos)
            if name is not None:
                special["eos_token"] = name
    tokenizer = load_tokenizer(directory / "tokenizer.json", eos_token=special.get("eos_token"),
                               pad_token=special.get("pad_token"))
    return ModelText(tokenizer, chat_template(directory), special)


def evenly_spaced(items: list, num: int) -> list:
    """`num` of `items` at evenly spaced positions, first and last included (len(items) >= num)."""
    picks = np.unique(np.linspace(0, len(items) - 1, num).round().astype(int))
    return [items[i] for i in picks]


def candidates(kind: str, text: ModelText, max_tokens: int) -> tuple[list[list[int]], list[str], int]:
    """Every prompt of the set `kind` with at most `max_tokens` tokens: (token ids, where each comes from,
    how many the set has before the length cut)."""
    if kind not in TEXT_SETS:
        raise PromptSetError(f"prompt set must be one of {TEXT_SETS}, got {kind!r}")
    if kind in CHAT_SETS and not text.chat_template:
        raise PromptSetError(f"the {kind!r} prompts are chats, and the model has no chat template")
    if kind == "chat":
        requests = stdlib_requests(load_corpus(None), "heldout")
        prompts, kept = chat_prompt_ids(text.tokenizer, text.chat_template, requests, max_tokens,
                                        special_tokens=text.special_tokens)
        return prompts, [r.where for r in kept], len(requests)
    problems = humaneval.load_problems()
    if kind == "humaneval":
        prompts, kept = humaneval.completion_prompt_ids(text.tokenizer, problems, max_tokens)
    else:
        prompts, kept = humaneval.chat_prompt_ids_for(text.tokenizer, text.chat_template, problems, max_tokens,
                                                      special_tokens=text.special_tokens)
    return prompts, [p.task_id for p in kept], len(problems)


def build(kind: str, text: ModelText, num: int, max_tokens: int) -> tuple[list[list[int]], list[str]]:
    """`num` prompts of the set `kind`, each at most `max_tokens` tokens, evenly spaced over the set.
    Returns (token ids, where each comes from: a task id or a stdlib file:line)."""
    prompts, where, total = candidates(kind, text, max_tokens)
    if len(prompts) < num:
        raise PromptSetError(f"{num} {kind!r} prompts requested, but only {len(prompts)} of the set's {total} "
                             f"have at most {max_tokens} tokens; ask for fewer prompts or allow longer ones")
    chosen = evenly_spaced(list(zip(prompts, where)), num)
    return [p for p, _ in chosen], [w for _, w in chosen]
