"""Name the rank that stalled or died when a collective fails.

A collective that times out (a rank stopped, hung in a device call, or dead) says nothing about
*which* rank is missing: gloo reports "Timed out waiting ... for recv", NCCL the operation. So
every rank runs a *responder*: a daemon thread that looks for a probe key in the job's
rendezvous store (its own connection) once a second and answers it. When a step fails with a
communication error, the rank sets the probe key and waits a few seconds for the answers: the
threads of live ranks answer within a second, even while their main thread is blocked in a
collective; a stopped or dead process cannot. `RankFailureError` then names the ranks that did
not answer. The good case costs one tiny store lookup per rank and second (a thread blocked in
the store's ``wait`` instead would abort the process at exit, inside the C++ call), and the
thread is stopped at interpreter exit.

`names_unresponsive_ranks` wraps a step function with this (`StepDriver.step` uses it). On NCCL,
torch's watchdog ends a process whose collective timed out before Python sees an exception; its
own message names the collective, this one is not printed there.
"""

from __future__ import annotations

import atexit
import functools
import threading
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

PROBE_KEY = "megatron_dcp/liveness/probe"
ANSWER_KEY = "megatron_dcp/liveness/alive/{rank}"
POLL_S = 1.0
"""How often a responder looks for the probe key."""
PROBE_WAIT_S = 3.0
"""How long a probing rank waits for the answers (live ranks answer within ``POLL_S``)."""
COMMUNICATION_ERRORS = ("timed out", "timeout", "connection closed", "connection reset",
                        "broken pipe", "connection refused", "remote worker")
"""Words of the errors of a collective whose peer is missing (gloo, NCCL, the store)."""


class RankFailureError(RuntimeError):
    """A collective failed and these ranks did not answer a liveness probe (stalled or dead)."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


_responder: Optional[threading.Thread] = None
_lock = threading.Lock()
_stop = threading.Event()


def _store() -> Optional[Any]:
    """A new client connection to the job's rendezvous store, or None when there is none."""
    try:
        return dist.distributed_c10d._get_default_store().clone()
    except (AttributeError, RuntimeError, ValueError):
        return None


def start_responder() -> bool:
    """Start this process's responder thread once (after the default process group exists);
    returns whether one runs."""
    global _responder
    if not dist.is_available() or not dist.is_initialized():
        return False
    with _lock:
        if _responder is not None and _responder.is_alive():
            return True
        store = _store()
        if store is None:
            return False
        store.set_timeout(timedelta(seconds=5 * POLL_S))  # a stopped store host: give up soon
        rank = dist.get_rank()

        def answer() -> None:
            while not _stop.wait(POLL_S):
                try:
                    if store.check([PROBE_KEY]):
                        store.set(ANSWER_KEY.format(rank=rank), "alive")
                        return
                except Exception:  # noqa: BLE001 - the store is busy or gone: look again later
                    continue

        _stop.clear()
        _responder = threading.Thread(target=answer, name="megatron-dcp-liveness", daemon=True)
        _responder.start()
    return True


def stop_responder() -> None:
    """Stop this process's responder (also at interpreter exit: a thread inside a store call
    while the interpreter shuts down aborts the process)."""
    _stop.set()
    thread = _responder
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=10 * POLL_S)


atexit.register(stop_responder)


def unresponsive_ranks(wait_s: float = PROBE_WAIT_S) -> Optional[list[int]]:
    """Probe every rank of the job; the ranks whose responder did not answer within ``wait_s``
    seconds, or None when the store itself does not answer."""
    store = _store()
    if store is None:
        return None
    world = dist.get_world_size()
    keys = [ANSWER_KEY.format(rank=r) for r in range(world)]
    try:
        store.set_timeout(timedelta(seconds=wait_s))
        store.set(PROBE_KEY, "1")
        try:
            store.wait(keys, timedelta(seconds=wait_s))
            return []
        except Exception:  # noqa: BLE001 - some did not answer: find which
            return [r for r, key in enumerate(keys) if not store.check([key])]
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
    original error chained) instead of a bare communication error."""

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start_responder()
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
