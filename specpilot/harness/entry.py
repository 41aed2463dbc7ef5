"""The experiments' Hydra entry points: a mistake in the command line (a misspelled key, an unknown group
option, a wrongly typed value) and an error of the run itself each end in one line on stderr, naming the
key and the nearest valid ones; `HYDRA_FULL_ERROR=1` keeps the traceback."""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from specpilot.harness import config_errors
from specpilot.harness.config_errors import ConfigValueError
from specpilot.harness.config_schema import PlanConf

FULL_ERROR = "HYDRA_FULL_ERROR"
NEW_PLAN_PREFIX = "decoding.plans."
# the user's HYDRA_FULL_ERROR while `app` forces Hydra's on (inherited by a launcher's worker processes)
USER_FULL_ERROR = "SPECPILOT_USER_HYDRA_FULL_ERROR"


def full_error() -> bool:
    """Whether the user asked for tracebacks (HYDRA_FULL_ERROR=1)."""
    return os.environ.get(USER_FULL_ERROR, os.environ.get(FULL_ERROR, "")) == "1"


def app(config_path: str, config_name: str, options: str | None = None):
    """`hydra.main` for `task`, with composition errors reported in one line (exit status 2). `options`:
    the top-level key under which the script takes its own `+key.option=value` options."""
    def decorate(task):
        new_plans: dict = {}

        @functools.wraps(task)
        def with_new_plans(cfg: DictConfig):
            if new_plans:
                try:
                    cfg = add_plans(cfg, new_plans)
                except (OmegaConfBaseException, ConfigValueError) as e:  # in the job: Hydra would add a line
                    discard_if_empty(Path(HydraConfig.get().runtime.output_dir))
                    if full_error():
                        raise
                    message = str(e) if isinstance(e, ConfigValueError) else config_errors.from_composition(e, options)
                    print(f"config error: {message}", file=sys.stderr)
                    sys.exit(2)
            return task(cfg)

        hydra_main = hydra.main(version_base=None, config_path=config_path, config_name=config_name)(with_new_plans)

        @functools.wraps(task)
        def run() -> None:
            user = os.environ.get(FULL_ERROR, "")
            saved = os.environ.get(USER_FULL_ERROR)
            os.environ[USER_FULL_ERROR] = user
            os.environ[FULL_ERROR] = "1"  # Hydra then raises its composition errors instead of printing them
            try:
                sys.argv[1:], plans = split_new_plans(sys.argv[1:])
                new_plans.clear()
                new_plans.update(plans)
                hydra_main()
            except (HydraException, OmegaConfBaseException) as e:
                if user == "1":
                    raise
                print(f"config error: {config_errors.from_composition(e, options)}", file=sys.stderr)
                sys.exit(2)
            finally:
                _restore(FULL_ERROR, user or None)
                _restore(USER_FULL_ERROR, saved)

        return run

    return decorate


def split_new_plans(args: list[str]) -> tuple[list[str], dict]:
    """The command line without the overrides that add a plan (`+decoding.plans.NAME={...}`) and those
    that then set a field of it, and those plans as {NAME: fields}. Hydra applies an override through `OmegaConf.update`, which cannot add an entry to
    the typed plans mapping; a merge can, so the entry points merge these plans after composition."""
    parser = OverridesParser.create()
    names: set[str] = set()
    kept, plans = [], {}
    for arg in args:
        key = arg.split("=", 1)[0] if "=" in arg and not arg.startswith("-") else ""
        bare = key.lstrip("+")
        if not bare.startswith(NEW_PLAN_PREFIX) or len(bare) == len(NEW_PLAN_PREFIX):
            kept.append(arg)
            continue
        path = bare[len(NEW_PLAN_PREFIX):].split(".")
        if not (key.startswith("+") and len(path) == 1 or path[0] in names):
            kept.append(arg)  # a field of a plan the config already has: Hydra's own override
            continue
        override = parser.parse_override(arg)
        if override.is_sweep_override():
            raise HydraException(f"{bare}: a new plan cannot be swept; add it in a conf/decoding/ file")
        names.add(path[0])
        node = plans
        for part in path[:-1]:
            node = node.setdefault(part, {})
        value = override.value()
        node[path[-1]] = _merged(node.get(path[-1]), value)
    return kept, plans


def _merged(old, new):
    """A later override of the same plan field: dicts merge (as Hydra's own), anything else replaces."""
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{k: _merged(old.get(k), v) for k, v in new.items()}}
    return new


def add_plans(cfg: DictConfig, plans: dict) -> DictConfig:
    """cfg with `plans` merged into decoding.plans (each field checked against the plan schema first,
    so a misspelled field is named with its plan)."""
    for name, fields in plans.items():
        where = f"{NEW_PLAN_PREFIX}{name}"
        if not isinstance(fields, dict):
            raise ConfigValueError(f"{where}: a plan is a mapping of its fields ({{verify: chain, ...}}), "
                                   f"got {fields!r}")
        try:
            OmegaConf.merge(OmegaConf.structured(PlanConf), fields)
        except OmegaConfBaseException as e:
            key, parent = getattr(e, "full_key", "") or "", getattr(e, "parent_node", None)
            if isinstance(e, ConfigKeyError) and key and hasattr(parent, "keys"):
                raise ConfigValueError(config_errors.unknown_key(f"{where}.{key}", list(parent.keys()))) from e
            first = (getattr(e, "msg", None) or str(e)).splitlines()[0]
            raise ConfigValueError(f"{where}.{key}: {first}" if key else f"{where}: {first}") from e
    open_cfg = cfg.copy()
    OmegaConf.set_struct(open_cfg, False)  # the new names only: each plan's fields stay typed
    merged = OmegaConf.merge(open_cfg, {"decoding": {"plans": plans}})
    OmegaConf.set_struct(merged, True)
    return merged


def discard_if_empty(folder: Path) -> None:
    """Remove a run's output folder if it holds nothing but Hydra's own bookkeeping."""
    if folder.is_dir() and all(p.name in (".hydra", "run.log") for p in folder.iterdir()):
        shutil.rmtree(folder, ignore_errors=True)


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def report(e: BaseException) -> NoReturn:
    """End a run that failed with `e`: one line on stderr and exit status 1 (re-raised with
    HYDRA_FULL_ERROR=1)."""
    if full_error():
        raise e
    message = " ".join(str(e).split())
    if isinstance(e, ConfigValueError):
        print(f"config error: {message}", file=sys.stderr)
    else:
        print(f"error: {type(e).__name__}: {message} (HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
    sys.exit(1)
