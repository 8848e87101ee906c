"""``dcp-dry-run`` / ``python -m megatron_dcp.dryrun``: every rank of a real-size DCP job, one
after another on this CPU (or in ``--jobs N`` worker processes), on the meta device under
torch's fake process group.

    dcp-dry-run --gpus 64 --gpus-per-node 8 --model llama-7b --corpus --ranks all --json dry.json
    dcp-dry-run --gpus 1024 --model llama-7b --lengths lengths.txt --ranks 0,511,1023

Each rank plans the batch as training would and runs its step through DCP's runtime
(`megatron_dcp.dryrun.runtime_rank`); its collectives are recorded and checked against every
other rank's (`megatron_dcp.dryrun.record.check_consistency`). The exit status is 0 only when
every group's members issued the same collectives, no host tensor reached a collective and every
rank's step ran. Printed: a line per rank as it finishes, with a running summary (flushed: a
log shows them), then a table per rank; ``--json``: the whole report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Optional

from megatron_dcp.config import DCPConfig, float_flag, int_flag, world_size_flag
from megatron_dcp.outputs import OVERWRITE_HELP, mark, output_problem
from megatron_dcp.plan.plan import MAX_WORLD_SIZE
from megatron_dcp.progress import Heartbeat, Progress

TOOL = "dcp-dry-run"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The flags, each checked here, before any rank runs (`check_args`): a bad value is a
    one-line ``dcp-dry-run: error: argument --FLAG: ...`` with status 2, never a report of zero
    ranks that says "consistent: True"."""
    p = argparse.ArgumentParser(prog="dcp-dry-run", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=world_size_flag, default=16,
                   help="GPUs (ranks) of the job, default 16, at most "
                        f"{MAX_WORLD_SIZE:,} (the plan format's cap): the DCP world with the "
                        "runtime engine; --tp x --pp x the DCP world with --engine megatron")
    p.add_argument("--gpus-per-node", type=int_flag(1), default=None, help="GPUs per node "
                   "(default: the hardware preset's); with --engine megatron a node holds "
                   "GPUs / --tp ranks of a DCP world")
    p.add_argument("--model", default="llama-7b", help="model preset or ModelShape JSON")
    p.add_argument("--layers", type=int_flag(1), default=2, help="layers to run (default 2: a "
                   "layer's collectives repeat; the planner plans the model given with this many)")
    p.add_argument("--hardware", default="h200", help="hardware preset or profile JSON")
    p.add_argument("--engine", default="runtime", choices=("runtime", "megatron"),
                   help="runtime: DCP's step driver with the reference decoder; megatron: a "
                        "megatron-core GPTModel in Megatron's DDP through DCPForwardBackward "
                        "(DeepSpeed: not yet, see docs/DRYRUN.md)")
    _megatron_flags(p)
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3),
                   help="optimizer sharding (runtime: 0-3; megatron: 0, or 1 = the distributed "
                        "optimizer, Megatron's only sharding)")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="optimizer states in host memory (DeepSpeed's offload_optimizer, "
                        "Megatron's --optimizer-cpu-offload)")
    p.add_argument("--long-sequences", default="auto", choices=("auto", "on", "off"),
                   help="dcp.long_sequences (default auto, as training)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", help="file: one token count per line, or a Megatron .idx")
    src.add_argument("--corpus", action="store_true",
                     help="the embedded corpus's documents (default)")
    p.add_argument("--global-batch-tokens", type=int_flag(2), default=None,
                   help="tokens of the batch (default: 8192 per rank)")
    p.add_argument("--max-len", type=int_flag(2), default=32768,
                   help="longest sequence (at least 2 tokens: a shorter one trains nothing)")
    p.add_argument("--seed", type=int, default=0, help="which documents of the corpus")
    p.add_argument("--memory-budget-gb", type=float_flag(0.0), default=None)
    p.add_argument("--max-tokens-per-rank", type=int_flag(1), default=None)
    p.add_argument("--ranks", default="all", help="all, or a comma list of ranks")
    _run_flags(p)
    p.add_argument("--no-create-groups", action="store_true",
                   help="skip the start-up creation and warming of the vocabulary's groups")
    p.add_argument("--json", default=None,
                   help="write the report here (a new file, or one dcp-dry-run wrote; never "
                        "the --lengths file)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    args = p.parse_args(argv)
    problem = check_args(args)
    if problem:
        p.error(problem)
    return args


def dcp_ranks_per_node(args: argparse.Namespace) -> Optional[int]:
    """Ranks of one DCP world on a node of ``--gpus-per-node`` GPUs (None: the preset's): all of
    them with the runtime engine; with ``--engine megatron`` Megatron's rank order puts
    tensor-parallel ranks next to each other, so a node holds GPUs / TP ranks of a DCP world
    (at most the world's size)."""
    if args.gpus_per_node is None or args.engine != "megatron":
        return args.gpus_per_node
    world = max(1, args.gpus // (args.tp * args.pp))
    return max(1, min(args.gpus_per_node // args.tp, world))


def _megatron_flags(p: argparse.ArgumentParser) -> None:
    """The layout flags of ``--engine megatron``."""
    p.add_argument("--tp", type=int_flag(1), default=1,
                   help="tensor-parallel size (--engine megatron)")
    p.add_argument("--pp", type=int_flag(1), default=1,
                   help="pipeline stages (--engine megatron)")
    p.add_argument("--vpp", type=int_flag(1), default=1,
                   help="virtual pipeline stages per pipeline rank (--engine megatron, --pp > 1: "
                        "Megatron's interleaved schedule)")
    p.add_argument("--ep", type=int_flag(1), default=None,
                   help="expert-parallel size of a MoE model (--engine megatron; default: the "
                        "model's, 1 for the presets)")
    p.add_argument("--expert-tp", type=int_flag(1), default=None,
                   help="expert tensor-parallel size (default --tp; 1: experts whole)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism (--engine megatron with --tp > 1)")


def _run_flags(p: argparse.ArgumentParser) -> None:
    """How the ranks run (``--jobs``) and which batch they run (``--worst-case``)."""
    p.add_argument("--jobs", type=int_flag(1), default=1,
                   help="worker processes running ranks side by side (default 1: one rank after "
                        "another in this process); each takes a core and 0.5-1 GB of host "
                        "memory (torch, Megatron); the report is the same as with --jobs 1")
    p.add_argument("--worst-case", action="store_true",
                   help="instead of a sampled batch, one that puts every rank's task at the "
                        "budget: each DCP rank gets sequences (of at most --max-len tokens) "
                        "filling the most tokens a rank holds with no layer recomputed under the "
                        "memory budget and --max-tokens-per-rank, x the pipeline stages with "
                        "--pp (--global-batch-tokens, when given: that many tokens in the same "
                        "pattern): the plan that "
                        "uses the most memory. A first line says on how many ranks the plan's "
                        "task holds that much (with --pp, or lockstep slots and a --max-len "
                        "below it, not every rank's: see docs/DRYRUN.md). Not with --lengths "
                        "or --corpus")


def chosen_ranks(spec: str, world_size: int) -> list[int]:
    """``--ranks``: ``all``, or a non-empty comma list of ranks of the world; ``ValueError``
    naming what is wrong."""
    if spec == "all":
        return list(range(world_size))
    try:
        ranks = sorted({int(r) for r in spec.split(",") if r.strip()})
    except ValueError:
        raise ValueError(f"argument --ranks: {spec!r}: all, or a comma list of ranks such as "
                         "0,3,15") from None
    if not ranks:
        raise ValueError(f"argument --ranks: {spec!r} names no rank: all, or a comma list of "
                         "ranks such as 0,3,15")
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"argument --ranks: {spec}: {bad[:8]} outside 0..{world_size - 1} "
                         f"(--gpus {world_size})")
    return ranks


def check_args(args: argparse.Namespace) -> str:
    """Why the flags cannot run together, in one line naming the flag, or ``""``: an empty or
    foreign rank list, a flag the chosen engine would silently drop (``--sequence-parallel`` at
    TP 1, ZeRO 2/3 under Megatron, whose distributed optimizer is ZeRO 1), an output that
    would destroy an input or a file this tool did not write, or one that cannot be written."""
    try:
        chosen_ranks(args.ranks, args.gpus)
    except ValueError as err:
        return str(err)
    if args.engine == "runtime":
        given = [f"--{name} {value}" for name, value in
                 (("tp", args.tp), ("pp", args.pp), ("vpp", args.vpp)) if value > 1]
        given += [f"--{name} {value}" for name, value in
                  (("ep", args.ep), ("expert-tp", args.expert_tp)) if value is not None]
        if args.sequence_parallel:
            given.append("--sequence-parallel")
        if given:
            return (f"{', '.join(given)}: the runtime engine's reference decoder has no tensor, "
                    "pipeline or expert parallelism: add --engine megatron")
    else:
        if args.sequence_parallel and args.tp == 1:
            return ("--sequence-parallel needs --tp > 1 (Megatron's sequence parallelism splits "
                    "the tensor-parallel group's activations; at --tp 1 there is none)")
        if args.zero_stage > 1:
            return (f"--zero-stage {args.zero_stage}: the Megatron engine shards only the "
                    "optimizer (--zero-stage 1, its distributed optimizer) or nothing (0)")
        if args.vpp > 1 and args.pp == 1:
            return "--vpp > 1 needs --pp > 1 (virtual stages of a pipeline)"
    if args.worst_case and (args.lengths or args.corpus):
        return (f"--worst-case builds its own batch (every rank's task at the budget): leave "
                f"out {'--lengths' if args.lengths else '--corpus'}")
    if args.json is not None:
        inputs = [("--lengths", args.lengths)] + [
            (f"--{name}", value) for name, value in (("model", args.model),
                                                     ("hardware", args.hardware))
            if os.path.isfile(value)]
        problem = output_problem(args.json, flag="--json", tool=TOOL, inputs=inputs,
                                 overwrite=args.overwrite)
        if problem:
            return problem
    return ""


def _experts(args: argparse.Namespace, model: Any) -> dict:
    """The ``ModelShape`` fields of ``--ep`` / ``--expert-tp``; an error for a dense model."""
    if args.ep is None and args.expert_tp is None:
        return {}
    if not model.is_moe:
        raise ValueError(f"--ep / --expert-tp: {args.model} is a dense model")
    out = {"expert_parallel": args.ep} if args.ep is not None else {}
    if args.expert_tp is not None:
        out["expert_tensor_parallel"] = args.expert_tp
    return out


def batch_lengths(args: argparse.Namespace) -> list[int]:
    """The global batch's sequence lengths."""
    import random

    from megatron_dcp.plan.workload import read_idx_lengths, read_lengths_file

    budget = args.global_batch_tokens or 8192 * args.gpus
    if args.lengths:
        pool = (read_idx_lengths(args.lengths) if args.lengths.endswith(".idx")
                else read_lengths_file(args.lengths))
    else:
        from megatron_dcp.data.datasets import embedded_corpus_texts

        pool = [len(t.encode("utf-8")) + 1 for t in embedded_corpus_texts()]
    pool = [min(int(n), args.max_len) for n in pool if n > 1]
    order = list(range(len(pool)))
    random.Random(args.seed).shuffle(order)
    out, total = [], 0
    for i in order * (1 + budget // max(1, sum(pool))):
        if total >= budget:
            break
        n = min(pool[i], budget - total)
        if n > 1:
            out.append(n)
            total += n
    return out


def run(args: argparse.Namespace, keep_calls: bool = False, beat: Optional[Heartbeat] = None,
        **controls: Any) -> dict[str, Any]:
    """The report of a dry run (see the module doc); ``controls``: `RankJob`'s negative
    controls; ``keep_calls``: the report's ``calls`` holds every rank's recorded calls;
    ``beat``: told each stage, so that minutes of work (a world of 100,000 ranks) say what
    they are doing; ``worker_exit_at``: a negative control (`workers.run_ranks`'s
    ``exit_at``)."""
    beat = beat or Heartbeat(TOOL, after=float("inf"))
    exit_at = controls.pop("worker_exit_at", None)
    from megatron_dcp.dryrun.record import check_consistency
    from megatron_dcp.dryrun.runtime_rank import RankJob, layers_run
    from megatron_dcp.plan import load_model

    config = DCPConfig(enabled=True, hardware=args.hardware, calibration="off",
                       memory_budget_gb=args.memory_budget_gb,
                       max_tokens_per_rank=args.max_tokens_per_rank,
                       ranks_per_node=dcp_ranks_per_node(args),
                       long_sequences=args.long_sequences)
    model = load_model(args.model)
    shape = dataclasses.replace(layers_run(model, args.layers),
                                tensor_parallel=args.tp, pipeline_parallel=args.pp,
                                virtual_pipeline=args.vpp,
                                sequence_parallel=args.sequence_parallel,
                                **_experts(args, model))
    lengths, worst = _batch(args, shape, config, beat)
    job = RankJob(shape=shape, lengths=lengths, world_size=args.gpus,
                  config=config, hardware=args.hardware, zero_stage=args.zero_stage,
                  offload_optimizer=args.offload_optimizer,
                  create_groups=not args.no_create_groups, **controls)
    if args.engine == "megatron":
        from megatron_dcp.dryrun.megatron_rank import refused

        if refused(job):
            raise ValueError(refused(job))
    elif args.tp > 1 or args.pp > 1 or args.vpp > 1 or shape.is_moe:
        raise ValueError("--tp/--pp > 1 and MoE models need --engine megatron (the reference "
                         "decoder has none of them)")
    results = _run_ranks(args, job, beat, exit_at)
    mismatches = check_consistency({r["rank"]: r["calls"] for r in results
                                    if r.get("ran", True)})
    report = {
        "written_by": mark(TOOL),  # first: how a later --json knows it may replace the file
        "consistent": not mismatches, "mismatches": mismatches,
        "world_size": args.gpus, "model": args.model, "layers": job.shape.num_layers,
        "engine": args.engine, "tensor_parallel": args.tp, "zero_stage": args.zero_stage,
        "worst_case": worst,
        "sequences": len(job.lengths), "tokens": sum(job.lengths),
        "ranks": [_rank_row(r) for r in results]}
    if keep_calls:
        report["calls"] = {r["rank"]: r["calls"] for r in results}
    report["ok"] = (report["consistent"] and not any(
        r["cpu_tensors"] or r["error"] or r["over_budget"] for r in report["ranks"]))
    return report


def _batch(args: argparse.Namespace, shape: Any, config: DCPConfig,
           beat: Heartbeat) -> tuple[list[int], Optional[dict]]:
    """The global batch's lengths, and with ``--worst-case`` what its plan does with them (the
    report's ``worst_case``; also printed)."""
    if not args.worst_case:
        beat.stage(f"reading the global batch ({args.global_batch_tokens or 8192 * args.gpus:,}"
                   " tokens)")
        return batch_lengths(args), None
    from megatron_dcp.dryrun.worst_case import worst_case

    beat.stage("building the worst-case batch (every rank's task at the budget)")
    world = args.gpus // (args.tp * args.pp) if args.engine == "megatron" else args.gpus
    worst = worst_case(shape, config, max(1, world), hardware=args.hardware,
                       zero_stage=args.zero_stage, offload_optimizer=args.offload_optimizer,
                       max_len=args.max_len, total=args.global_batch_tokens,
                       pooled=not args.no_create_groups)
    print(worst.line(), flush=True)
    return worst.lengths, worst.report()


def _run_ranks(args: argparse.Namespace, job: Any, beat: Heartbeat,
               exit_at: Optional[int]) -> list[dict[str, Any]]:
    """Every chosen rank's record, serially or in ``--jobs`` workers (`workers.run_ranks`), a
    line for each as it finishes (`workers.RankLines`: on stdout, flushed, so that a log shows
    them), the progress bar drawn on a terminal and the heartbeat told what runs."""
    from megatron_dcp.dryrun.workers import RankLines, run_ranks

    ranks = chosen_ranks(args.ranks, args.gpus)
    jobs = min(args.jobs, len(ranks))
    with Progress("dry run: ranks", total=len(ranks)) as bar:
        lines = RankLines(len(ranks), bar.note)
        bar.note(f"dry run: {len(ranks):,} of {args.gpus:,} ranks, {len(job.lengths):,} "
                 f"sequences ({sum(job.lengths):,} tokens), "
                 + (f"{jobs} worker processes ({os.cpu_count()} cores here)" if jobs > 1
                    else "one rank at a time")
                 + "; a line per rank as it finishes")

        def done(raw: dict[str, Any]) -> None:
            lines(_rank_row(raw))
            bar.update(label=f"rank {raw['rank']}")
            beat.stage(f"running ranks ({lines.done:,} of {len(ranks):,} done)")

        beat.stage(f"{len(ranks):,} ranks, each its plan of {len(job.lengths):,} sequences on "
                   f"{args.gpus:,} ranks and its step")
        return run_ranks(job, ranks, args.engine, jobs, done, exit_at)


def _rank_row(r: dict[str, Any]) -> dict[str, Any]:
    """A rank's row of the report, from what its dry run recorded."""
    return {"rank": r["rank"], "collectives": len(r["calls"]),
            "predicted_bytes": r["predicted_bytes"], "peak_bytes": r["peak_bytes"],
            "budget_bytes": r["budget_bytes"],
            "over_budget": bool(r["budget_bytes"] is not None
                                and r["peak_bytes"] > r["budget_bytes"]),
            "peak_by_kind": r["peak_by_kind"],
            "cpu_tensors": r["cpu_tensors"], "host_syncs": r["host_syncs"],
            "bytes_received": r["bytes_received"], "seconds": r["seconds"],
            "error": r["error"]}


def print_table(report: dict[str, Any]) -> None:
    print(f"dry run: {report['world_size']} ranks, {report['model']} ({report['layers']} "
          f"layers), {report['sequences']} sequences, {report['tokens']} tokens")
    print(f"{'rank':>5} {'calls':>6} {'peak GiB':>9} {'predicted':>9} {'host syncs':>10} "
          f"{'object KiB':>10} {'s':>6}  error")
    for r in report["ranks"]:
        pred = f"{r['predicted_bytes'] / 2**30:.2f}" if r["predicted_bytes"] else "-"
        print(f"{r['rank']:>5} {r['collectives']:>6} {r['peak_bytes'] / 2**30:>9.2f} {pred:>9} "
              f"{sum(r['host_syncs'].values()):>10} {r['bytes_received'] / 1024:>10.1f} "
              f"{r['seconds']:>6.2f}  {r['error'][:60]}")
    over = [r["rank"] for r in report["ranks"] if r["over_budget"]]
    if over:
        print(f"over the memory budget (activations + temporaries measured above what the "
              f"budget leaves them): ranks {over[:16]}")
    print(f"consistent: {report['consistent']} ({len(report['mismatches'])} mismatches); "
          f"host tensors in collectives: {sum(r['cpu_tensors'] for r in report['ranks'])}")
    for m in report["mismatches"][:3]:
        print("  first mismatch:", json.dumps(m)[:400])


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        with Heartbeat(TOOL) as beat:
            report = run(args, beat=beat)
    except ValueError as err:  # a flag the run refuses (a dense model's --ep, a bad file)
        print(f"dcp-dry-run: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the workers are stopped (workers.run_ranks)
        print("dcp-dry-run: interrupted", file=sys.stderr)
        return 130
    print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
