"""Progress on stderr for the tier's long calls: the row-by-row attention and the plan executor."""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress report on stderr for a long call: silent for its first ``after`` seconds, and
    always when stderr is not a terminal (tests, doctests, pipes, logs)."""

    def __init__(self, label: str, total: int, after: float = 3.0):
        self.label, self.total, self.done, self.after = label, max(int(total), 1), 0, after
        self.start = self.last = time.perf_counter()
        self.live, self.shown = sys.stderr.isatty(), False

    def advance(self, work: int):
        self.done += int(work)
        now = time.perf_counter()
        if self.live and now - self.start >= self.after and (now - self.last >= 0.5 or self.done >= self.total):
            self.last, self.shown = now, True
            sys.stderr.write(f"\r{self.label}: {100 * self.done / self.total:3.0f}% ({now - self.start:.0f} s)")
            sys.stderr.flush()

    def close(self):
        if self.shown:
            sys.stderr.write("\n")
