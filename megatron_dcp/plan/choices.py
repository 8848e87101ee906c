"""Degree choices of single sequences (`SeqChoice`), tasks being packed (`Pack`, `next_fit`) and
the constants every DCP pass shares (a leaf of the planner: the free passes of
`megatron_dcp.plan.dcp` and the lockstep passes of `megatron_dcp.plan.lockstep` both start from
`degree_choice` and pack with `next_fit`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator, NamedTuple, Optional, Sequence, TypeVar

from megatron_dcp.plan.cost import Layout
from megatron_dcp.plan.drafts import PlanContext
from megatron_dcp.plan.hardware import layout_kind

OVERHEAD_TASKS = 2
"""Packed tasks are allowed to grow to this many times the fixed per-task cost."""
MAX_WORK_GROWTH = 1.3
"""A task is not widened past the degree where its work (ranks x time) grows by more than this."""
MIN_WORK_SAVING = 0.02
"""A sequence is widened for less recompute only when that cuts its work (ranks x time) by at
least this share: below it the wider group's fragmentation costs more than it saves."""
LARGE_INPUT, LARGE_INPUT_PASSES = 10_000, 4
HUGE_INPUT, HUGE_INPUT_PASSES = 2_000_000, 2
"""Sequences x ranks above which only the first passes run: the planner runs ahead of every
step and must stay within its latency budget (<= 1 s at 16,000 sequences on 1,024 ranks,
docs/BENCHMARKS.md), and every pass re-plans the whole batch."""

P = TypeVar("P")


def passes_for(pctx: PlanContext, passes: Sequence[P]) -> list[P]:
    """The passes (each with a degree ``floor``, in ranks) this input gets: those whose floor is
    a vocabulary size, fewer for large inputs (`LARGE_INPUT`, `HUGE_INPUT`)."""
    kept = [p for p in passes if p.floor in pctx.vocab.sizes]
    size = len(pctx.active) * pctx.world
    if size > HUGE_INPUT:
        return kept[:HUGE_INPUT_PASSES]
    return kept[:LARGE_INPUT_PASSES] if size > LARGE_INPUT else kept


def floor_of(pctx: PlanContext, floor: "int | str") -> int:
    """A pass's degree floor in ranks (``"node"``: one node's ranks)."""
    return pctx.vocab.ranks_per_node if floor == "node" else floor


@dataclass(slots=True)
class SeqChoice:
    """One sequence and the degree, recomputed layers and time chosen for it."""

    i: int
    length: int
    pairs: float
    degree: int = 0
    recompute_layers: int = 0
    duration: float = 0.0
    fitting_options: list[tuple[int, int]] = field(default_factory=list)
    """(degree, recompute_layers) of every vocabulary size from ``degree`` on where it fits."""


