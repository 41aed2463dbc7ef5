"""The README's Python API example runs as written on the CPU, with nothing to download, and so does the
block of docs/api.md that continues it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_block(doc: str, heading: str) -> str:
    """The first ```python block under `heading` (a markdown heading line, as written) in `doc`."""
    text = (ROOT / doc).read_text()
    section = text.split(f"\n{heading}\n", 1)
    if len(section) != 2:
        pytest.fail(f"{doc} has no '{heading}' section")
    block = re.search(r"^```python\n(.*?)^```", section[1], re.S | re.M)
    if block is None:
        pytest.fail(f"{doc}'s '{heading}' section has no ```python block")
    return block.group(1)


def run_block(doc: str, heading: str, namespace: dict) -> None:
    exec(compile(python_block(doc, heading), f"{doc} ({heading})", "exec"), namespace)


def test_readme_api_example_runs_as_written(capsys):
    run_block("README.md", "## Python API", {"__name__": "readme_api"})
    out = capsys.readouterr().out
    # The example's own asserts check AR == speculative tokens and a clean forcing report; its printed
    # results say the oracle drafter reached tau = its block size.
    assert "oracle, tau 4.0" in out
    assert "0 mismatches" in out


@pytest.mark.slow
def test_api_page_continues_the_readme_example(capsys):
    namespace = {"__name__": "readme_api"}
    run_block("README.md", "## Python API", namespace)
    run_block("docs/api.md", "## The engine and the building blocks", namespace)
    # The block asserts the engine's tokens equal AR's; the state holds the prompt and 2 committed tokens.
    assert int(namespace["state"].lengths[0]) == 6
