"""Name the rank that stalled or died: at once while the others wait, and when a collective fails.

A collective that times out (a rank stopped, hung in a device call, or dead) says nothing about
*which* rank is missing: gloo reports "Timed out waiting ... for recv", NCCL the operation. So
every rank runs a *responder*: a daemon thread that looks for a probe key in the job's
rendezvous store (its own connection) once a second and answers it. A probe sets the key and
waits a few seconds for the answers: the threads of live ranks answer within a second, even while
their main thread is blocked in a collective; a stopped or dead process cannot. A rank whose
responder stopped on purpose (its process ended) is marked done and never named.

Two uses:
* the *watch* (``interval_s`` > 0, `StepDriver` passes ``DCPConfig.liveness_interval_s``): the
  first and the last rank probe every ``interval_s`` seconds; a rank missing from two probes in a
  row is named on every live rank, which then ends (exit status `STALL_EXIT_CODE`). The job's
  collective timeout can then be long (a long, healthy step never reaches it) while a stalled
  rank still ends the job within about two intervals;
* when a step fails with a communication error, `RankFailureError` names the ranks that did not
  answer (`names_unresponsive_ranks`).
The good case costs a few tiny store lookups per rank and second, and one probe per watching
rank and interval (a thread blocked in the store's ``wait`` instead would abort the process at
exit, inside the C++ call); the thread is stopped at interpreter exit. On NCCL, torch's watchdog
ends a process whose collective timed out before Python sees an exception; its own message names
the collective, the second use's message is not printed there (the watch's is).
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

PROBE_KEY = "megatron_dcp/liveness/probe"
"""The newest probe's generation (an integer); responders answer every generation they see."""
GENERATION_KEY = "megatron_dcp/liveness/generation"
ANSWER_KEY = "megatron_dcp/liveness/alive/{generation}/{rank}"
DONE_KEY = "megatron_dcp/liveness/done/{rank}"
"""Set by a rank whose responder stopped on purpose (its process is ending): not a stall."""
STOPPED_KEY = "megatron_dcp/liveness/stopped"
"""How many ranks stopped their responder on purpose (`wait_for_responders`)."""
STARTED_KEY = "megatron_dcp/liveness/started"
"""How many ranks started a responder: the watch probes nobody until every rank has."""
VERDICT_KEY = "megatron_dcp/liveness/verdict"
"""Set by the watch when a rank missed two probes in a row: every live rank reads it and ends."""
POLL_S = 1.0
"""How often a responder looks for the probe key."""
PROBE_WAIT_S = 3.0
"""How long a probing rank waits for the answers (live ranks answer within ``POLL_S``)."""
STALL_EXIT_CODE = 75
"""Exit status of a rank the watch ends because another rank stalled."""
COMMUNICATION_ERRORS = ("timed out", "timeout", "connection closed", "connection reset",
                        "broken pipe", "connection refused", "remote worker")
"""Words of the errors of a collective whose peer is missing (gloo, NCCL, the store)."""


class RankFailureError(RuntimeError):
    """A collective failed and these ranks did not answer a liveness probe (stalled or dead)."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


_responder: Optional[threading.Thread] = None
_main_store: Optional[Any] = None
"""The main thread's own store connection, made while the store still answers: connecting anew
after its host died would wait for the job's whole store timeout (30 minutes)."""
_lock = threading.Lock()
_stop = threading.Event()