@dataclass(eq=False, slots=True)
class Pack:
    """A task being packed: sequences that run together on ``degree`` ranks with
    ``recompute_layers`` for ``duration`` seconds. A free pass's task before it is placed, a
    lockstep pass's item (what joins a slot as one unit) and a slot's task while the slot fills
    (from ``start_rank``) are each a pack; a pack grows by another (`timed_with`, `add`)."""

    seqs: list[int]
    tokens: int
    """Tokens of ``seqs`` before padding."""
    pairs: float
    degree: int
    recompute_layers: int
    duration: float = 0.0
    layout: Optional[Layout] = None
    """The layout of ``duration`` (`TimeModel.best_time`), where known."""
    padded_tokens: int = 0
    """Tokens of ``seqs`` after padding at ``degree`` (what memory counts)."""
    fitting_options: Optional[list[tuple[int, int]]] = None
    """(degree, fewest recomputed layers) of every vocabulary size from ``degree`` on where the
    pack fits, smallest first; ``None``: not known (`options` finds them as asked)."""
    start_rank: int = 0
    """First rank of a slot's task."""
    _padded: Optional[dict[int, int]] = None

    def padded(self, pctx: PlanContext, degree: int) -> int:
        """Tokens after padding on ``degree`` ranks (of several sequences: kept per degree)."""
        if degree == self.degree:
            return self.padded_tokens
        if len(self.seqs) == 1:
            return pctx.padded(self.tokens, degree)
        if self._padded is None:
            self._padded = {}
        found = self._padded.get(degree)
        if found is None:
            found = self._padded[degree] = pctx.padded_tokens(self.seqs, degree)
        return found

    def options(self, pctx: PlanContext, mode: str) -> Iterator[tuple[int, int]]:
        """`fitting_options`, or where they are not known, the same found as asked (a caller
        mostly takes the first)."""
        if self.fitting_options is not None:
            yield from self.fitting_options
            return
        for d in pctx.vocab.sizes:
            if d >= self.degree:
                c = pctx.recompute_for(self.padded(pctx, d), d, mode)
                if c is not None:
                    yield d, c

    def timed_with(self, pctx: PlanContext, other: "Pack", mode: str, seconds: float,
                   tokens: float = math.inf, fits: Optional[Callable] = None
                   ) -> Optional[tuple[float, Layout]]:
        """`TimeModel.best_time` of the pack with ``other`` packed in, at its degree and
        recomputed layers; ``None`` where that passes ``tokens`` padded tokens or, packed with
        any sequence, ``pack_tokens``, does not fit memory at its recomputed layers under
        ``mode`` (``fits(pctx, padded_tokens, degree, mode)`` where given: a slot's), or takes
        more than ``seconds``."""
        d, layers = self.degree, self.recompute_layers
        padded = self.padded_tokens + other.padded(pctx, d)
        if padded > tokens or self.seqs and pctx.pack_tokens and padded > pctx.pack_tokens:
            return None
        if fits is not None:
            if not fits(pctx, padded, d, mode):
                return None
        else:
            c = pctx.recompute_for(padded, d, mode)
            if c is None or c > layers:
                return None
        timed = pctx.cm.time_model.best_time(self.tokens + other.tokens, self.pairs + other.pairs,
                                             d, layers)
        return timed if timed[0] <= seconds else None

    def add(self, pctx: PlanContext, other: "Pack", timed: tuple[float, Layout]) -> None:
        """Pack ``other`` in, ``timed``: the pack's `timed_with` it."""
        self.padded_tokens += other.padded(pctx, self.degree)
        self.seqs += other.seqs
        self.tokens += other.tokens
        self.pairs += other.pairs
        self.duration, self.layout = timed


def next_fit(pctx: PlanContext, packs: list[Pack], mode: str, limit: float, tail: float = 0.0,
             grain_tokens: float = 0.0) -> list[Pack]:
    """``packs`` (longest first) of at most ``limit`` seconds packed per degree (next-fit) into
    packs of up to ``limit`` seconds that fit memory at the recomputed layers of their first and
    ``pack_tokens``; longer ones, and packs that get no other, stay as they are (``packs`` are
    not changed). ``tail`` > 0 (a lockstep pass's items: a slot has one number of recomputed
    layers): per degree and recomputed layers, each pack of at most ``grain_tokens`` x the tokens
    a task of its degree holds at those layers, and within 1 / (``tail`` x the packs of its
    degree side by side in a slot) of the time and tokens of the ones after it (the last ones
    stay fine enough to fill what the others leave)."""
    out: list[Pack] = []
    kinds: dict[object, list[Pack]] = {}
    for p in packs:
        if p.duration > limit:
            out.append(p)
        else:  # each kind's packs stay longest first
            kinds.setdefault((p.degree, p.recompute_layers) if tail else p.degree, []).append(p)
    for same in kinds.values():
        seconds, tokens = _pack_bounds(pctx, same, limit, tail, grain_tokens)
        cur = same[0]
        for k in range(1, len(same)):
            timed = cur.timed_with(pctx, same[k], mode, seconds[k], tokens[k])
            if timed is None:
                out.append(cur)
                cur = same[k]
                continue
            if cur is same[k - 1]:  # the first it gets: a new pack (``packs`` stay as they are)
                cur = Pack(list(cur.seqs), cur.tokens, cur.pairs, cur.degree,
                           cur.recompute_layers, padded_tokens=cur.padded_tokens)
            cur.add(pctx, same[k], timed)
        out.append(cur)
    return out


