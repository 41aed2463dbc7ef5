"""Shared fixtures: tiny model configs built with dataclasses.replace, as the style guide suggests."""

import dataclasses
import gc
import os
import tempfile

# One persistent compilation cache for the whole run, its workers and the scripts tests start: the tiny
# models' programs recur across modules and subprocesses (the default test run took 18 min with it, 24
# without, 2 cores, 2026-12-05). Keys hold the program, jax's version and flags, so a kept folder is safe;
# a user's own JAX_COMPILATION_CACHE_DIR is kept, and an empty one turns the cache off.
_TEST_CACHE = {"JAX_COMPILATION_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"specpilot-tests-xla-{os.getuid()}"),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
for _name, _value in _TEST_CACHE.items():
    os.environ.setdefault(_name, _value)

import jax  # noqa: E402

if os.environ["JAX_COMPILATION_CACHE_DIR"]:  # also where jax was imported before the variables were set
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                      int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))

# Sharded plans are tested on simulated CPU devices (tests/test_sharding.py); jax's device count must be
# set before its backends start. Unsharded work runs on the first device, as it would with one.
SIMULATED_CPU_DEVICES = 4
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    jax.config.update("jax_num_cpu_devices", SIMULATED_CPU_DEVICES)

import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from jax._src import compilation_cache  # noqa: E402

from specpilot.decoding import aot  # noqa: E402
from specpilot.models import dense  # noqa: E402
from specpilot.models.config import ModelConfig  # noqa: E402

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, qk_norm=True, tap_layers=(0, 1))


@pytest.fixture
def tiny_cfg():
    return TINY


@pytest.fixture
def tiny_params():
    # A large init std makes logits peaked, so greedy choices are not near-ties between tokens.
    return dense.init(jax.random.key(0), TINY, dtype=jnp.float32, std=0.5)


# jax's persistent compilation cache is process-wide: a test that runs a script in-process (run.py enables
# the cache under cache_dir) would otherwise leave every later compile of that worker using that script's
# folder. Each test starts and ends with the run's own cache (above); the tests of the cache set theirs.
_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                  "jax_persistent_cache_min_entry_size_bytes")


_CACHE_BASELINE = {name: getattr(jax.config, name) for name in _CACHE_OPTIONS}  # jax's own, at start-up


def _restore_cache_baseline():
    if any(getattr(jax.config, name) != value for name, value in _CACHE_BASELINE.items()):
        for name, value in _CACHE_BASELINE.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


@pytest.fixture(autouse=True)
def _no_persistent_compile_cache_between_tests():
    # Before as well as after: a module-scoped fixture or an import may have changed the settings before
    # this test's own setup.
    _restore_cache_baseline()
    yield
    _restore_cache_baseline()


def replace(cfg, **kw):
    return dataclasses.replace(cfg, **kw)


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu are skipped where jax has no GPU. `-m slow` (or any -m) replaces the default
    `not slow and not gpu` selection, so a GPU test that is also slow would otherwise run on a CPU and fail."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    try:
        has_gpu = bool(jax.devices("gpu"))
    except RuntimeError:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA GPU (jax finds none)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop its compiled programs. An xdist worker runs hundreds of tests, and each
    CPU executable holds memory mappings of its own. Kept, they reached the kernel's limit
    (vm.max_map_count, 65,530; a crashed worker's core had 65,189 mappings); the next compile's mmap
    failed, and unwinding that error segfaulted the worker (two tests per run were rescheduled so)."""
    yield
    aot.clear_all()
    jax.clear_caches()
    gc.collect()


# A worker that dies mid-test (a native crash) gets that test rescheduled once on a fresh worker, so an
# intermittent crash in a native library does not fail the whole run; a test that crashes twice fails. Every
# crash is listed in the run's summary, so none goes unseen.
CRASHED_ONCE: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    if crashitem not in CRASHED_ONCE:
        CRASHED_ONCE.append(crashitem)
        sched.mark_test_pending(crashitem)
        report.outcome = "rerun"


def pytest_report_teststatus(report, config):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter):
    if CRASHED_ONCE:
        terminalreporter.section("tests whose worker crashed (rescheduled once)", sep="-", yellow=True)
        for nodeid in CRASHED_ONCE:
            terminalreporter.line(f"CRASHED {nodeid}")
