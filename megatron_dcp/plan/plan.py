"""`Task` and `Plan`: what every planner produces and every runtime executes.

A plan assigns every sequence of one global batch to exactly one task. A task is a set of
sequences (packed, varlen) run together by a group of ranks with one attention layout
(``ulysses`` x ``ring`` = group size) and one number of recomputed layers. Every rank runs its
tasks in ``(start, id)`` order, so two tasks that share ranks are ordered the same on all of them.

A *lockstep* plan also gives every task a ``slot``: every rank of the world runs every slot of the
plan, its own task of the slot or, where it has none, an empty micro-step (zero loss weight) with
the slot's ``recompute_layers``, so all ranks issue the same sequence of engine collectives
(ZeRO-3's per-module all-gathers, ZeRO-2's per-micro-step reduce-scatters). All tasks of a slot
recompute the same number of layers. A plan without slots is *free*: ranks run different numbers
of tasks.

Group layout convention (shared by planner, cost model and runtime): group-local rank ``g`` of a
task is ``ranks[g]``; its ring index is ``g // ulysses`` and its Ulysses index ``g % ulysses``.
Ulysses sub-groups are therefore contiguous slices of ``ranks`` (intra-node when ranks are),
ring sub-groups are strided (``ranks[i::ulysses]``).

The JSON format (``Plan.to_json`` / ``Plan.from_json``) is documented in docs/PLAN_FORMAT.md.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from megatron_dcp.config import MAX_WORLD_SIZE  # noqa: F401 - the plan format's cap, here too

PLAN_FORMAT_VERSION = 1

EMPTY_STEP_TOKENS = 2
"""Tokens of an empty micro-step (a rank with no task in a lockstep slot, or padding a pipeline
schedule): the runtime runs that many dummy tokens, the cost model times that many."""


class PlanError(ValueError):
    """A plan cannot be made or is invalid: the message names the sequence, task or rank."""


def pad_multiple(ulysses: int, ring: int) -> int:
    """Every sequence of a task with this layout is padded to a multiple of this many tokens:
    ``2 * ring * ulysses`` when ``ring > 1`` (zigzag: ``2 * ring`` equal chunks, each split over
    the Ulysses ranks), ``ulysses`` otherwise (the factor 2 would only add padding)."""
    return 2 * ring * ulysses if ring > 1 else ulysses


def padded_length(n: int, ulysses: int, ring: int) -> int:
    """Length of a sequence of ``n`` tokens after padding for a ``ulysses x ring`` group."""
    m = pad_multiple(ulysses, ring)
    return -(-n // m) * m


@dataclass(frozen=True)
class Task:
    """One unit of work: sequences ``seqs`` run by ``ranks`` with one layout and
    ``recompute_layers``."""

    id: int
    ranks: tuple[int, ...]
    """Ranks of the group, in group order (position = group-local rank)."""
    seqs: tuple[int, ...]
    """Indices into the global batch (``Plan.lengths``), in packing order."""
    ulysses: int = 1
    """Ulysses (all-to-all, head-sharded) degree."""
    ring: int = 1
    """Ring (P2P, zigzag) degree; ``ulysses * ring == len(ranks)``."""
    recompute_layers: int = 0
    """Number of transformer layers whose activations are recomputed in backward."""
    start: float = 0.0
    """Predicted start time within the step, seconds (orders the tasks)."""
    duration: float = 0.0
    """Predicted run time, seconds."""
    memory: float = 0.0
    """Predicted peak memory per rank while the task runs, bytes (static memory included)."""
    slot: Optional[int] = None
    """Lockstep slot (0-based) of the task; ``None`` in a free plan."""
    mlp_tiles: int = 1
    """Chunks of its local tokens the MLP of every layer runs over, each recomputed in backward
    (`megatron_dcp.runtime.tiling`); 1: untiled."""
    loss_tiles: int = 1
    """Chunks of its local tokens the output projection and loss run over, the logits of each
    recomputed in backward, so no ``[tokens, vocab]`` logits exist; 1: untiled."""
    offload_layers: int = 0
    """Of the recomputed layers, how many first ones keep their saved inputs in host memory
    between forward and backward (`megatron_dcp.runtime.offload`); ``<= recompute_layers``."""

    @property
    def degree(self) -> int:
        """Ranks of the group."""
        return len(self.ranks)

    @property
    def end(self) -> float:
        """Predicted end, seconds."""
        return self.start + self.duration

    def ulysses_group(self, g: int) -> tuple[int, ...]:
        """Ranks of the Ulysses sub-group containing group-local rank ``g``."""
        j = g // self.ulysses
        return self.ranks[j * self.ulysses : (j + 1) * self.ulysses]

    def ring_group(self, g: int) -> tuple[int, ...]:
        """Ranks of the ring sub-group containing group-local rank ``g``."""
        return self.ranks[g % self.ulysses :: self.ulysses]

    def to_dict(self) -> dict[str, Any]:
        """The task's JSON object."""
        d = asdict(self)
        d["ranks"] = list(self.ranks)
        d["seqs"] = list(self.seqs)
        if self.slot is None:
            del d["slot"]  # free plans keep the JSON of format version 1 as it was
        for key, default in _LONG_DEFAULTS.items():
            if d[key] == default:
                del d[key]  # a task without long-sequence choices keeps its JSON as it was
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "task") -> "Task":
        """A task from its JSON object; every field's type and range is checked (nothing is
        coerced), errors name ``where`` and the field."""
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be an object, got {type(d).__name__}")
        for key in ("id", "ranks", "seqs"):
            if key not in d:
                raise ValueError(f"{where} lacks the key {key!r}")
        ranks = _integers(d["ranks"], f"{where}.ranks", 0)
        ulysses = _integer(d.get("ulysses", 1), f"{where}.ulysses", 1)
        ring = _integer(d.get("ring", max(len(ranks) // ulysses, 1)), f"{where}.ring", 1)
        if ulysses * ring != len(ranks):
            raise ValueError(f"{where}: ulysses {ulysses} x ring {ring} != {len(ranks)} ranks")
        unknown = sorted(set(d) - TASK_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(sorted(TASK_KEYS))}")
        slot = d.get("slot")
        return cls(
            id=_integer(d["id"], f"{where}.id"),
            ranks=tuple(ranks),
            seqs=tuple(_integers(d["seqs"], f"{where}.seqs", 0)),
            ulysses=ulysses,
            ring=ring,
            recompute_layers=_integer(d.get("recompute_layers", 0), f"{where}.recompute_layers",
                                      0),
            start=_number(d.get("start", 0.0), f"{where}.start"),
            duration=_number(d.get("duration", 0.0), f"{where}.duration"),
            memory=_number(d.get("memory", 0.0), f"{where}.memory"),
            slot=_integer(slot, f"{where}.slot", 0) if slot is not None else None,
            **_long_choices(d, where),
        )



_LONG_DEFAULTS = {"mlp_tiles": 1, "loss_tiles": 1, "offload_layers": 0}
"""The long-sequence choices of a task and their defaults (left out of its JSON when default)."""


def _has_long_choices(task: Task) -> bool:
    """Whether ``task`` tiles or offloads (a plan without any keeps the digest it always had)."""
    return any(getattr(task, k) != v for k, v in _LONG_DEFAULTS.items())


def _long_choices(d: dict[str, Any], where: str) -> dict[str, int]:
    """A task JSON object's ``mlp_tiles``, ``loss_tiles``, ``offload_layers``, checked."""
    out = {"mlp_tiles": _integer(d.get("mlp_tiles", 1), f"{where}.mlp_tiles", 1),
           "loss_tiles": _integer(d.get("loss_tiles", 1), f"{where}.loss_tiles", 1),
           "offload_layers": _integer(d.get("offload_layers", 0), f"{where}.offload_layers", 0)}
    layers = d.get("recompute_layers", 0)
    if out["offload_layers"] > layers:
        raise ValueError(f"{where}: offload_layers {out['offload_layers']} > recompute_layers "
                         f"{layers} (only recomputed layers' inputs are offloaded)")
    return out


TASK_KEYS = frozenset(f.name for f in fields(Task))
"""The keys of a task's JSON object; others are an error (a misspelt key would be dropped)."""

def check_frame_tokens(lengths: "tuple[int, ...] | list[int]",
                       frame_tokens: "tuple[int, ...] | list[int]") -> None:
    """`ValueError` unless ``frame_tokens`` gives every sequence of ``lengths`` a positive frame
    size that divides its length (a video is a whole number of frames); names the sequence."""
    if len(frame_tokens) != len(lengths):
        raise ValueError(f"frame_tokens has {len(frame_tokens)} entries for {len(lengths)} "
                         "sequences (one per sequence)")
    for i, (n, s) in enumerate(zip(lengths, frame_tokens)):
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"frame_tokens[{i}]={s!r}: must be a positive integer")
        if n % s:
            raise ValueError(f"sequence {i}: {n} tokens are not a whole number of frames of "
                             f"frame_tokens[{i}]={s}")




def _integer(value: Any, what: str, minimum: Optional[int] = None) -> int:
    """``value`` if it is an int (not a bool, float or string) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what}={value!r}: must be an integer")
    if minimum is not None and value < minimum:
        raise ValueError(f"{what}={value}: must be >= {minimum}")
    return value


def _integers(value: Any, what: str, minimum: Optional[int] = None) -> list[int]:
    """A JSON list of integers (a string such as ``"01"`` is not one)."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{what}={value!r}: must be a list of integers")
    return [_integer(v, f"{what}[{i}]", minimum) for i, v in enumerate(value)]


def _number(value: Any, what: str) -> float:
    """``value`` as a float if it is a finite int or float (not a bool or string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value):
        raise ValueError(f"{what}={value!r}: must be a finite number")
    return float(value)


@dataclass
class Plan:
    """All tasks of one iteration (one global batch)."""

    tasks: tuple[Task, ...]
    lengths: tuple[int, ...]
    """Token count of every sequence of the global batch (after any truncation)."""
    world_size: int
    policy: str = "dcp"
    skipped: tuple[int, ...] = ()
    """Sequences left out by the oversize policy ``skip``."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form, not part of the digest (planner timings, notes)."""
    frame_tokens: Optional[tuple[int, ...]] = None
    """Videos of mixed resolution: tokens per frame (latent height x width) of every sequence,
    by index (``lengths[i]`` is a whole number of frames of ``frame_tokens[i]`` tokens); the cost
    model counts each sequence's spatial and temporal attention with it. ``None``: every
    sequence has the model's ``frame_tokens`` (or is text)."""

    def __post_init__(self) -> None:
        self.tasks = tuple(sorted(self.tasks, key=lambda t: (t.start, t.id)))
        self.lengths = tuple(int(n) for n in self.lengths)
        self.skipped = tuple(self.skipped)
        if self.frame_tokens is not None:
            self.frame_tokens = tuple(int(s) for s in self.frame_tokens)
            check_frame_tokens(self.lengths, self.frame_tokens)

    @property
    def target_tokens(self) -> int:
        """T of the per-token loss: next-token targets of the sequences the plan runs.

        A sequence of n tokens has n - 1 targets (its last token has none).
        """
        return sum(self.lengths[s] - 1 for t in self.tasks for s in t.seqs)

    @property
    def truncated(self) -> dict[int, int]:
        """Sequences the oversize policy ``truncate`` shortened, each with its length before
        (``lengths`` holds the planned one): the runtime cuts the batch to the plan
        (`megatron_dcp.runtime.truncate`). Kept in ``meta["truncated"]`` as ``[[i, n], ...]``,
        so the digest and the plan format of every other plan are unchanged."""
        pairs = self.meta.get("truncated") or ()
        try:
            return {int(i): int(n) for i, n in pairs}
        except (TypeError, ValueError):
            raise PlanError(f"plan meta truncated={pairs!r}: must be [[sequence, length], ...]") \
                from None

    @property
    def truncated_tokens(self) -> int:
        """Tokens the oversize policy ``truncate`` cut from the batch (not trained)."""
        return sum(max(0, n - self.lengths[i]) for i, n in self.truncated.items()
                   if 0 <= i < len(self.lengths))

    def tasks_for_rank(self, rank: int) -> list[Task]:
        """This rank's tasks in execution order ``(start, id)``."""
        return [t for t in self.tasks if rank in t.ranks]

    def micro_steps_per_rank(self) -> list[int]:
        """How many tasks (micro-steps) each rank of the world runs."""
        counts = [0] * self.world_size
        for task in self.tasks:
            for r in task.ranks:
                counts[r] += 1
        return counts

    @property
    def makespan(self) -> float:
        """Predicted end of the last task, seconds."""
        return max((t.end for t in self.tasks), default=0.0)

    @property
    def lockstep(self) -> bool:
        """Whether the tasks carry slots (`validate_plan` checks: all of them or none)."""
        return any(t.slot is not None for t in self.tasks)

    def slot_recompute_layers(self) -> list[int]:
        """``recompute_layers`` of every slot of a lockstep plan, by slot index (``[]`` when free).
        A slot no task uses (allowed, never planned) recomputes 0."""
        slots = [t.slot for t in self.tasks if t.slot is not None]
        layers = [0] * (max(slots) + 1 if slots else 0)
        for t in self.tasks:
            if t.slot is not None:
                layers[t.slot] = t.recompute_layers
        return layers

    def slot_mlp_tiles(self) -> list[int]:
        """``mlp_tiles`` of every slot of a lockstep plan, by slot index (``[]`` when free): the
        largest of its tasks' (the planner gives them all the same, `assign_long_choices`), which
        an empty micro-step of the slot runs too."""
        slots = [t.slot for t in self.tasks if t.slot is not None]
        tiles = [1] * (max(slots) + 1 if slots else 0)
        for t in self.tasks:
            if t.slot is not None:
                tiles[t.slot] = max(tiles[t.slot], t.mlp_tiles)
        return tiles

    def digest(self) -> str:
        """Hex digest of everything that decides execution (not ``meta``); ``frame_tokens``
        counts when set (a plan without it keeps the digest it always had)."""
        content: dict[str, Any] = {
            "lengths": list(self.lengths),
            "world_size": self.world_size,
            "skipped": list(self.skipped),
            "tasks": [
                [t.id, list(t.ranks), list(t.seqs), t.ulysses, t.ring, t.recompute_layers,
                 round(t.start, 9)] + ([t.slot] if t.slot is not None else [])
                + ([{k: getattr(t, k) for k in _LONG_DEFAULTS}] if _has_long_choices(t) else [])
                for t in self.tasks
            ],
        }
        if self.frame_tokens is not None:
            content["frame_tokens"] = list(self.frame_tokens)
        payload = json.dumps(content, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """The plan's JSON object (docs/PLAN_FORMAT.md)."""
        d = {
            "format_version": PLAN_FORMAT_VERSION,
            "policy": self.policy,
            "world_size": self.world_size,
            "lengths": list(self.lengths),
            "skipped": list(self.skipped),
            "tasks": [t.to_dict() for t in self.tasks],
            "meta": self.meta,
        }
        if self.frame_tokens is not None:  # written only when set: text plans are unchanged
            d["frame_tokens"] = list(self.frame_tokens)
        return d

    def to_json(self, indent: Optional[int] = None) -> str:
        """The plan JSON (docs/PLAN_FORMAT.md)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        """A plan from its JSON object; malformed input raises `ValueError`."""
        if not isinstance(d, dict):
            raise ValueError(f"a plan JSON must be an object, got {type(d).__name__}")
        version = d.get("format_version", PLAN_FORMAT_VERSION)
        if version != PLAN_FORMAT_VERSION:
            raise ValueError(f"plan format_version {version} is not supported (expected "
                             f"{PLAN_FORMAT_VERSION})")
        for key in ("world_size", "lengths", "tasks"):
            if key not in d:
                raise ValueError(f"plan JSON lacks the key {key!r}")
        world_size = _integer(d["world_size"], "plan world_size", 1)
        if world_size > MAX_WORLD_SIZE:
            raise ValueError(f"plan world_size={world_size}: more than {MAX_WORLD_SIZE} ranks")
        if not isinstance(d["tasks"], list):
            raise ValueError(f"plan tasks: must be a list, got {type(d['tasks']).__name__}")
        meta = d.get("meta", {})
        if not isinstance(meta, dict):
            raise ValueError(f"plan meta: must be an object, got {type(meta).__name__}")
        frames = d.get("frame_tokens")
        return cls(
            tasks=tuple(Task.from_dict(t, f"plan task [{i}]") for i, t in enumerate(d["tasks"])),
            lengths=tuple(_integers(d["lengths"], "plan lengths", 1)),
            world_size=world_size,
            policy=str(d.get("policy", "external")),
            skipped=tuple(_integers(d.get("skipped", []), "plan skipped", 0)),
            meta=dict(meta),
            frame_tokens=tuple(_integers(frames, "plan frame_tokens", 1))
            if frames is not None else None,
        )

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """A plan from its JSON text; malformed input raises `ValueError` (JSON nested too deep
        for the parser among it, which Python's reader answers with `RecursionError`)."""
        try:
            data = json.loads(text)
        except RecursionError:
            raise ValueError("the JSON is nested too deeply to be a plan") from None
        return cls.from_dict(data)

