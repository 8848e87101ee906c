"""`OrderedReduction`: the gradient reduction overlapped with each rank's last micro-step, bucket
by bucket, in one order on every rank.

An engine reduces gradients over the DCP world in buckets (Megatron's DDP bucket groups) and can
start a bucket's reduction asynchronously. Under DCP the ranks run different micro-steps, with
gradient sync off for all but each rank's last (the accumulation boundary); in that last
micro-step a bucket may be reduced as soon as its gradients are final, hidden behind the rest of
the backward. Three rules make that exact and free of hangs whatever the ranks' tasks:

1. **One order.** The buckets of a domain (those reduced over one communicator) are dispatched
   in one fixed order, the engine's (the order a backward finishes them), a bucket only after
   every bucket before it; what the last backward did not dispatch, `dispatch_rest` dispatches
   after it, in that order. So every rank issues the same collectives in the same order, early
   or late: a rank without a task joins with the zero gradients of its empty micro-step.
2. **Final gradients only.** A parameter's gradient is final in a backward once its
   accumulation ran as many times as it runs in that kind of micro-step. The count depends on
   the micro-step's shape (MLP and loss tiles re-run parts of the graph per tile), so it is
   learned per shape (`shape_key`) from the first last micro-step of that shape, which dispatches
   nothing early; a bucket is dispatched early only when every parameter's count equals the
   learned one. A parameter whose count differs (an expert that got no token) only delays its
   bucket to `dispatch_rest`.
3. **Checked.** A parameter accumulated again after its bucket was dispatched is an error at
   `dispatch_rest`, naming it: never a silently wrong sum.

The counting runs in a hook after each parameter's gradient accumulation (after the engine's
own hooks, registered earlier), only while `armed`. Before dispatching a bucket the hook takes
a probe of its gradients (``nan`` when one is not finite, else 0), so the non-finite check sees
each rank's own gradients before any reduction (`probes`). Engine-neutral: the engine hands in
its buckets (`Bucket`: parameters, gradient storage, a function that starts the reduction).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

__all__ = ["Bucket", "OrderedReduction", "OverlapError", "shape_key"]


class OverlapError(RuntimeError):
    """A gradient accumulated after its bucket's reduction started (not exact)."""


@dataclass
class Bucket:
    """One unit of the engine's reduction: ``params`` (their gradients are final together),
    ``grads`` (the storage the reduction reads, probed for non-finite values before it starts)
    and ``start`` (starts the reduction asynchronously; the engine waits for it later)."""

    params: Sequence[torch.nn.Parameter]
    grads: Sequence[torch.Tensor]
    start: Callable[[], Any]


def shape_key(task: Any) -> Hashable:
    """What decides how often each parameter's gradient accumulates in a micro-step's backward:
    an empty micro-step or a task, its recomputed and offloaded layers, its MLP and loss tiles
    (``task``: the micro-step's `TaskContext`, or ``None``)."""
    if task is None:
        return ("none",)
    return (getattr(task, "id", 0) == -1, int(getattr(task, "recompute_layers", 0)),
            int(getattr(task, "mlp_tiles", 1) or 1), int(getattr(task, "loss_tiles", 1) or 1),
            int(getattr(task, "offload_layers", 0) or 0))


