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

# The shipped drafter's kinds, and its held-out set's cycle: kept as they are so its held-out prompts stay put.
REQUEST_KINDS = ("explain", "complete", "example", "review", "docstring")
FUNCTION_KINDS = REQUEST_KINDS + ("test", "parameters", "type_hints", "errors", "summary", "improve")
CLASS_KINDS = ("class", "class_example")
MODULE_KINDS = ("module",)
ALL_KINDS = FUNCTION_KINDS + CLASS_KINDS + MODULE_KINDS
MAX_SOURCE_LINES = 30  # functions quoted whole (review, docstring, ...) are at most this long


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
    params: tuple[str, ...] = ()  # its parameters, self and cls left out
    annotated: bool = False  # a parameter or the return has a type annotation
    raises: bool = False  # its body has a raise statement


@dataclasses.dataclass(frozen=True)
class Class:
    module: str
    name: str  # qualified name inside the module
    header: str  # the source from `class` to the end of the docstring
    where: str


@dataclasses.dataclass(frozen=True)
class Module:
    name: str  # dotted module name
    where: str  # "relative/path.py:1"


def _module_name(rel: str) -> str:
    parts = rel[:-3].split("/") if rel.endswith(".py") else rel.split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or rel


def _parse(text: str):
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):
        return None


def _functions(text: str, rel: str) -> list[Function]:
    return _subjects(_parse(text), text, rel)[0]


def _subjects(tree, text: str, rel: str) -> tuple[list[Function], list[Class]]:
    """The public documented functions and classes of one file (methods of public classes included)."""
    if tree is None:
        return [], []
    lines = text.splitlines(keepends=True)
    functions, classes = [], []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and not child.name.startswith("_"):
                doc = _docstring_node(child)
                if doc is not None:
                    header = _dedent(lines[child.lineno - 1:doc.end_lineno], _indent(lines[child.lineno - 1]))
                    classes.append(Class(module=_module_name(rel), name=prefix + child.name,
                                         header=header.rstrip() + "\n", where=f"{rel}:{child.lineno}"))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                fn = _function(child, prefix, lines, rel)
                if fn is not None:
                    functions.append(fn)

    visit(tree, "")
    return functions, classes


def _module(tree, rel: str) -> Module | None:
    """The file as a module a user asks about: documented, and no part of its name private."""
    name = _module_name(rel)
    if tree is None or not (ast.get_docstring(tree) or "").strip() or any(
            part.startswith("_") for part in name.split(".")):
        return None
    return Module(name=name, where=f"{rel}:1")


def _docstring_node(node):
    doc = node.body[0] if node.body else None
    if (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)
            and doc.value.value.strip()):
        return doc
    return None


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _dedent(chunk: list[str], indent: int) -> str:
    return "".join(line[indent:] if line[:indent].strip() == "" else line for line in chunk)


def _function(node, prefix: str, lines: list[str], rel: str) -> Function | None:
    if node.name.startswith("_") or len(node.body) < 2 or node.decorator_list:
        return None
    doc = _docstring_node(node)
    if doc is None:
        return None
    start, end = node.lineno - 1, node.end_lineno
    indent = _indent(lines[start])
    header = _dedent(lines[start:doc.end_lineno], indent).rstrip() + "\n"
    source = _dedent(lines[start:end], indent).rstrip() + "\n"
    undocumented = _dedent(lines[start:doc.lineno - 1] + lines[doc.end_lineno:end], indent).rstrip() + "\n"
    args = node.args
    every = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
    return Function(module=_module_name(rel), name=prefix + node.name, header=header, source=source,
                    undocumented=undocumented, where=f"{rel}:{node.lineno}",
                    params=tuple(a.arg for a in every if a.arg not in ("self", "cls")),
                    annotated=node.returns is not None or any(a.annotation is not None for a in every),
                    raises=any(isinstance(n, ast.Raise) for n in ast.walk(node)))


