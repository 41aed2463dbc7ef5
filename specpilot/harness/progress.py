"""Progress on long work (a deployment's build, a plan's timed runs, token forcing), shown as it happens.

On a terminal each phase is a tqdm bar on stderr whose elapsed time keeps ticking while a single long call
(a build, a compile) runs; elsewhere (logs, tests, CI) a phase is log lines: one as it starts, one every
`HEARTBEAT_S` while it runs, one with its elapsed time as it ends ("<phase> in 12.3 s").
`SPECPILOT_PROGRESS=1` forces the bars, `=0` turns them off. Design notes: docs/design/harness.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Iterator

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

log = logging.getLogger(__name__)

HEARTBEAT_S = 30.0  # a log line this often while a phase runs (not a terminal)
REFRESH_S = 0.5  # a bar's elapsed time is redrawn this often
ENV = "SPECPILOT_PROGRESS"


def bars_enabled(stream=None) -> bool:
    """Whether phases draw bars: `SPECPILOT_PROGRESS` if set to 0/1, else whether `stream` (stderr) is a
    terminal."""
    forced = os.environ.get(ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Phase:
    """A running phase: `advance(n, note)` after each of its steps (a batch, a repeat)."""

    def __init__(self, name: str, total: int | None, logger: logging.Logger, bar: tqdm | None):
        self.name, self.total, self.logger, self.bar = name, total, logger, bar
        self.done, self.t0 = 0, time.perf_counter()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True, name=f"progress: {name}")

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def advance(self, n: int = 1, note: str | None = None) -> None:
        self.done += n
        if self.bar is not None:
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(n)
            self.bar.refresh()  # a step is seconds long: draw it now, whatever tqdm's minimum interval

    def _tick(self) -> None:
        interval = REFRESH_S if self.bar is not None else HEARTBEAT_S
        while not self._stop.wait(interval):
            if self.bar is not None:
                self.bar.refresh()
            else:
                steps = f", {self.done}/{self.total}" if self.total else ""
                self.logger.info("%s: still running (%.0f s%s)", self.name, self.elapsed, steps)


@contextlib.contextmanager
def phase(name: str, total: int | None = None, logger: logging.Logger | None = None, stream=None,
          unit: str = "batch") -> Iterator[Phase]:
    """A phase of long work named `name` (with `total` steps of `unit`, if known); its end is logged with
    its time."""
    logger = logger or log
    stream = sys.stderr if stream is None else stream
    bar, console = None, contextlib.nullcontext()
    if bars_enabled(stream):
        bar = tqdm(total=total, desc=name, file=stream, leave=False, dynamic_ncols=True, unit=unit,
                   bar_format=None if total else "{desc}: {elapsed}{postfix}")
        console = logging_redirect_tqdm()  # log lines printed above the bar, not through it
    else:
        logger.info("%s ...", name)
    p = Phase(name, total, logger, bar)
    p._ticker.start()
    try:
        with console:
            yield p
    finally:
        p._stop.set()
        p._ticker.join()
        if bar is not None:
            bar.close()
    logger.info("%s in %.1f s", name, p.elapsed)