def _pack_bounds(pctx: PlanContext, same: list[Pack], limit: float, tail: float,
                 grain_tokens: float) -> tuple[list[float], list[float]]:
    """`next_fit`'s most seconds and padded tokens of a pack that takes ``same[k]``, by ``k``."""
    if not tail:
        return [limit] * len(same), [math.inf] * len(same)
    d, c, overhead = same[0].degree, same[0].recompute_layers, pctx.cm.time_model.task_overhead
    fine = tail * pctx.world / d
    most = grain_tokens * d * pctx.cm.memory_model.max_local_tokens(c)
    # time (less the fixed per-task cost) and tokens the packs after each one add
    time_after, tokens_after = [0.0] * (len(same) + 1), [0] * (len(same) + 1)
    for k in range(len(same) - 1, -1, -1):
        time_after[k] = time_after[k + 1] + max(same[k].duration - overhead, 0.0)
        tokens_after[k] = tokens_after[k + 1] + same[k].padded(pctx, d)
    return ([min(limit, t / fine) for t in time_after[1:]],
            [min(most, t / fine) for t in tokens_after[1:]])


def fill_options(pctx: PlanContext, info: SeqChoice, mode: str, start_at: int = 0) -> None:
    """Fill ``info.fitting_options`` with (degree, recompute_layers) for every vocabulary size
    from ``start_at`` on."""
    info.fitting_options += [f for f in pctx.fitting_options(info.length, mode)
                             if f[0] >= start_at]


def raised(pctx: PlanContext, info: SeqChoice, mode: str, floor: int) -> SeqChoice:
    """A copy of ``info`` at degree ``floor`` or more (fewer degrees mean less fragmentation)."""
    if info.degree >= floor:
        return info
    if floor in pctx.vocab.sizes:  # most sequences fit there: the first fitting size from it
        c = pctx.recompute_for(pctx.padded(info.length, floor), floor, mode)
        if c is not None:
            return SeqChoice(info.i, info.length, info.pairs, floor, c,
                             pctx.seq_time(info.length, info.pairs, floor, c))
    for d, c in pctx.fitting_options(info.length, mode):
        if d >= floor:
            return SeqChoice(info.i, info.length, info.pairs, d, c,
                             pctx.seq_time(info.length, info.pairs, d, c))
    return info


def slot_choice(pctx: PlanContext, info: SeqChoice, mode: str, target: float, base: int
                ) -> SeqChoice:
    """The choice for lockstep slots of ``target`` seconds of a wide or deep sequence at its
    pass's choice ``info`` (a degree above 1, or more recompute than ``base``): the smallest
    degree at which it finishes within ``target`` without recompute beyond ``base`` (a deeper
    slot makes every task in it recompute), else the smallest at which it finishes within
    ``target``, else the fastest before work grows by `MAX_WORK_GROWTH`; with the options from
    that degree on (where known)."""
    if not info.fitting_options:
        if info.recompute_layers <= base and info.duration <= target:
            return SeqChoice(info.i, info.length, info.pairs, info.degree, info.recompute_layers,
                             info.duration)
        fill_options(pctx, info, mode, info.degree)
    options = info.fitting_options
    for d, c in options:
        if c <= base:
            t = pctx.seq_time(info.length, info.pairs, d, c)
            if t <= target:
                return SeqChoice(info.i, info.length, info.pairs, d, c, t, _from(options, d))
            break
    best, work = info, None
    for d, c in options:
        t = pctx.seq_time(info.length, info.pairs, d, c)
        if work is None:
            work = d * t
        elif d * t > MAX_WORK_GROWTH * work:
            break
        if t <= target or best is info or t < best.duration:
            best = SeqChoice(info.i, info.length, info.pairs, d, c, t)
        if t <= target:
            break
    return SeqChoice(info.i, info.length, info.pairs, best.degree, best.recompute_layers,
                     best.duration, _from(options, best.degree))


def _from(options: Sequence[tuple[int, int]], degree: int) -> list[tuple[int, int]]:
    """The ``options`` (smallest degree first) from ``degree`` on."""
    return [f for f in options if f[0] >= degree]


