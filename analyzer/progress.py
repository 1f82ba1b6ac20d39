"""The progress bar of a command's long stages: on a terminal, and in any log for a long run."""

from __future__ import annotations

import os
import sys
import time

from .trace import Trace

# A run with more (step x tensor) cells than this, or more rank files than MANY_FILES, is long: its
# analysis shows progress even when stderr is not a terminal (a CI log). TORCHAUTOPSY_PROGRESS=1 /
# =0 forces the bar on / off.
LONG_RUN_CELLS = 50_000_000
MANY_FILES = 256


class Progress:
    """A progress bar on stderr (tqdm) for the long stages of a command (opening the rank files,
    the analysis, the report), silent when disabled. ``progress(done, total, what)`` moves it (drawn
    at most twice a second); ``close()`` clears it before anything is printed."""

    def __init__(self, n_files: int):
        self.forced = os.environ.get("TORCHAUTOPSY_PROGRESS")
        self.enabled = self.forced == "1" or (self.forced != "0" and (sys.stderr.isatty() or n_files > MANY_FILES))
        self.bar = None
        self.drawn, self.stage = 0.0, ""
        self.skipped = None  # (done, total, what) of the last update not drawn

    def long_run(self, trace: Trace) -> None:
        """Enable the bar for a run whose tables are large (once its files are open)."""
        cells = sum(r.n_steps * max(len(r.param_names), 1) for r in trace.ranks.values())
        self.enabled = self.enabled or (self.forced != "0" and cells > LONG_RUN_CELLS)

    def __call__(self, done: int, total: int, what: str) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="torchautopsy", unit="part", file=sys.stderr, leave=False,
                            mininterval=0.5, dynamic_ncols=True)
        stage = what.split(":")[0]
        if done < total and stage == self.stage and time.monotonic() - self.drawn < 0.5:
            self.skipped = (done, total, what)  # (10,000 ranks: a line a rank would flood a log)
            return
        if stage != self.stage and self.skipped is not None:
            self._draw(*self.skipped)  # the stage's last state, skipped above, before the next stage
        self.drawn, self.stage, self.skipped = time.monotonic(), stage, None
        self._draw(done, total, what)

    def _draw(self, done: int, total: int, what: str) -> None:
        self.bar.total, self.bar.n = total, done
        self.bar.set_postfix_str(what, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
