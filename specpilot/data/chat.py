"""Chat prompts: rendering a model's own chat template as transformers does, and the requests a chat model
gets, built deterministically from the public functions of the interpreter's standard library
(docs/design/data-training.md).
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import functools
import json
from typing import Sequence

import numpy as np

from specpilot.data.corpus import Corpus, read_text

REQUEST_KINDS = ("explain", "complete", "example", "review", "docstring")
MAX_SOURCE_LINES = 30  # functions quoted whole (review, docstring) are at most this long


class ChatTemplateError(ValueError):
    """A chat template that cannot be rendered."""


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template does not parse: {e}") from e


def render_chat(template: str, messages: Sequence[dict], add_generation_prompt: bool = True,
                **special_tokens: str) -> str:
    """The text of `messages` ([{"role", "content"}, ...]) under a Hugging Face chat template."""
    if not template:
        raise ChatTemplateError("the model has no chat template")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatTemplateError(f"message {i} needs 'role' and 'content', got {m!r}")
    from jinja2 import TemplateError

    try:
        return _compiled_template(template).render(messages=list(messages), tools=None, documents=None,
                                                   add_generation_prompt=add_generation_prompt,
                                                   **special_tokens)
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from e


@dataclasses.dataclass(frozen=True)
class Function:
    module: str  # dotted module name, e.g. "json.decoder"
    name: str  # qualified name inside the module, e.g. "JSONDecoder.decode"
    header: str  # the source from `def` to the end of the docstring
    source: str  # the whole function
    undocumented: str  # the function with its docstring removed
    where: str  # "relative/path.py:line"


def _module_name(rel: str) -> str:
    parts = rel[:-3].split("/") if rel.endswith(".py") else rel.split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or rel


def _functions(text: str, rel: str) -> list[Function]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and not child.name.startswith("_"):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                fn = _function(child, prefix, lines, rel)
                if fn is not None:
                    found.append(fn)

    visit(tree, "")
    return found


def _function(node, prefix: str, lines: list[str], rel: str) -> Function | None:
    if node.name.startswith("_") or len(node.body) < 2 or node.decorator_list:
        return None
    doc = node.body[0]
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)) or not doc.value.value.strip():
        return None
    start, end = node.lineno - 1, node.end_lineno
    indent = len(lines[start]) - len(lines[start].lstrip())

    def dedent(chunk: list[str]) -> str:
        return "".join(line[indent:] if line[:indent].strip() == "" else line for line in chunk)

    header = dedent(lines[start:doc.end_lineno]).rstrip() + "\n"
    source = dedent(lines[start:end]).rstrip() + "\n"
    undocumented = dedent(lines[start:doc.lineno - 1] + lines[doc.end_lineno:end]).rstrip() + "\n"
    return Function(module=_module_name(rel), name=prefix + node.name, header=header, source=source,
                    undocumented=undocumented, where=f"{rel}:{node.lineno}")


def request_text(fn: Function, kind: str) -> str | None:
    """The user's message of one kind about one function (None: that kind does not fit it)."""
    short = fn.source.count("\n") <= MAX_SOURCE_LINES
    if kind == "explain":
        return f"What does `{fn.name}` in Python's `{fn.module}` module do? Answer briefly."
    if kind == "complete":
        return f"Complete this Python function:\n\n```python\n{fn.header}```"
    if kind == "example":
        return f"Show a short example of how to use `{fn.module}.{fn.name}` in Python."
    if kind == "review":
        return f"Explain what this Python code does:\n\n```python\n{fn.source}```" if short else None
    if kind == "docstring":
        return (f"Write a docstring for this Python function:\n\n```python\n{fn.undocumented}```"
                if short else None)
    raise ValueError(f"request kind must be one of {REQUEST_KINDS}, got {kind!r}")


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    text: str  # the user's message
    kind: str
    where: str  # the function it is about, "relative/path.py:line"


def stdlib_requests(corpus: Corpus, split: str, num: int | None = None,
                    kinds: Sequence[str] = REQUEST_KINDS, every_kind: bool = False) -> list[ChatRequest]:
    """Requests about the public documented functions of one corpus split, kinds cycled in order
    (`every_kind`: one request of each kind that fits every function); `num`: that many, evenly
    spaced over all candidates (None: all)."""
    for kind in kinds:
        if kind not in REQUEST_KINDS:
            raise ValueError(f"request kind must be one of {REQUEST_KINDS}, got {kind!r}")
    out = []
    for rel in corpus.files(split):
        for fn in _functions(read_text(corpus.root / rel), rel):
            if every_kind:
                out += [ChatRequest(text=t, kind=k, where=fn.where)
                        for k in kinds if (t := request_text(fn, k)) is not None]
                continue
            kind = kinds[len(out) % len(kinds)]
            text = request_text(fn, kind)
            if text is None:  # too long to quote whole: ask for an explanation instead
                kind, text = "explain", request_text(fn, "explain")
            out.append(ChatRequest(text=text, kind=kind, where=fn.where))
    if num is None:
        return out
    if len(out) < num:
        raise ValueError(f"only {len(out)} chat requests in the {split} split, {num} requested")
    picks = np.unique(np.linspace(0, len(out) - 1, num).round().astype(int))
    return [out[i] for i in picks]


def chat_prompt_ids(tokenizer, template: str, requests: Sequence[ChatRequest], max_tokens: int,
                    system: str | None = None, special_tokens: dict | None = None
                    ) -> tuple[list[list[int]], list[ChatRequest]]:
    """Token ids of each request as a one-turn chat ready for the assistant's reply; requests longer
    than `max_tokens` are dropped. `special_tokens`: the tokenizer's by role ({"bos_token": ...}), which
    templates such as Llama's write into the text. Returns (prompts, the requests kept)."""
    prompts, kept = [], []
    for req in requests:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": req.text}]
        ids = tokenizer.encode(render_chat(template, messages, **(special_tokens or {})))
        if len(ids) <= max_tokens:
            prompts.append(ids)
            kept.append(req)
    return prompts, kept


def training_prompts(corpus: Corpus, tokenizer, template: str, max_tokens: int,
                     num_train: int | None = None, num_heldout: int = 64,
                     system: str | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """(train, held-out) chat prompts of at most `max_tokens` tokens from the corpus's two splits
    (`num_train` None: every train request that fits)."""
    train, _ = chat_prompt_ids(tokenizer, template, stdlib_requests(corpus, "train", every_kind=True),
                               max_tokens, system)
    held, _ = chat_prompt_ids(tokenizer, template, stdlib_requests(corpus, "heldout"), max_tokens, system)
    if num_train is not None:
        if len(train) < num_train:
            raise ValueError(f"only {len(train)} train chat prompts fit {max_tokens} tokens, "
                             f"{num_train} requested")
        train = [train[i] for i in np.linspace(0, len(train) - 1, num_train).round().astype(int)]
    if len(held) < num_heldout:
        raise ValueError(f"only {len(held)} held-out chat prompts fit {max_tokens} tokens, "
                         f"{num_heldout} requested")
    held = [held[i] for i in np.linspace(0, len(held) - 1, num_heldout).round().astype(int)]
    return train, held
