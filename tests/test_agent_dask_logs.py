"""The loop's Dask cluster keeps quiet by default: no `distributed.*` INFO lines from the driver or the
worker processes, unless `agent.dask_log_level` asks for them."""

import subprocess
import sys

import pytest

from specpilot.agent import evaluator as ev
from specpilot.agent import loop

SCRIPT = """
import logging, sys
from specpilot.agent import evaluator as ev

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)  # as a Hydra app's console handler: INFO and up
    with ev.Evaluator(1, workdir=sys.argv[2], timeout_s=30, dask_log_level=sys.argv[1]) as e:
        assert e.client.submit(sum, [1, 2]).result() == 3
    print("evaluated")
"""


def _run_cluster(tmp_path, level: str) -> str:
    script = tmp_path / "cluster.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), level, str(tmp_path / "work")], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0 and "evaluated" in proc.stdout, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_dask_info_is_silenced_by_default_and_comes_back_on_request(tmp_path):
    quiet = _run_cluster(tmp_path, "WARNING")
    assert "distributed.worker - INFO" not in quiet and "INFO:distributed" not in quiet, quiet
    loud = _run_cluster(tmp_path, "info")
    assert "distributed.worker - INFO - " in loud  # from the worker process itself


def test_the_level_is_checked():
    assert ev.log_level("warning") == ev.log_level("WARNING") == 30 and ev.log_level(10) == 10
    with pytest.raises(ValueError, match="agent.dask_log_level: 'LOUD' is not a logging level"):
        loop.agent_conf({"dask_log_level": "LOUD"})
    assert loop.agent_conf({}).dask_log_level == "WARNING"
