"""The dry run's ranks, run one after another in this process (``--jobs 1``) or in N worker
processes (``--jobs N``), and the line each finished rank prints (`RankLines`).

A rank's dry run needs a process of its own while it runs (torch's fake process group is the
process's default group), so ranks in parallel are worker processes: ``spawn``ed (a fork would
copy this process's torch thread pools and the heartbeat's thread), each given the job once and
then one rank at a time over a pipe, so the parent always knows which rank a worker runs. A
worker that dies (killed for memory, a crash in a native library) is named with its rank and
exit status in that rank's row, a new worker takes the remaining ranks, and nothing waits on
the dead one. A rank's exception (outside the step, which `run_rank` already reports) is its
row's ``error``, in both modes: the other ranks' results are kept.

The rows are the same whichever mode ran them (the test compares ``--jobs 2`` with ``--jobs 1``):
each rank's dry run depends only on the job and the rank.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional

Row = dict[str, Any]


def rank_function(engine: str) -> Callable[[Any, int], Row]:
    """The function that dry-runs one rank on ``engine`` (``runtime`` or ``megatron``)."""
    if engine == "megatron":
        from megatron_dcp.dryrun.megatron_rank import run_megatron_rank

        return run_megatron_rank
    from megatron_dcp.dryrun.runtime_rank import run_rank

    return run_rank


def failed_row(rank: int, error: str, seconds: float) -> Row:
    """The row of a rank whose dry run left no record (``ran`` False: the consistency check
    leaves it out, its ``error`` names what happened)."""
    return {"rank": rank, "calls": [], "host_syncs": {}, "bytes_received": 0, "cpu_tensors": 0,
            "error": error, "predicted_bytes": None, "budget_bytes": None, "peak_bytes": 0,
            "peak_by_kind": {}, "seconds": round(seconds, 3), "ran": False}


def guarded(run_one: Callable[[Any, int], Row], job: Any, rank: int) -> Row:
    """``run_one(job, rank)``; an exception becomes the rank's row, named with the rank."""
    start = time.perf_counter()
    try:
        return run_one(job, rank)
    except Exception as exc:  # noqa: BLE001 - one rank's failure is that rank's row
        return failed_row(rank, f"rank {rank}: {type(exc).__name__}: {exc}",
                          time.perf_counter() - start)


def run_ranks(job: Any, ranks: list[int], engine: str, jobs: int,
              done: Callable[[Row], None], exit_at: Optional[int] = None) -> list[Row]:
    """Every rank's row, in rank order; ``done(row)`` as each finishes (in the order they
    finish). ``jobs``: worker processes (1: this process). ``exit_at``: negative control: the
    worker given that rank exits at once with status 3 (a worker that dies)."""
    if jobs <= 1 or len(ranks) <= 1:
        rows = []
        run_one = rank_function(engine)
        for rank in ranks:
            rows.append(guarded(run_one, job, rank))
            done(rows[-1])
        return rows
    return sorted(_Pool(job, engine, min(jobs, len(ranks)), exit_at).run(ranks, done),
                  key=lambda row: row["rank"])


