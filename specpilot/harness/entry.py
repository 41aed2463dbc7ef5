"""The experiments' Hydra entry points: a mistake in the command line (a misspelled key, an unknown group
option, a wrongly typed value) and an error of the run itself each end in one line on stderr, naming the
key and the nearest valid ones; `HYDRA_FULL_ERROR=1` keeps the traceback."""

from __future__ import annotations

import functools
import os
import sys
from typing import NoReturn

import hydra
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from specpilot.harness import config_errors
from specpilot.harness.config_errors import ConfigValueError

FULL_ERROR = "HYDRA_FULL_ERROR"
# the user's HYDRA_FULL_ERROR while `app` forces Hydra's on (inherited by a launcher's worker processes)
USER_FULL_ERROR = "SPECPILOT_USER_HYDRA_FULL_ERROR"


def full_error() -> bool:
    """Whether the user asked for tracebacks (HYDRA_FULL_ERROR=1)."""
    return os.environ.get(USER_FULL_ERROR, os.environ.get(FULL_ERROR, "")) == "1"


def app(config_path: str, config_name: str, options: str | None = None):
    """`hydra.main` for `task`, with composition errors reported in one line (exit status 2). `options`:
    the top-level key under which the script takes its own `+key.option=value` options."""
    def decorate(task):
        hydra_main = hydra.main(version_base=None, config_path=config_path, config_name=config_name)(task)

        @functools.wraps(task)
        def run() -> None:
            user = os.environ.get(FULL_ERROR, "")
            saved = os.environ.get(USER_FULL_ERROR)
            os.environ[USER_FULL_ERROR] = user
            os.environ[FULL_ERROR] = "1"  # Hydra then raises its composition errors instead of printing them
            try:
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
