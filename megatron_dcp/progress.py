"""A progress bar on stderr for the tools' long work (simulating policies at large worlds,
building a dataset, dry-running ranks): drawn only when stderr is a terminal, at most ten times a
second; a log file or a CI job gets nothing. A tool that prints lines while the bar is shown
prints them with `Progress.note`, so that lines and bar do not mix. Pure Python."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

WIDTH = 120
"""Columns the bar's line takes (padded, so a shorter line erases a longer one)."""


class Progress:
    """``with Progress("policies", total=5) as bar: ... bar.update(label="dcp")``."""

    def __init__(self, what: str, total: Optional[int] = None,
                 stream: Optional[TextIO] = None, enabled: Optional[bool] = None):
        self.what, self.total, self.done = what, total, 0
        self.stream = stream or sys.stderr
        self.enabled = (self.stream.isatty() if hasattr(self.stream, "isatty") else False) \
            if enabled is None else enabled
        self.start = time.perf_counter()
        self._drawn = 0.0
        self._label: Optional[str] = None  # the label of the bar on the screen (None: none)

    def update(self, n: int = 1, label: str = "") -> None:
        self.done += n
        now = time.perf_counter()
        last = self.total is not None and self.done >= self.total
        if self.enabled and (last or now - self._drawn >= 0.1):
            self._drawn, self._label = now, label
            self.stream.write("\r" + self.line(label))
            self.stream.flush()

    def note(self, text: str) -> None:
        """Print ``text`` on stdout above the bar: on a terminal the bar's line is erased
        first and the bar drawn again after it."""
        shown = self.enabled and self._label is not None
        if shown:
            self.stream.write("\r" + " " * WIDTH + "\r")
            self.stream.flush()
        print(text, flush=True)
        if shown:
            self.stream.write("\r" + self.line(self._label))
            self.stream.flush()

    def line(self, label: str = "") -> str:
        """The bar as it is drawn: ``what [####....] done/total  elapsed, rate``."""
        elapsed = time.perf_counter() - self.start
        if self.total:
            filled = 30 * min(self.done, self.total) // self.total
            bar = f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}"
        else:
            bar = f"{self.done}"
        rate = f"{elapsed / self.done:.2f} s each" if self.done else ""
        text = f"{self.what} {bar}  {elapsed:.0f} s {rate} {label}".rstrip()
        return text[:WIDTH].ljust(WIDTH if self.enabled else 0)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled and self.done:
            self.stream.write("\n")
            self.stream.flush()


class Heartbeat:
    """Lines on stderr while long work runs, also where no bar is drawn (a log file, a CI job):
    ``with Heartbeat("dcp-simulate") as beat: beat.stage("planning dcp"); ...``. Nothing is
    printed for work that ends within ``after`` seconds; past it, a line names the stage and the
    time spent, again at every new stage and every ``every`` seconds within one (a thread
    prints them, so a single long call, a planner at 100,000 ranks, is not silent)."""

    def __init__(self, tool: str, after: float = 5.0, every: float = 30.0,
                 stream: Optional[TextIO] = None):
        import threading

        self.tool, self.after, self.every = tool, after, every
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self._stage, self._printed, self._said = "starting", 0.0, ""
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def stage(self, text: str) -> None:
        """The work from now on (``planning dcp``); said at once when past ``after``."""
        with self._lock:
            self._stage = text
        self._beat(force=True)

    def _beat(self, force: bool = False) -> None:
        now = time.perf_counter()
        with self._lock:
            elapsed = now - self.start
            due = force and self._said != self._stage or now - self._printed >= self.every
            if elapsed < self.after or not due:
                return
            self._printed, self._said = now, self._stage
            erase = "\r" + " " * WIDTH + "\r" if getattr(self.stream, "isatty", bool)() else ""
            self.stream.write(f"{erase}[{self.tool}] {elapsed:.0f} s: {self._stage} ...\n")
            self.stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self._beat(force=True)

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
