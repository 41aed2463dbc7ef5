"""Hostile kernel variants: each gets past the static check and tries a different escape; the sandbox
contains every one (no secret read, no file written outside, no connection made, no process left, the
disk not filled), each is reported as that candidate's failure, and a well-behaved candidate runs after."""

import concurrent.futures
import json
import socket
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from specpilot.agent import evaluator as ev
from specpilot.agent import sandbox as sb
from specpilot.harness import kernel_variants as va

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"weights": "bf16", "matmul": [[2, 8, 8]]}
FAKE_KEY = f"sk-fake-{uuid.uuid4().hex}"
INCUMBENT_TOKENS = 7_654_321  # what the incumbent's out.json holds: no candidate may read it


def _sandbox_missing() -> str | None:
    try:
        sb.require(sb.BWRAP)
    except sb.SandboxUnavailable as e:
        return str(e)
    return None


pytestmark = pytest.mark.skipif(_sandbox_missing() is not None,
                                reason=f"no working bubblewrap sandbox on this host: {_sandbox_missing()}")

MATMUL = """
import jax.numpy as jnp
from numpy.lib import _npyio_impl as _m  # numpy re-exports os

os = _m.os


def matmul(x, w):
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)
"""
# each escape runs as the module is imported, after MATMUL, and ends by reporting what it got
ESCAPES = {
    "builtins_subscript": "got = __builtins__['open'](SECRET).read()",
    "typing_annotation": ("import typing\n\n"
                          "def _probe(x: \"__import__('builtins').open(SECRET).read()\"): pass\n\n"
                          "got = typing.get_type_hints(_probe)"),
    "numpy_fromfile": "import numpy as np\ngot = np.fromfile(SECRET, dtype=np.uint8).tobytes()",
    "numpy_os": "got = os.popen('cat ' + SECRET + '; cat /proc/1/environ').read()",
    "numpy_subprocess": ("import numpy.f2py as f2py\n"
                         "got = f2py.subprocess.run(['cat', SECRET], capture_output=True).stdout"),
    "numpy_ctypes": ("import numpy.ctypeslib as c\n"
                     "got = c.ctypes.CDLL(None).system(('touch ' + OUTSIDE).encode())\n"
                     "got = (got, os.path.exists(OUTSIDE))"),
    "attrgetter_globals": ("import operator, typing\n"
                           "g = operator.attrgetter('__globals__')(typing.get_type_hints)\n"
                           "got = g['__builtins__']['open'](SECRET).read()"),
    "write_outside": ("import numpy as np\n"
                      "np.save(OUTSIDE_TMP, np.zeros(3))\n"
                      "np.save(OUTSIDE, np.zeros(3))\n"
                      "got = 'wrote both'"),
    "fork_bomb": ("import time\nn = 0\n"
                  "try:\n"
                  "    while n < 100000:\n"
                  "        if os.fork() == 0:\n"
                  "            time.sleep(600)\n"
                  "            os._exit(0)\n"
                  "        n += 1\n"
                  "except OSError as e:\n"
                  "    got = f'forked {n} then {e!r}'"),
    "loopback_connect": ("s = __builtins__['__import__']('socket').create_connection(('127.0.0.1', PORT), timeout=3)\n"
                         "got = 'connected'"),
    "setsid_grandchild": ("import time\n"
                          "if os.fork() == 0:\n"
                          "    os.setsid()\n"
                          "    if os.fork() == 0:\n"
                          "        for i in range(3000):\n"
                          "            fd = os.open(os.sys.argv[2], os.O_WRONLY | os.O_APPEND)\n"
                          "            os.write(fd, b'grandchild alive ')\n"
                          "            os.close(fd)\n"
                          "            time.sleep(0.2)\n"
                          "    os._exit(0)\n"
                          "time.sleep(3600)\n"
                          "got = 'slept'"),
    "incumbent_outputs": ("got = []\n"
                          "for d in os.listdir(WORKDIR):\n"
                          "    p = os.path.join(WORKDIR, d, 'out.json')\n"
                          "    if os.path.exists(p):\n"
                          "        got.append(open_(p))\n"),
    "environment_keys": ("got = dict(os.environ)\n"
                         "for pid in ('1', 'self', str(os.getppid())):\n"
                         "    try:\n"
                         "        got[pid] = open_(f'/proc/{pid}/environ')\n"
                         "    except OSError as e:\n"
                         "        got[pid] = repr(e)\n"),
    "fill_the_disk": ("import numpy as np\nchunk = np.zeros(2 ** 26, np.uint8)\ngot = 0\n"
                      "try:\n"
                      "    for i in range(64):\n"
                      "        chunk.tofile(os.path.join(os.environ.get('HOME', '/tmp'), f'fill{i}'))\n"
                      "        got += chunk.size\n"
                      "except OSError as e:\n"
                      "    got = f'{got} bytes in scratch, then {e}'\n"
                      "try:\n"
                      "    for i in range(64):\n"
                      "        with __builtins__['open'](os.sys.argv[2], 'ab') as f:\n"
                      "            f.write(chunk.tobytes())\n"
                      "except OSError as e:\n"
                      "    got = f'{got}; out.json: {e}'"),
}
SLOW_DEADLINE = {"setsid_grandchild": 20}  # it outlives nothing: the deadline ends its whole sandbox
HEAVY = ("fill_the_disk",)  # writes 1 GB to its scratch and 256 MB to its out.json: under -m slow
BATTERY = sorted(n for n in ESCAPES if n not in HEAVY)
GOOD = MATMUL