def _layout_kinds(pctx: PlanContext) -> dict[int, set[str]]:
    """Layout kinds (`layout_kind`) per vocabulary size, and under key 0 those of all sizes."""
    out = {d: {layout_kind(lay.ulysses, lay.ring) for lay in pctx.cm.layouts(d)}
           for d in pctx.vocab.sizes}
    out[0] = set().union(*out.values())
    return out


@dataclass(frozen=True, slots=True)
class WorkFloor:
    """Lower bounds of a sequence's work (ranks x seconds) at an option (degree, recomputed
    layers), whatever layout of the degree it runs. A task's time is at least its fixed costs
    (latencies, per-task cost) plus the larger of its weight streaming and its marginal time
    (`TimeModel.marginal_time`: GEMMs at the smallest pack factor, attention, element-wise
    work, all-to-all and TP volume; linear in tokens and pairs). The marginal work's GEMM part
    is the same at every degree: the bound stays close to the work of wider options."""

    fixed: float
    """Ranks x the fixed costs of a task."""
    weights: float
    """Ranks x the weight streaming of a task."""
    per_token: float
    """Marginal work per token."""
    per_pair: float
    """Marginal work per attention pair."""

    def of(self, tokens: int, pairs: float) -> float:
        """The bound for a sequence of ``tokens`` and ``pairs`` (the factor absorbs rounding)."""
        return (self.fixed + max(self.weights, tokens * self.per_token + pairs * self.per_pair)
                ) * (1.0 - 1e-9)

    def least(self, other: "WorkFloor") -> "WorkFloor":
        """A bound of both options: each part the smaller."""
        return WorkFloor(min(self.fixed, other.fixed), min(self.weights, other.weights),
                         min(self.per_token, other.per_token), min(self.per_pair, other.per_pair))


def work_floor(pctx: PlanContext, degree: int, recompute_layers: int) -> WorkFloor:
    """The `WorkFloor` of an option: each part the least over the degree's layouts."""
    tm, layouts = pctx.cm.time_model, pctx.cm.layouts(degree)
    fixed, weights, per_token, per_pair = [], [], [], []
    for lay in layouts:
        empty = tm.terms(0, 0.0, lay, recompute_layers)
        weights.append(empty.weights)
        fixed.append(tm.total(empty) - empty.weights)  # no tokens: the weights, then the rest
        per_token.append(tm.marginal_time(1, 0.0, lay, recompute_layers))
        per_pair.append(tm.marginal_time(0, 1.0, lay, recompute_layers))
    return WorkFloor(degree * min(fixed), degree * min(weights), degree * min(per_token),
                     degree * min(per_pair))


def least_work(floors: Sequence[WorkFloor]) -> list[WorkFloor]:
    """Per option ``k`` of an option list, a `WorkFloor` of every option from the ``k``-th on
    (``floors``: the options' own)."""
    least = list(floors)
    for k in range(len(least) - 2, -1, -1):
        least[k] = least[k].least(least[k + 1])
    return least


def least_makespan(pctx: PlanContext, infos: list[SeqChoice], recompute_layers: int) -> float:
    """A lower bound of the makespan of any plan of ``infos`` whose tasks all recompute
    ``recompute_layers``: the sequences' marginal work (`WorkFloor`, at the degree where it is
    least) over the ranks (a task's ranks x time is at least its sequences' marginal work, and no
    rank works past the makespan)."""
    floors = [work_floor(pctx, d, recompute_layers) for d in pctx.vocab.sizes]
    tokens, pairs = sum(x.length for x in infos), sum(x.pairs for x in infos)
    return (tokens * min(f.per_token for f in floors) + pairs * min(f.per_pair for f in floors)
            ) * (1.0 - 1e-9) / pctx.world


class TimedOption(NamedTuple):
    """An option (degree, recomputed layers) of one sequence with its time."""

    degree: int
    recompute_layers: int
    duration: float


