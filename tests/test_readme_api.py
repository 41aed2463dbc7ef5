"""The README's Python API example runs as written on the CPU, with nothing to download."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_api_example() -> str:
    """The first ```python block after the README's "## Python API" heading."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Python API\n", 1)
    if len(section) != 2:
        pytest.fail("README.md has no '## Python API' section")
    block = re.search(r"^```python\n(.*?)^```", section[1], re.S | re.M)
    if block is None:
        pytest.fail("README.md's Python API section has no ```python block")
    return block.group(1)


def test_readme_api_example_runs_as_written(capsys):
    code = readme_api_example()
    exec(compile(code, "README.md (Python API)", "exec"), {"__name__": "readme_api"})
    out = capsys.readouterr().out
    # The example's own asserts check AR == speculative tokens and a clean forcing report; its printed
    # results say the oracle drafter reached tau = its block size.
    assert "oracle, tau 4.0" in out
    assert "0 mismatches" in out