class OrderedReduction:
    """The overlapped reduction of one rank's buckets (module docstring). ``domains``: lists of
    `Bucket`, each list in its dispatch order (one list per communicator); ``names``: a name
    per parameter for the error of rule 3.

    Per step: `begin` (the shape of the rank's last micro-step), `arm` / `disarm` around that
    micro-step's backward (a pipeline schedule arms around each model chunk's last backward),
    then `dispatch_rest` before the engine waits for the reductions. `remove` takes the hooks
    off."""

    def __init__(self, domains: Sequence[Sequence[Bucket]],
                 names: Optional[dict[int, str]] = None) -> None:
        self.domains = [list(d) for d in domains if d]
        self.names = names or {}
        self._where: dict[int, tuple[int, int]] = {}
        self.learned: dict[Hashable, dict[int, int]] = {}
        """Per micro-step shape: how often each parameter (by id) accumulates in its backward."""
        self.armed = False
        self.key: Optional[Hashable] = None
        self.counts: dict[int, int] = {}
        self.next = [0] * len(self.domains)
        self.early = 0
        """Buckets dispatched inside the last backward in the current step."""
        self.probes: list[torch.Tensor] = []
        self._late: list[int] = []
        self._left: list[list[int]] = []
        self._off: list[list[bool]] = []
        self._hooks, self._nodes = [], []
        with torch.enable_grad():
            for d, buckets in enumerate(self.domains):
                for b, bucket in enumerate(buckets):
                    for p in bucket.params:
                        self._where[id(p)] = (d, b)
                        # the parameter's accumulation node (the engine holds it alive too)
                        node = p.expand_as(p).grad_fn.next_functions[0][0]
                        self._nodes.append(node)
                        self._hooks.append(node.register_hook(
                            functools.partial(self._accumulated, id(p))))

    def covers(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param`` is in one of the buckets (its non-finite check is the probes')."""
        return id(param) in self._where

    @property
    def buckets(self) -> int:
        """Buckets over every domain."""
        return sum(len(d) for d in self.domains)

    def begin(self, key: Hashable) -> None:
        """A new step whose last micro-step has shape ``key`` (`shape_key`): nothing dispatched,
        nothing counted; early dispatch only where that shape's counts are learned."""
        self.armed = False  # (also after a step that failed inside its backward)
        self.key, self.counts, self._late, self.probes = key, {}, [], []
        self.next = [0] * len(self.domains)
        self.early = 0
        golden = self.learned.get(key)
        self._left, self._off = [], []
        for buckets in self.domains:
            left, off = [], []
            for bucket in buckets:
                ids = [id(p) for p in bucket.params]
                known = golden is not None and all(golden.get(i, 0) > 0 for i in ids)
                left.append(sum(golden[i] for i in ids) if known else 0)
                off.append(not known)
            self._left.append(left)
            self._off.append(off)

    def arm(self) -> None:
        """Count accumulations (and dispatch ready buckets) from now: the last backward runs."""
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def _accumulated(self, pid: int, *unused: Any) -> None:
        """After a parameter's gradient accumulated (its engine hooks ran): count it; dispatch
        the buckets that are now final, in order."""
        if not self.armed:
            return
        count = self.counts[pid] = self.counts.get(pid, 0) + 1
        d, b = self._where[pid]
        if b < self.next[d]:  # its reduction started: rule 3
            self._late.append(pid)
            return
        if self._off[d][b]:
            return
        golden = self.learned[self.key]
        if count > golden.get(pid, 0):
            self._off[d][b] = True  # more than learned: wait for the end of the backward
            return
        self._left[d][b] -= 1
        while self.next[d] < len(self.domains[d]) and not self._off[d][self.next[d]] \
                and self._left[d][self.next[d]] == 0:
            self._dispatch(d)
            self.early += 1

    def _dispatch(self, d: int) -> None:
        bucket = self.domains[d][self.next[d]]
        self.next[d] += 1
        with torch.no_grad():
            bad = torch.zeros((), dtype=torch.float32, device=bucket.grads[0].device) \
                if bucket.grads else torch.zeros(())
            for g in bucket.grads:
                bad = bad + torch.where(torch.isfinite(g).all(), 0.0, float("nan"))
            self.probes.append(bad)
        bucket.start()

    def dispatch_rest(self) -> None:
        """After the rank's last backward: start every bucket not yet started, in order (every
        rank, every step); learn the counts of this step's shape if new; raise `OverlapError`
        where a gradient accumulated after its bucket's reduction had started."""
        self.armed = False
        for d in range(len(self.domains)):
            while self.next[d] < len(self.domains[d]):
                self._dispatch(d)
        if self._late:
            names = sorted({self.names.get(pid, f"parameter {pid}") for pid in self._late})
            raise OverlapError(
                f"the gradient of {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} "
                "accumulated after its bucket's reduction had started (a micro-step of shape "
                f"{self.key} ran its backward other than the first one of that shape did): "
                "stopped before the update; run without the overlapped gradient reduction "
                "(--overlap-grad-reduce) and report this")
        if self.key is not None and self.key not in self.learned and self.counts:
            self.learned[self.key] = dict(self.counts)

    def remove(self) -> None:
        """Take the hooks off (the engine's buckets are gone or overlap is off)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._nodes = [], []
