"""The commands the documentation tells a user to type, read out of README.md, every docs/**/*.md page and
the usage lines of the entry points' docstrings (experiments/*.py, shown by `--help`).

A command is a code line (fenced, or indented by four spaces) starting with `python experiments/...` or
`make ...`; `\\` continuations are joined, shell variables assigned earlier on the same page (`E="..."`,
possibly over several lines) are expanded, and shell comments are dropped.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import shlex
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = re.compile(r"^(?:\.venv/bin/)?python3? (experiments/\S+\.py)(?=\s|$)|^(make)(?=\s|$)")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


@dataclasses.dataclass(frozen=True)
class Command:
    doc: str  # the page, relative to the repository root
    line: int  # where the command starts (1-based)
    text: str  # as written, continuation lines joined
    program: str  # "experiments/run.py", ... or "make"
    args: tuple[str, ...]  # the words after the program, variables expanded, comments dropped

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def doc_pages() -> list[Path]:
    """README.md, docs/**/*.md and the user entry points (experiments/*.py, their docstrings)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "experiments").glob("*.py"))]


def _page_lines(path: Path) -> list[str]:
    """The page's lines; for a Python file, its module docstring's lines (other lines blanked), so line
    numbers stay the file's."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return text.splitlines()
    lines = text.splitlines()
    body = ast.parse(text).body
    if not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
        return []
    first, last = body[0].lineno, body[0].end_lineno
    return ["" if not first <= n <= last else line for n, line in enumerate(lines, 1)]


def code_lines(lines: list[str]) -> Iterator[tuple[int, str]]:
    """(line number, stripped text) of each line inside a fenced block or indented by four spaces."""
    fenced = False
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith(("    ", "\t")):
            yield n, line.strip()


def _unfinished(text: str) -> bool:
    if text.endswith("\\"):
        return True
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quotation: the value goes on on the next line
        return True
    return False


def logical_lines(lines: list[str]) -> Iterator[tuple[int, str]]:
    """Commands and variable assignments, each with its continuation lines joined."""
    code = list(code_lines(lines))
    i = 0
    while i < len(code):
        n, text = code[i]
        i += 1
        if not (PROGRAM.match(text) or ASSIGNMENT.match(text)):
            continue
        while _unfinished(text) and i < len(code) and code[i][0] == code[i - 1][0] + 1:
            text = (text[:-1].rstrip() if text.endswith("\\") else text) + " " + code[i][1]
            i += 1
        yield n, text


def _expand(text: str, env: dict[str, str], where: str) -> str:
    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in env:
            raise ValueError(f"{where}: ${name} is not assigned earlier on this page")
        return env[name]

    return VARIABLE.sub(value, text)


def page_commands(path: Path) -> list[Command]:
    doc = str(path.relative_to(ROOT))
    env: dict[str, str] = {}
    found = []
    for n, text in logical_lines(_page_lines(path)):
        where = f"{doc}:{n}"
        words = shlex.split(_expand(text, env, where), comments=True)
        program = PROGRAM.match(text)
        if program is None:  # NAME=value
            if len(words) == 1:
                name, _, value = words[0].partition("=")
                env[name] = value
            continue
        name = program.group(1) or "make"
        args = words[1:] if name == "make" else words[2:]
        found.append(Command(doc, n, text, name, tuple(args)))
    return found


def all_commands() -> list[Command]:
    return [c for page in doc_pages() for c in page_commands(page)]
