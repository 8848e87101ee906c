"""The plan check: one tiny collective before any task, that every rank holds the same plan, the
same DCP configuration and the same global batch, and that none found a problem in its input.

Digests (64-bit, SHA-256) of the plan, of the configuration and of the batch's tokens are
compared with one MIN all-reduce of their pieces and negatives; only on a mismatch a second
collective gathers them, with every rank's problems, to name the ranks that differ. Every rank
raises alike (`PlanMismatchError` or `BatchError`), so none is left waiting in a later
collective or trains on a wrong loss.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dcp.plan.plan import PlanError
from megatron_dcp.plan.plan import Plan
from megatron_dcp.plan.validate import validate_plan
from megatron_dcp.runtime.groups import GroupPool


class PlanMismatchError(RuntimeError):
    """Ranks of the DCP world hold different plans (or one of them found bad input)."""


class BatchError(ValueError):
    """The global batch does not fit the plan or the model (names the sequence)."""


def _digest_pieces(digest: str) -> list[int]:
    """The 64-bit hex digest as 4 non-negative 16-bit integers (exact in any dtype used)."""
    value = int(digest, 16)
    return [(value >> (16 * i)) & 0xFFFF for i in range(4)]


def local_problems(plan: Plan, sequences: Sequence[Optional[torch.Tensor]], rank: int,
                   max_position: Optional[int]) -> list[str]:
    """Problems this rank can see without talking to the others."""
    problems = []
    if not 0 <= rank < plan.world_size:
        return [f"rank {rank} is outside the plan's world of {plan.world_size} ranks"]
    if len(sequences) != len(plan.lengths):
        return [f"the batch has {len(sequences)} sequences, the plan {len(plan.lengths)}"]
    try:
        # Structure only: hand-written plans may leave start times at 0.
        validate_plan(plan, check_times=False)
    except PlanError as exc:
        return [f"invalid plan: {exc}"]
    for task in plan.tasks:
        for s in task.seqs:
            n = plan.lengths[s]
            if max_position is not None and n > max_position:
                problems.append(f"sequence {s} has {n} tokens, more than the model's "
                                f"max_position {max_position} (task {task.id}, ranks {task.ranks})")
            if rank in task.ranks:
                seq = sequences[s]
                if seq is None or seq.dim() != 1 or seq.shape[0] != n:
                    got = "None" if seq is None else f"shape {tuple(seq.shape)}"
                    problems.append(f"sequence {s} of task {task.id}: the plan says {n} tokens, "
                                    f"the batch holds {got}")
    return problems


def config_digest(config: Any) -> str:
    """64-bit hex digest of a configuration (a `DCPConfig` or a JSON-able dict); ``""`` for None."""
    if config is None:
        return ""
    data = config.to_dict() if hasattr(config, "to_dict") else config
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_NO_OPINION = (1 << 63) - 1
"""Digest slot of a rank that does not hold the whole batch: neutral under MIN."""


def _host_tokens(sequences: Sequence[torch.Tensor]) -> bytes:
    """The bytes of the batch's token ids concatenated as int64 on the host (one copy from a
    device; read without numpy, which a CUDA torch does not require)."""
    device = sequences[0].device
    tokens = torch.cat([s.reshape(-1).to(device=device, dtype=torch.int64)
                        for s in sequences]).cpu().contiguous()
    return ctypes.string_at(tokens.data_ptr(), tokens.numel() * tokens.element_size())


def batch_digest(sequences: Sequence[Optional[torch.Tensor]]) -> Optional[str]:
    """64-bit hex digest (SHA-256) of a global batch's token ids, in batch order (the lengths are
    in the plan digest); None when an entry is missing (a rank that holds only its own sequences
    has no view of the whole batch). Tokens on a device are copied to the host once: about 5 ms
    per million tokens on one CPU core."""
    if not sequences or any(s is None for s in sequences):
        return None
    h = hashlib.sha256(_host_tokens(sequences))
    for extra in getattr(sequences, "content_digests", None) or ():
        h.update(extra.encode())
    return h.hexdigest()[:16]


def sequence_digests(sequences: Sequence[Optional[torch.Tensor]]) -> Optional[list[str]]:
    """`batch_digest` of every sequence on its own (to name the first one that differs)."""
    if not sequences or any(s is None for s in sequences):
        return None
    tokens, out, start = _host_tokens(sequences), [], 0
    extras = getattr(sequences, "content_digests", None) or [""] * len(sequences)
    for s, extra in zip(sequences, extras):
        end = start + 8 * int(s.numel())  # int64 bytes
        h = hashlib.sha256(tokens[start:end])
        h.update(extra.encode())
        out.append(h.hexdigest()[:16])
        start = end
    return out


def check_plan(plan: Plan, pool: GroupPool, problems: Sequence[str] = (),
               device: Optional[torch.device] = None, *,
               sequences: Optional[Sequence[Optional[torch.Tensor]]] = None,
               config: Any = None) -> str:
    """Collective over the job (every DCP world: tensor-parallel peers must run the same plan):
    check every rank holds the same plan, the same ``config``
    (the DCP configuration: ranks that differ, say in ``loss_reduction``, would otherwise train
    on a wrong loss without an error) and the same global batch ``sequences`` (a digest of the
    tokens, and of a `SelfTargetBatch`'s content digests; a rank that lacks some sequences is
    not compared), and that none has problems.

    One all-reduce (MIN) of the digests' pieces, their negatives and the problem flag; only on
    a mismatch a second collective gathers the digests and messages to name the ranks. Raises
    on every rank alike, so no rank is left waiting: `PlanMismatchError` when plans,
    configurations or batches differ, else `BatchError` with every rank's problems (e.g. a
    sequence longer than the model's positions).
    """
    digest = plan.digest()
    settings = config_digest(config)
    # a rank whose batch does not even fit the plan reports that as a problem, not a mismatch
    compare = sequences is not None and not problems
    tokens = batch_digest(sequences) if compare else None
    pieces = _digest_pieces(digest) + _digest_pieces(settings or "0")
    pieces += _digest_pieces(tokens) if tokens else [_NO_OPINION] * 4
    negated = [v if v == _NO_OPINION else -v for v in pieces]
    flag = 1 if problems else 0
    t = torch.tensor(pieces + negated + [-flag], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=pool.job_group)
    n = len(pieces)
    merged = t.tolist()
    agree = all(low == -high or low == _NO_OPINION
                for low, high in zip(merged[:n], merged[n:2 * n]))
    if agree and not merged[2 * n]:
        return digest
    report = (digest, settings, config.to_dict() if hasattr(config, "to_dict") else config,
              sequence_digests(sequences) if compare else None, list(problems))
    gathered: list[Any] = [None] * dist.get_world_size(pool.job_group)  # named by job rank
    dist.all_gather_object(gathered, report, group=pool.job_group)
    disagreements = _disagreements(gathered)
    lines = disagreements + [f"rank {r}: {m}" for r, entry in enumerate(gathered)
                             for m in entry[4]]
    error = PlanMismatchError if disagreements else BatchError
    raise error(f"rank {dist.get_rank()}: plan check failed before running any task:\n  "
                + "\n  ".join(lines))


def _odd_ranks(values: list) -> tuple[list[int], Any]:
    """Ranks whose value differs from the majority's (on a tie, the lowest rank's), and it."""
    keys = [json.dumps(v, sort_keys=True, default=str) for v in values]
    common = min(set(keys), key=lambda k: (-keys.count(k), keys.index(k)))
    return [r for r, k in enumerate(keys) if k != common], values[keys.index(common)]


def _disagreements(gathered: list) -> list[str]:
    """One line per kind of disagreement (plan, configuration, batch), naming the ranks."""
    lines = []
    odd, common = _odd_ranks([g[0] for g in gathered])
    if odd:
        lines.append(f"plan digest differs on rank(s) {odd} (theirs: "
                     f"{', '.join(gathered[r][0] for r in odd)}; the other ranks: {common}): "
                     "every rank must build the same plan (same lengths, config, iteration, "
                     "seed)")
    settings = [g[1] for g in gathered]
    odd, common = _odd_ranks(settings)
    if odd:
        reference = gathered[settings.index(common)][2] or {}
        theirs = {r: gathered[r][2] or {} for r in odd}
        fields = sorted(k for k in set(reference).union(*theirs.values())
                        if any(t.get(k) != reference.get(k) for t in theirs.values()))
        shown = "; ".join(f"rank {r}: " + ", ".join(f"{k}={t.get(k)!r}" for k in fields)
                          for r, t in theirs.items())
        others = ", ".join(f"{k}={reference.get(k)!r}" for k in fields)
        lines.append(f"DCP configuration differs on rank(s) {odd} ({shown}; the other ranks: "
                     f"{others}): every rank must run with the same settings")
    holders = [r for r, g in enumerate(gathered) if g[3] is not None]
    if holders:
        odd_local, common_fp = _odd_ranks([gathered[r][3] for r in holders])
        odd = [holders[i] for i in odd_local]
        if odd:
            first = min(next((s for s, (a, b) in enumerate(zip(gathered[r][3], common_fp))
                              if a != b), len(common_fp)) for r in odd)
            lines.append(f"global batch content differs on rank(s) {odd} (first at sequence "
                         f"{first}): every rank must read the same global batch (same data "
                         "files, seed and sampler position)")
    return lines