def _store() -> Optional[Any]:
    """A new client connection to the job's rendezvous store, or None when there is none."""
    try:
        return dist.distributed_c10d._get_default_store().clone()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _probe(store: Any, world: int, wait_s: float,
           answer: Optional[Callable[[], None]] = None) -> list[int]:
    """One probe of every rank over ``store``: the ranks that neither answered within ``wait_s``
    nor ended on purpose (their responder stopped at exit). ``answer``: called while waiting, by
    a prober on a responder's own thread (it keeps answering other probes, its own included)."""
    generation = int(store.add(GENERATION_KEY, 1))
    keys = [ANSWER_KEY.format(generation=generation, rank=r) for r in range(world)]
    store.set(PROBE_KEY, str(generation))
    deadline = time.monotonic() + wait_s
    while True:  # polled, not store.wait: the store logs every wait that times out
        if answer is not None:
            answer()
        if store.check(keys):
            missing: list[int] = []
            break
        if time.monotonic() >= deadline:
            missing = [r for r, key in enumerate(keys) if not store.check([key])
                       and not store.check([DONE_KEY.format(rank=r)])]
            break
        time.sleep(min(0.1, POLL_S))
    for key in keys:  # the store keeps no key per rank and probe
        try:
            store.delete_key(key)
        except Exception:  # noqa: BLE001 - a store without delete: the keys stay, harmless
            break
    return missing


def _end_job(verdict: str) -> None:
    """Every live rank's end once the watch has named a stalled rank: the main thread is blocked
    in a collective that would wait for the whole process-group timeout."""
    print(verdict, file=sys.stderr, flush=True)
    sys.stdout.flush()
    # The rank hosting the store must outlive every responder's next look at the verdict, or a
    # rank that has not read it yet would wait for its collective's whole timeout.
    time.sleep(3 * POLL_S)
    os._exit(STALL_EXIT_CODE)


def _serve(store: Any, rank: int, world: int, interval_s: float) -> None:
    """The responder thread: answer every probe, and, on the watching ranks (the first and the
    last), probe every ``interval_s`` seconds; a rank missing from two probes in a row is named
    on every live rank, which then ends (`_end_job`)."""
    answered = 0

    def answer() -> None:
        nonlocal answered
        if store.check([VERDICT_KEY]):
            _end_job(store.get(VERDICT_KEY).decode())
        if store.check([PROBE_KEY]):
            newest = int(store.get(PROBE_KEY))
            # answer every generation since the last one seen (two ranks may probe at once)
            for generation in range(max(answered + 1, newest - 15), newest + 1):
                store.set(ANSWER_KEY.format(generation=generation, rank=rank), "1")
            answered = max(answered, newest)

    watching = interval_s > 0 and world > 1 and rank in (0, world - 1)
    next_probe = time.monotonic() + interval_s
    suspects: list[int] = []
    while not _stop.wait(POLL_S):
        try:
            answer()
            if not watching or time.monotonic() < next_probe:
                continue
            next_probe = time.monotonic() + interval_s
            if int(store.add(STARTED_KEY, 0)) < world:
                continue  # a rank still starting up is not stalled
            missing = _probe(store, world, PROBE_WAIT_S, answer)
            stalled = sorted(set(missing) & set(suspects))
            suspects = missing
            if stalled:
                store.set(VERDICT_KEY, (
                    f"megatron-dcp liveness watch (rank {rank}): rank(s) {stalled} did not "
                    f"answer two liveness probes {interval_s:g} s apart: stalled (stopped, hung "
                    "in a device call) or dead; the other ranks answered. Ending the job now "
                    f"(exit status {STALL_EXIT_CODE}) instead of at the process-group timeout."))
        except Exception:  # noqa: BLE001 - the store is busy or gone: look again later
            continue


def start_responder(interval_s: float = 0.0) -> bool:
    """Start this process's responder thread once (after the default process group exists);
    returns whether one runs. ``interval_s`` > 0: the first and the last rank also watch (probe
    every ``interval_s`` seconds and end the job when a rank misses two probes in a row)."""
    global _responder, _main_store
    if not dist.is_available() or not dist.is_initialized():
        return False
    with _lock:
        if _responder is not None and _responder.is_alive():
            return True
        store, _main_store = _store(), _store()
        if store is None or _main_store is None:
            return False
        for connection in (store, _main_store):  # a stopped store host: give up soon
            connection.set_timeout(timedelta(seconds=5 * POLL_S))
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            store.add(STARTED_KEY, 1)
        except Exception:  # noqa: BLE001 - no store: nothing to answer
            return False
        _stop.clear()
        _responder = threading.Thread(target=_serve, args=(store, rank, world, interval_s),
                                      name="megatron-dcp-liveness", daemon=True)
        _responder.start()
    return True