def request_text(fn: Function, kind: str) -> str | None:
    """The user's message of one kind about one function (None: that kind does not fit it)."""
    short = fn.source.count("\n") <= MAX_SOURCE_LINES
    code = f"```python\n{fn.source}```"
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
    if kind == "test":
        return f"Write a unit test for this Python function:\n\n```python\n{fn.header}```"
    if kind == "parameters":
        return (f"List the parameters of `{fn.module}.{fn.name}` and what each one means:\n\n"
                f"```python\n{fn.header}```" if fn.params else None)
    if kind == "type_hints":
        return f"Rewrite this Python function with type hints:\n\n{code}" if short and not fn.annotated else None
    if kind == "errors":
        return (f"What exceptions can this Python function raise, and when?\n\n{code}"
                if short and fn.raises else None)
    if kind == "summary":
        return f"In one sentence, what does `{fn.name}` in Python's `{fn.module}` module do?"
    if kind == "improve":
        return f"How could this Python function be improved?\n\n{code}" if short else None
    raise ValueError(f"function request kind must be one of {FUNCTION_KINDS}, got {kind!r}")


def class_request_text(cls: Class, kind: str) -> str:
    """The user's message of one kind about one class."""
    if kind == "class":
        return f"What is this Python class for, and how is it used?\n\n```python\n{cls.header}```"
    if kind == "class_example":
        return f"Show how to create and use a `{cls.name}` from Python's `{cls.module}` module."
    raise ValueError(f"class request kind must be one of {CLASS_KINDS}, got {kind!r}")


def module_request_text(module: Module, kind: str) -> str:
    """The user's message of one kind about one module."""
    if kind == "module":
        return (f"Give an overview of Python's `{module.name}` module: what is it for, and what are its main "
                f"functions and classes?")
    raise ValueError(f"module request kind must be one of {MODULE_KINDS}, got {kind!r}")


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    text: str  # the user's message
    kind: str
    where: str  # the function, class or module it is about, "relative/path.py:line"


def stdlib_requests(corpus: Corpus, split: str, num: int | None = None,
                    kinds: Sequence[str] = REQUEST_KINDS, every_kind: bool = False) -> list[ChatRequest]:
    """Requests about the public documented functions of one corpus split, kinds cycled in order
    (`every_kind`: one request of each kind that fits every function, then every class and the module of
    each file for the class and module kinds); `num`: that many, evenly spaced over all candidates
    (None: all)."""
    for kind in kinds:
        if kind not in ALL_KINDS:
            raise ValueError(f"request kind must be one of {ALL_KINDS}, got {kind!r}")
    if not every_kind and not set(kinds) <= set(FUNCTION_KINDS):
        raise ValueError(f"cycled requests are about functions ({FUNCTION_KINDS}); the class and module "
                         f"kinds need every_kind=True, got {list(kinds)}")
    function_kinds = [k for k in kinds if k in FUNCTION_KINDS]
    class_kinds = [k for k in kinds if k in CLASS_KINDS]
    module_kinds = [k for k in kinds if k in MODULE_KINDS]
    out = []
    for rel in corpus.files(split):
        text = read_text(corpus.root / rel)
        tree = _parse(text)
        functions, classes = _subjects(tree, text, rel)
        if every_kind:
            for fn in functions:
                out += [ChatRequest(text=t, kind=k, where=fn.where)
                        for k in function_kinds if (t := request_text(fn, k)) is not None]
            out += [ChatRequest(text=class_request_text(c, k), kind=k, where=c.where)
                    for c in classes for k in class_kinds]
            module = _module(tree, rel) if module_kinds else None
            if module is not None:
                out += [ChatRequest(text=module_request_text(module, k), kind=k, where=module.where)
                        for k in module_kinds]
            continue
        for fn in functions:
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
    if num_train is not None:
        if len(train) < num_train:
            raise ValueError(f"only {len(train)} train chat prompts fit {max_tokens} tokens, "
                             f"{num_train} requested")
        train = [train[i] for i in np.linspace(0, len(train) - 1, num_train).round().astype(int)]
    return train, heldout_prompts(corpus, tokenizer, template, max_tokens, num_heldout, system)


def heldout_prompts(corpus: Corpus, tokenizer, template: str, max_tokens: int, num: int = 64,
                    system: str | None = None) -> list[list[int]]:
    """`num` held-out chat prompts (the shipped kinds, cycled) of at most `max_tokens` tokens, evenly
    spaced over the held-out split's."""
    held, _ = chat_prompt_ids(tokenizer, template, stdlib_requests(corpus, "heldout"), max_tokens, system)
    if len(held) < num:
        raise ValueError(f"only {len(held)} held-out chat prompts fit {max_tokens} tokens, {num} requested")
    return [held[i] for i in np.linspace(0, len(held) - 1, num).round().astype(int)]
