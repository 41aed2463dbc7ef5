"""Every `experiments/run.py` command of the README composes and validates as written; the checkpoint
example runs end to end on a tiny Hugging Face checkpoint.

Design choices:
- Commands are read out of the README itself, so an edited example is tested as it now reads. A sweep
  (`-m a=1,2`) is checked at each of its values' first; Hydra flags and launcher plugins that are not
  installed here (submitit) are left out; the placeholder path `/models/Qwen3-0.6B` is replaced by a
  tiny checkpoint written here.
"""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specpilot.harness import config_schema
from specpilot.harness.config_schema import typed, validate

ROOT = Path(__file__).resolve().parents[1]
config_schema.register()
PLACEHOLDER = "/models/Qwen3-0.6B"


def readme_run_commands() -> list[list[str]]:
    """The overrides of each `python experiments/run.py` line in the README's code blocks."""
    commands = []
    for line in (ROOT / "README.md").read_text().splitlines():
        m = re.match(r"\s+python experiments/run\.py(.*)", line)
        if not m or "submitit" in line:
            continue
        args = shlex.split(m.group(1).split("#")[0])
        commands.append([a for a in args if a != "-m"])
    return commands


def _first_value(override: str) -> str:
    key, _, value = override.partition("=")
    if "," in value and not value.startswith("["):
        value = value.split(",")[0]
    return f"{key}={value}"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    import hf_tiny  # the tests folder is on the path (rootdir-relative, as test_dense_vs_hf imports it)

    path = tmp_path_factory.mktemp("ckpt") / "qwen3"
    return hf_tiny.save(hf_tiny.build("qwen3_head_dim32"), path)


def test_readme_lists_the_commands_users_copy():
    commands = readme_run_commands()
    assert len(commands) >= 10
    assert any(any(a.startswith("target.path=") for a in c) for c in commands)
    assert any(any(a.startswith("decoding.plans.") for a in c) for c in commands)


@pytest.mark.parametrize("index", range(len(readme_run_commands())))
def test_readme_run_command_composes_and_validates(index, tiny_checkpoint):
    args = [_first_value(a.replace(PLACEHOLDER, tiny_checkpoint)) for a in readme_run_commands()[index]]
    overrides = [a for a in args if not a.startswith("hydra")]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = typed(compose(config_name="config", overrides=overrides))
    validate(cfg)


def test_readme_checkpoint_command_runs_as_written(tiny_checkpoint, tmp_path):
    (cmd,) = [c for c in readme_run_commands() if any(a.startswith("target.path=") for a in c)]
    args = [a.replace(PLACEHOLDER, tiny_checkpoint) for a in cmd]
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), *args, "bench.num_prompts=1",
                           "bench.new_tokens=4", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ms/token" in proc.stdout and (tmp_path / "run" / "results.jsonl").exists()