def stop_responder() -> None:
    """Stop this process's responder (also at interpreter exit: a thread inside a store call
    while the interpreter shuts down aborts the process); the rank is then marked as ended on
    purpose, so the watch does not name it."""
    global _responder
    _stop.set()
    thread = _responder
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=10 * POLL_S)
    store = _main_store
    if thread is not None and store is not None and dist.is_available() and dist.is_initialized():
        try:
            store.set_timeout(timedelta(seconds=5 * POLL_S))
            store.set(DONE_KEY.format(rank=dist.get_rank()), "1")
            store.add(STOPPED_KEY, 1)
        except Exception:  # noqa: BLE001 - the store's host is gone: nobody watches
            pass
    _responder = None


def wait_for_responders(timeout_s: float = 15.0) -> None:
    """On the rank hosting the rendezvous store (rank 0): wait until every rank that started a
    responder has stopped it (`stop_responder`), at most ``timeout_s`` seconds, so that no
    responder looks into a store whose host has exited (torch prints a C++ trace for each such
    look, though the job ended well). Other ranks return at once; so does a job without
    responders. Call it after `stop_responder`, while ending the job."""
    store = _main_store
    if store is None or not (dist.is_available() and dist.is_initialized()) or dist.get_rank():
        return
    deadline = time.monotonic() + timeout_s
    try:
        while (int(store.add(STOPPED_KEY, 0)) < int(store.add(STARTED_KEY, 0))
               and time.monotonic() < deadline):
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store does not answer: nothing to wait for
        pass


atexit.register(stop_responder)


def unresponsive_ranks(wait_s: float = PROBE_WAIT_S) -> Optional[list[int]]:
    """Probe every rank of the job; the ranks whose responder did not answer within ``wait_s``
    seconds, or None when the store itself does not answer."""
    store = _main_store if _main_store is not None else _store()
    if store is None:
        return None
    try:
        store.set_timeout(timedelta(seconds=wait_s))
        return _probe(store, dist.get_world_size(), wait_s)
    except Exception:  # noqa: BLE001 - the store's host is gone or stopped
        return None


def is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) looks like a collective that lost a peer."""
    while exc is not None:
        text = str(exc).lower()
        if any(word in text for word in COMMUNICATION_ERRORS):
            return True
        exc = exc.__cause__
    return False


def describe(exc: BaseException, wait_s: float = PROBE_WAIT_S) -> Optional[RankFailureError]:
    """The `RankFailureError` for a communication failure ``exc`` (None for other errors, or
    when every rank answered: then the failure is not a missing rank)."""
    if not dist.is_available() or not dist.is_initialized() or not is_communication_error(exc):
        return None
    me = dist.get_rank()
    missing = unresponsive_ranks(wait_s)
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    if missing is None:
        return RankFailureError(
            f"rank {me}: a collective failed ({first}) and the job's rendezvous store does not "
            "answer either: the rank that hosts it (rank 0 under the deepspeed launcher) is "
            "stalled or dead", [0])
    if not missing:
        return None
    return RankFailureError(
        f"rank {me}: a collective failed ({first}); rank(s) {missing} did not answer a liveness "
        f"probe within {wait_s:g} s: stalled (stopped, hung in a device call) or dead; the other "
        "ranks answered", missing)


def names_unresponsive_ranks(step: Callable) -> Callable:
    """Decorator: ``step`` raises `RankFailureError` (naming the stalled or dead ranks, the
    original error chained) instead of a bare communication error. The step starts the
    responders (`start_responder`), at its beginning on every rank."""

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return step(*args, **kwargs)
        except RankFailureError:
            raise
        except Exception as exc:
            named = describe(exc)
            if named is None:
                raise
            raise named from exc

    return wrapper