def _least_work_option(pctx: PlanContext, n: int, pairs: float, options, least: list[WorkFloor],
                       kinds) -> TimedOption:
    """The option with the least work, among those cutting the first option's work by at least
    MIN_WORK_SAVING (else the first)."""
    seq_time = pctx.seq_time
    d0, c0 = options[0]
    t0 = seq_time(n, pairs, d0, c0)
    work = d0 * t0
    found = TimedOption(d0, c0, t0)
    seen: set[str] = set()
    for k in range(1, len(options)):
        if least[k].of(n, pairs) >= work * (1.0 - MIN_WORK_SAVING):
            break  # no option from here on can cut the work enough
        d, c = options[k]
        t = seq_time(n, pairs, d, c)
        if d * t < work * (1.0 - MIN_WORK_SAVING):
            found, work = TimedOption(d, c, t), d * t
        if c == 0:
            # no recompute left to save: wider groups of a layout kind already seen
            # only add communication, but a kind not yet seen may need less work
            # (Ulysses needs a degree dividing the heads: 3 and 6 run ring or hybrid)
            seen.update(kinds[d])
            if seen >= kinds[0]:
                break
    return found


def degree_choice(pctx: PlanContext, infos: list[SeqChoice], mode: str, floor: int = 0
                  ) -> tuple[float, float]:
    """Minimal degrees and times, of the vocabulary sizes from ``floor`` on (a size); returns
    (total work / ranks, longest fastest time)."""
    total = 0.0
    overhead = pctx.cm.time_model.task_overhead
    seq_time, padded, recompute_for = pctx.seq_time, pctx.padded, pctx.recompute_for
    smallest = max(pctx.vocab.sizes[0], floor)
    chosen: dict[tuple[int, float], TimedOption] = {}
    kinds = _layout_kinds(pctx)
    floors: dict[tuple[int, int], WorkFloor] = {}
    bounds: dict[tuple[tuple[int, int], ...], list[WorkFloor]] = {}
    for info in infos:
        n, pairs = info.length, info.pairs
        if recompute_for(padded(n, smallest), smallest, mode) == 0:
            info.degree, info.recompute_layers = smallest, 0  # most sequences: no options needed
        else:
            options = pctx.fitting_options(n, mode)
            if floor:
                options = tuple(f for f in options if f[0] >= floor) or options
            if options:
                info.degree, info.recompute_layers = options[0]
        if info.recompute_layers:
            # recompute costs work: more ranks (less recompute) may do the sequence with less
            # work (the same for every sequence of this length: cached)
            info.fitting_options = list(options)
            found = chosen.get((n, pairs))
            if found is None:
                least = bounds.get(options)
                if least is None:
                    least = bounds[options] = least_work(
                        [floors.get(f) or floors.setdefault(f, work_floor(pctx, *f))
                         for f in options])
                found = chosen[(n, pairs)] = _least_work_option(pctx, n, pairs, options, least,
                                                                kinds)
            info.degree, info.recompute_layers = found.degree, found.recompute_layers
            info.duration = found.duration
        else:
            info.duration = seq_time(n, pairs, info.degree, info.recompute_layers)
        total += info.degree * max(info.duration - overhead, 0.0)
    per_rank = total / pctx.world
    longest = 0.0
    for info in sorted(infos, key=lambda x: -x.duration):
        if info.duration <= max(per_rank, longest):
            break  # its fastest time is at most its current time: cannot raise the bound
        if not info.fitting_options:
            fill_options(pctx, info, mode, info.degree)
        fastest = info.duration
        for d, c in info.fitting_options:
            fastest = min(fastest, seq_time(info.length, info.pairs, d, c))
        longest = max(longest, fastest)
    return per_rank, longest


def full_lift(pctx: PlanContext, infos: list[SeqChoice], floor: int
              ) -> Callable[[SeqChoice], SeqChoice]:
    """A sequence's `degree_choice` under recompute ``full`` from the size ``floor`` on, as a
    function of the sequence (`_of_length`: one choice per length, the same for each sequence
    of a length)."""
    full: dict[tuple[int, float], SeqChoice] = {}
    for x in infos:
        full.setdefault((x.length, x.pairs), SeqChoice(x.i, x.length, x.pairs))
    degree_choice(pctx, list(full.values()), "full", floor)
    return partial(_of_length, full)


def _of_length(choices: dict[tuple[int, float], SeqChoice], info: SeqChoice) -> SeqChoice:
    """The choice among ``choices`` (by length and pairs) for ``info``'s length and pairs."""
    return choices[(info.length, info.pairs)]
