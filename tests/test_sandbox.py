"""The sandbox's command line and refusals, and the Dask cluster's addresses: loopback by default, TLS
required for a scheduler elsewhere."""

import logging
import os
import subprocess
import sys

import psutil
import pytest

from specpilot.agent import cluster_security
from specpilot.agent import evaluator as ev
from specpilot.agent import sandbox as sb


def test_a_host_without_bubblewrap_refuses_proposed_code_naming_the_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(sb.shutil, "which", lambda name: None)
    sb._probe.cache_clear()
    try:
        with pytest.raises(sb.SandboxUnavailable, match=r"agent.sandbox=bwrap: .*bubblewrap.*not installed.*"
                                                        r"apt-get install bubblewrap.*agent.sandbox=none"):
            sb.require(sb.BWRAP)
        with pytest.raises(sb.SandboxUnavailable, match="agent.sandbox=bwrap"):
            ev.Evaluator(1, workdir=tmp_path)  # before any cluster starts
        res = ev.evaluate_candidate({"name": "c", "program": sys.executable}, timeout_s=5, memory_mb=None,
                                    workdir=str(tmp_path))
        assert res["status"] == ev.CRASHED and "not started" in res["reason"] and "bubblewrap" in res["reason"]
    finally:
        sb._probe.cache_clear()
    with pytest.raises(ValueError, match="agent.sandbox: 'docker' is not one of bwrap, none"):
        sb.require("docker")


def test_opting_out_warns_and_runs_under_the_limits_only(caplog, tmp_path):
    with caplog.at_level(logging.WARNING):
        sb.require(sb.NONE, key="test.sandbox")
    assert "test.sandbox=none" in caplog.text
    env = sb.minimal_env({}, {"OPENAI_API_KEY": "k", "OMP_NUM_THREADS": "2"})
    cmd = sb.command([sys.executable, "-c", "import os, resource; print(resource.getrlimit(resource.RLIMIT_NOFILE)[0],"
                      " 'OPENAI_API_KEY' in os.environ)"], mode=sb.NONE, limits=sb.Limits(open_files=77), env=env)
    out = subprocess.run(cmd.argv, env=cmd.env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["77", "False"] and cmd.uid is None


@pytest.mark.skipif(sb._probe(sys.executable) is not None, reason="no working bubblewrap sandbox on this host")
def test_the_sandbox_hides_the_workdir_and_tmp_and_gives_a_capped_scratch(tmp_path):
    work = tmp_path / "work"
    (work / "other").mkdir(parents=True)
    (work / "other" / "out.json").write_text("incumbent")
    mine = work / "mine.txt"
    mine.write_text("")
    probe = ("import os, resource\n"
             f"print(os.listdir({str(work)!r}), os.getuid() != 0, os.environ['HOME'],"
             " resource.getrlimit(resource.RLIMIT_NPROC)[0])\n"
             f"open({str(mine)!r}, 'w').write('from inside')\n")
    cmd = sb.command([sys.executable, "-c", probe], mode=sb.BWRAP, limits=sb.Limits(processes=99),
                     env=sb.minimal_env({}), writes=[mine], hide=[work])
    sb.give(mine, cmd.uid)
    proc = sb.Process(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.decode().split() == ["['mine.txt']", "True", "/tmp", "99"]  # only its own file of the workdir
    assert mine.read_text() == "from inside"


def test_the_local_cluster_listens_on_loopback_only(tmp_path):
    with ev.Evaluator(1, workdir=tmp_path, check_workers=1) as e:
        info = e.client.scheduler_info()
        addresses = [e.client.scheduler.address] + list(info["workers"]) + \
            [w["nanny"] for w in info["workers"].values()]
        pids = {os.getpid()} | {c.pid for c in psutil.Process().children(recursive=True)}
        listening = [c.laddr.ip for c in psutil.net_connections("inet") if c.status == "LISTEN" and c.pid in pids]
    assert len(addresses) == 5 and all(a.startswith("tcp://127.0.0.1:") for a in addresses), addresses
    assert listening and set(listening) == {"127.0.0.1"}  # the HTTP servers too


def test_a_scheduler_elsewhere_needs_tls(tmp_path):
    for local in ("tcp://127.0.0.1:8786", "localhost:8786", "tls://[::1]:8786"):
        assert cluster_security.is_loopback(local)
        cluster_security.check_scheduler(local, None)
    for remote in ("tcp://10.1.2.3:8786", "tcp://0.0.0.0:8786", "scheduler.example:8786"):
        assert not cluster_security.is_loopback(remote)
        with pytest.raises(ValueError, match=f"agent.scheduler='{remote}' is not on this machine.*agent.tls"):
            ev.Evaluator(1, workdir=tmp_path, address=remote)  # refused before any connection
    files = {k: tmp_path / f"{k}.pem" for k in ("ca_file", "cert_file", "key_file")}
    with pytest.raises(ValueError, match="agent.tls.ca_file: no file"):
        cluster_security.security({k: str(p) for k, p in files.items()})
    for p in files.values():
        p.write_text("-----BEGIN CERTIFICATE-----\n")
    sec = cluster_security.security({k: str(p) for k, p in files.items()})
    assert sec.require_encryption and sec.tls_ca_file == str(files["ca_file"])
    cluster_security.check_scheduler("tls://10.1.2.3:8786", sec)
    with pytest.raises(ValueError, match="tls://host:port"):
        cluster_security.check_scheduler("tcp://10.1.2.3:8786", sec)
    with pytest.raises(ValueError, match="agent.tls.key_file is not set"):
        cluster_security.security({"ca_file": str(files["ca_file"]), "cert_file": str(files["cert_file"])})


def test_a_candidate_imports_what_its_driver_imports_from_pythonpath(tmp_path):
    """Packages installed with `pip install --target DIR` and found through PYTHONPATH: the candidate's
    environment is built from scratch but keeps those folders after the project's own."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "only_on_pythonpath.py").write_text("VALUE = 41 + 1\n")
    env = sb.minimal_env({}, {"PYTHONPATH": f"{site}{os.pathsep}", "OPENAI_API_KEY": "k"})
    assert env["PYTHONPATH"].split(os.pathsep)[:len(sb.project_roots())] == sb.project_roots()
    out = subprocess.run([sys.executable, "-c", "import only_on_pythonpath as m, specpilot; print(m.VALUE)"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "42" and "OPENAI_API_KEY" not in env