def _source(name: str, ctx: dict) -> str:
    helper = "def open_(p):\n    return __builtins__['open'](p, 'rb').read()\n\n"
    body = ESCAPES[name]
    for key, value in ctx.items():
        body = body.replace(key, repr(value) if not isinstance(value, int) else str(value))
    return textwrap.dedent(MATMUL) + "\n" + helper + body + "\nraise RuntimeError(f'escape result: {got!r}')\n"


def _check_spec(tmp_path: Path, name: str, source: str) -> dict:
    v = va.Variant("matmul", source)
    return {"name": name, "stage": "check", "variants": [v.spec_entry(tmp_path / "sandbox" / name)],
            "variant_check": {"shapes": SHAPES}}


INCUMBENT = """
import json, sys
spec = json.load(open(sys.argv[1]))
print("ready", flush=True)
runs = 0
for line in sys.stdin:
    if line.strip() == "end":
        break
    runs += 1
    print("done", flush=True)
json.dump({"tokens": [[[TOKEN] * spec["new_tokens"] for _ in spec["prompts"]] for _ in range(runs)]},
          open(sys.argv[2], "w"))
"""


def _processes_naming(text: str) -> list[int]:
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            pass
    return pids


@pytest.fixture(scope="module")
def battery(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    work = tmp / "work"
    secret = tmp / "secret" / "key.txt"
    secret.parent.mkdir()
    secret.write_text(FAKE_KEY)
    secret.chmod(0o600)
    outside = ROOT / f".hostile-{uuid.uuid4().hex}"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    mp = pytest.MonkeyPatch()
    mp.setenv("OPENAI_API_KEY", FAKE_KEY)  # the driver's LLM key: no candidate may see it
    mp.setenv("XLA_SECRET_TOKEN", FAKE_KEY)  # a credential behind a passed prefix: still not passed
    program = tmp / "incumbent.py"
    program.write_text(INCUMBENT.replace("TOKEN", str(INCUMBENT_TOKENS)))
    incumbent = ev.evaluate_candidate({"name": "incumbent", "program": str(program), "prompts": [[1, 2]],
                                       "new_tokens": 3, "repeats": 1, "config": {"bench": {"batch_size": 1}}},
                                      timeout_s=60, memory_mb=None, workdir=str(work))
    assert incumbent["status"] == ev.OK, incumbent["reason"]
    ctx = {"SECRET": str(secret), "OUTSIDE_TMP": str(tmp / "written.npy"), "OUTSIDE": str(outside),
           "PORT": listener.getsockname()[1], "WORKDIR": str(work)}
    specs = {n: _check_spec(tmp, n, _source(n, ctx)) for n in BATTERY}
    for n, s in specs.items():
        va.static_check("matmul", Path(s["variants"][0]["path"]).read_text())  # each gets past the filter
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = {n: pool.submit(ev.evaluate_candidate, s, timeout_s=SLOW_DEADLINE.get(n, 90), memory_mb=4096,
                                  workdir=str(work)) for n, s in specs.items()}
        results = {n: f.result() for n, f in futures.items()}
    good = ev.evaluate_candidate(_check_spec(tmp, "good", GOOD), timeout_s=90, memory_mb=4096, workdir=str(work))
    try:
        connection = listener.accept()
    except BlockingIOError:
        connection = None
    yield {"results": results, "good": good, "outside": outside, "tmp": tmp, "connection": connection,
           "incumbent": incumbent}
    mp.undo()
    listener.close()
    for p in (outside, outside.with_suffix(".npy")):
        p.unlink(missing_ok=True)


def _seen(res: dict) -> str:
    err = Path(res["folder"]) / "stderr.txt"
    out = Path(res["folder"]) / "out.json"
    return res["reason"] + (err.read_text(errors="replace") if err.exists() else "") + \
        (out.read_bytes()[:100000].decode(errors="replace") if out.exists() else "")


def _contained(res: dict) -> None:
    assert res["status"] in (ev.VARIANT_REJECTED, ev.CRASHED, ev.TIMEOUT, ev.KILLED), res
    assert res["reason"], res
    seen = _seen(res)
    assert FAKE_KEY not in seen  # neither the secret file nor the driver's key
    assert str(INCUMBENT_TOKENS) not in seen  # nor the incumbent's tokens
    assert not _processes_naming(res["folder"])  # nothing of it is left running


@pytest.mark.parametrize("name", BATTERY)
def test_each_escape_is_contained_and_fails_that_candidate(battery, name):
    _contained(battery["results"][name])
    assert not battery["outside"].exists() and not battery["outside"].with_suffix(".npy").exists()
    assert not (battery["tmp"] / "written.npy").exists()


def test_the_escapes_fail_for_the_sandbox_reasons(battery):
    r = battery["results"]
    assert battery["connection"] is None  # its own network namespace: the host's listener heard nothing
    assert "No such file" in r["numpy_fromfile"]["reason"]  # /tmp and the secret's folder are not its
    assert "escape result: b''" in r["numpy_subprocess"]["reason"]
    assert "(" in r["numpy_ctypes"]["reason"] and "False)" in r["numpy_ctypes"]["reason"]  # touch failed
    assert "Read-only file system" in r["write_outside"]["reason"] or "Permission" in r["write_outside"]["reason"]
    forked = int(r["fork_bomb"]["reason"].split("forked ")[1].split()[0])
    assert forked < sb.Limits().processes and "BlockingIOError" in r["fork_bomb"]["reason"]
    assert r["setsid_grandchild"]["status"] == ev.TIMEOUT
    out = Path(r["setsid_grandchild"]["folder"]) / "out.json"
    size = out.stat().st_size
    time.sleep(1.0)
    assert out.stat().st_size == size  # the grandchild writes no more: it ended with its sandbox
    assert "escape result: [b'']" in r["incumbent_outputs"]["reason"]  # only its own, empty, out.json


@pytest.mark.slow
def test_filling_the_disk_stops_at_the_scratch_and_file_size_limits(tmp_path):
    res = ev.evaluate_candidate(_check_spec(tmp_path, "fill", _source("fill_the_disk", {})), timeout_s=120,
                                memory_mb=4096, workdir=str(tmp_path / "work"))
    _contained(res)
    scratch = sb.Limits().scratch_mb * 2 ** 20
    assert f"{scratch} bytes in scratch, then" in res["reason"] and "File too large" in res["reason"], res["reason"]
    folder = Path(res["folder"])  # on the host: its out.json and stderr, each at most the file-size limit
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 2 * sb.Limits().file_mb * 2 ** 20


def test_a_well_behaved_candidate_runs_after_them(battery):
    good = battery["good"]
    assert good["status"] == ev.OK and good["checked"][0]["calls"] == 3, good
    assert battery["incumbent"]["status"] == ev.OK


def test_the_evaluator_goes_on_after_a_hostile_candidate(tmp_path, monkeypatch):
    """Through the Dask evaluator: a hostile check fails that candidate only; the next one is evaluated."""
    monkeypatch.setenv("OPENAI_API_KEY", FAKE_KEY)
    source = _source("environment_keys", {})
    with ev.Evaluator(1, timeout_s=90, memory_mb=4096, workdir=tmp_path / "work") as e:
        hostile, good = e.evaluate([_check_spec(tmp_path, "hostile", source), _check_spec(tmp_path, "good", GOOD)])
    assert hostile["status"] == ev.VARIANT_REJECTED and "escape result" in hostile["reason"]
    assert FAKE_KEY not in _seen(hostile) and "'HOME': '/tmp'" in hostile["reason"]
    assert good["status"] == ev.OK, good
    assert json.loads((Path(good["folder"]) / "out.json").read_text())["checked"]