def _worker(conn: Connection, job: Any, engine: str, exit_at: Optional[int]) -> None:
    """A worker process: dry-run each rank it is sent, send back its row; stop at ``None`` or
    when the parent is gone. Ctrl-C is the parent's to handle (it stops the workers), so a
    terminal's interrupt does not print a traceback from every worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_one = rank_function(engine)
    while True:
        try:
            rank = conn.recv()
        except EOFError:
            return
        if rank is None:
            return
        if rank == exit_at:
            os._exit(3)
        conn.send(guarded(run_one, job, rank))


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


class _Pool:
    """``jobs`` worker processes, each running one rank at a time (module doc)."""

    def __init__(self, job: Any, engine: str, jobs: int, exit_at: Optional[int]) -> None:
        self.job, self.engine, self.jobs, self.exit_at = job, engine, jobs, exit_at
        self.ctx = multiprocessing.get_context("spawn")
        self.busy: dict[Connection, tuple[Any, int, float]] = {}
        """A worker's pipe -> (its process, the rank it runs, when it was given it)."""

    def run(self, ranks: list[int], done: Callable[[Row], None]) -> list[Row]:
        pending, rows = deque(ranks), []
        restore = None
        if threading.current_thread() is threading.main_thread():  # a scheduler's SIGTERM: stop
            restore = signal.signal(signal.SIGTERM, _terminated)  # the workers too (finally)
        try:
            for _ in range(self.jobs):
                self._start(pending)
            while self.busy:
                ready = wait(list(self.busy) + [p.sentinel for p, _, _ in self.busy.values()])
                for conn in [c for c in list(self.busy) if c in ready or c.poll()]:
                    rows.append(self._finished(conn, pending))
                    done(rows[-1])
                for conn, (proc, rank, t0) in list(self.busy.items()):
                    if proc.sentinel in ready and not conn.poll():
                        rows.append(self._died(conn, pending))
                        done(rows[-1])
        finally:
            for proc, _, _ in self.busy.values():  # an interrupt: no worker outlives the run
                proc.kill()
                proc.join()
            if restore is not None:
                signal.signal(signal.SIGTERM, restore)
        return rows

    def _start(self, pending: deque) -> None:
        """A worker for the next pending rank (none when none is left)."""
        if not pending:
            return
        mine, theirs = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker, args=(theirs, self.job, self.engine,
                                                      self.exit_at), daemon=True)
        proc.start()
        theirs.close()
        self._give(mine, proc, pending)

    def _give(self, conn: Connection, proc: Any, pending: deque) -> None:
        """The worker's next rank, or its stop (then it leaves the busy set)."""
        if pending:
            rank = pending.popleft()
            conn.send(rank)
            self.busy[conn] = (proc, rank, time.perf_counter())
        else:
            self.busy.pop(conn, None)
            conn.send(None)
            proc.join()
            conn.close()

    def _finished(self, conn: Connection, pending: deque) -> Row:
        proc, rank, t0 = self.busy[conn]
        try:
            row = conn.recv()
        except (EOFError, OSError):  # it died as it answered
            return self._died(conn, pending)
        self._give(conn, proc, pending)
        return row

    def _died(self, conn: Connection, pending: deque) -> Row:
        """The row of the rank a dead worker ran; a new worker for the ranks left."""
        proc, rank, t0 = self.busy.pop(conn)
        proc.join()
        conn.close()
        status = proc.exitcode
        how = (f"was killed by signal {-status}" if status is not None and status < 0
               else f"exited with status {status}")
        row = failed_row(rank, f"rank {rank}: its worker process (pid {proc.pid}) {how} while "
                         "running it (a signal 9 is often the host's out-of-memory killer: "
                         "fewer --jobs)", time.perf_counter() - t0)
        self._start(pending)
        return row


class RankLines:
    """A line per finished rank and a running summary, printed through ``note`` (the progress
    bar's `Progress.note`: on stdout, flushed, so a log shows them as they come):

        rank 5 done (3 of 8): 12.4 s, activations 1.21 GiB measured vs 1.18 predicted (1.03x),
        1.2% of the budget's 101.90 GiB, 45 calls | 3 of 8 in 40 s, about 66 s left; highest
        1.05x (rank 2); 0 failed, 0 over budget
    """

    def __init__(self, total: int, note: Callable[[str], None]) -> None:
        self.total, self.note = total, note
        self.start = time.perf_counter()
        self.done = self.failed = self.over = 0
        self.highest: Optional[tuple[float, int]] = None

    def __call__(self, row: Row) -> None:
        """``row``: a rank's row of the report (`__main__._rank_row`)."""
        self.done += 1
        self.failed += bool(row["error"])
        self.over += bool(row["over_budget"])
        ratio = (row["peak_bytes"] / row["predicted_bytes"]
                 if row["predicted_bytes"] and not row["error"] else None)
        if ratio is not None and (self.highest is None or ratio > self.highest[0]):
            self.highest = (ratio, row["rank"])
        self.note(f"{self.rank_text(row, ratio)} | {self.summary()}")

    def rank_text(self, row: Row, ratio: Optional[float]) -> str:
        head = f"rank {row['rank']} {'FAILED' if row['error'] else 'done'} " \
               f"({self.done} of {self.total}): {row['seconds']:.1f} s"
        if row["error"]:
            return f"{head}: {row['error'][:200]}"
        gib = 2.0 ** 30
        text = f"{head}, activations {row['peak_bytes'] / gib:.2f} GiB measured"
        if ratio is not None:
            text += f" vs {row['predicted_bytes'] / gib:.2f} predicted ({ratio:.2f}x)"
        if row["budget_bytes"]:
            text += (f", {row['peak_bytes'] / row['budget_bytes']:.1%} of the budget's "
                     f"{row['budget_bytes'] / gib:.2f} GiB")
            text += " (OVER)" if row["over_budget"] else ""
        return text + f", {row['collectives']} calls"

    def summary(self) -> str:
        elapsed = time.perf_counter() - self.start
        text = f"{self.done} of {self.total} in {elapsed:.0f} s"
        if self.done < self.total:
            text += f", about {elapsed / self.done * (self.total - self.done):.0f} s left"
        if self.highest is not None:
            text += f"; highest {self.highest[0]:.2f}x (rank {self.highest[1]})"
        return text + f"; {self.failed} failed, {self.over} over budget"
