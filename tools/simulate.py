#!/usr/bin/env python
"""What-if and benchmark tool: plan one global batch with every policy and simulate each plan.

Examples::

    python tools/simulate.py --gpus 32 --gpus-per-node 8 --model llama-7b --hardware h200 \\
        --dist short --global-batch-tokens 2097152 --policy all
    python tools/simulate.py --gpus 32 --lengths batch.txt --json
    python tools/simulate.py --gpus 32 --lengths data/corpus_text_document.idx --policy dcp,bucket
    python tools/simulate.py --gpus 32 --dist long --save-plan dcp.json --plot timeline.png
    python tools/simulate.py --plan other_scheduler.json --policy dcp,bucket
    python tools/simulate.py --gpus 32 --model video-dit --video-mix balanced --policy dcp,bucket
    python tools/simulate.py --gpus 32 --model video-dit --video-shapes videos.txt
    python tools/simulate.py --gpus 8 --model llama-70b --tp 8 --pp 4 --dist long --policy \
        dcp,greedy-cp,static

Pipelines (``--pp P``, ``--vpp V``): ``--gpus`` is the DCP world (the data-parallel size of one
tensor/pipeline coordinate); every policy plans lockstep slots for one stage (``num_layers / P``
layers, ``--tp`` ranks per tensor-parallel group) and the simulator runs them as micro-batches
through Megatron's 1F1B (interleaved with V > 1) schedule: the table adds the bubble share, the
micro-batches and whether the in-flight memory fits. ``--corpus``: the global batch from the
embedded corpus's documents (byte tokens, in file order).

Mixture of experts (``--model mixtral-8x7b``, ``qwen3-30b-a3b``, ``deepseek-v3`` or a shape with
``num_experts``): ``--ep N`` splits the experts over N ranks of the DCP world; each MoE layer then
adds its token all-to-alls, and every policy plans lockstep slots (``--schedule free`` is
refused, as the runtime refuses it)::

    python tools/simulate.py --gpus 64 --model qwen3-30b-a3b --ep 8 --corpus --policy all

Videos (``--video-mix short|balanced|long`` or ``--video-shapes FILE`` of ``frames height width``
lines in latent patches): every video keeps its own frame size (the plan's ``frame_tokens``), the
bucket baseline buckets by shape at the smallest degree that fits the largest video (unless
``--baseline-degree``), and the lower bound counts each video's spatial and temporal attention.

``--json`` prints one object: ``{"lower_bound_s", "tokens", "policies": {NAME: {"step_time_s",
"tokens_per_s", "efficiency", "imbalance", "plan_ms", "mfu", ...}}}``. Bad input: a one-line
``error: ...`` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from typing import Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_dcp.config import (POLICIES, DCPConfig, DCPConfigError,  # noqa: E402
                                 world_size_flag)
from megatron_dcp.outputs import (OVERWRITE_HELP, mark, output_problem,  # noqa: E402
                                  same_file)
from megatron_dcp.plan import (PlanError, build_cost_model, load_model, lower_bound,  # noqa: E402
                               make_plan, simulate, validate_plan)
from megatron_dcp.plan.hardware import HardwareError  # noqa: E402
from megatron_dcp.plan.pipeline import Pipeline  # noqa: E402
from megatron_dcp.plan.plan import Plan  # noqa: E402
from megatron_dcp.plan.presets import ModelPresetError  # noqa: E402
from megatron_dcp.plan.vocabulary import Vocabulary  # noqa: E402
from megatron_dcp.progress import Heartbeat, Progress  # noqa: E402
from megatron_dcp.runtime.report import log_rows  # noqa: E402
from megatron_dcp.plan.workload import (DEFAULT_MAX_LEN, DISTRIBUTIONS,  # noqa: E402
                                        VIDEO_MIXES, WorkloadError, dataset_batch,
                                        read_lengths_file,
                                        read_shapes_file, sample_lengths, sample_videos,
                                        video_workload)

if __package__:  # tools.simulate, megatron_dcp_tools.simulate
    from .timeline_plot import (MAX_BARS, crowded_note,  # noqa: E402
                                degree_colours, draw_timeline, legend_handles)
else:  # python tools/simulate.py (tools/ is first on sys.path)
    from timeline_plot import (MAX_BARS, crowded_note,  # noqa: E402
                               degree_colours, draw_timeline, legend_handles)

TOOL = "dcp-simulate"

ORDER = ("dcp", "dcp-inter", "dcp-intra", "bucket", "packed", "static", "greedy-cp")


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(prog="dcp-simulate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=world_size_flag, default=None,
                   help="DCP world size: data-parallel ranks, each --tp x --pp GPUs (default "
                        "32, or the --plan's; at most 1,048,576, the plan format's cap)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="DCP ranks per node, i.e. "
                   "GPUs per node / --tp (default: the hardware's)")
    p.add_argument("--model", default="llama-7b", help="model preset or ModelShape JSON (default "
                                                       "llama-7b)")
    p.add_argument("--hardware", default="h200", help="hardware preset or profile JSON (default "
                                                      "h200)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size of the model "
                                                        "(default: the model's)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism with --tp > 1 (activations, P2P "
                        "between stages and TP collectives split along the sequence)")
    p.add_argument("--ep", type=int, default=None,
                   help="expert-parallel size of a MoE model (--model mixtral-8x7b, "
                        "qwen3-30b-a3b, deepseek-v3 or a shape with num_experts); > 1 plans "
                        "lockstep (--schedule free is refused); default: the model's")
    p.add_argument("--expert-tp", type=int, default=None,
                   help="expert tensor-parallel size (Megatron's --expert-tensor-parallel-size; "
                        "default --tp; 1: experts whole, EP groups inside TP groups plan free)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--vpp", type=int, default=1, help="virtual stages per pipeline rank "
                                                      "(interleaved schedule; default 1)")
    p.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3),
                   help="ZeRO stage (default 1)")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="optimizer states (and, ZeRO >= 2, gradient partitions) in host memory: "
                        "DeepSpeed offload_optimizer, Megatron --optimizer-cpu-offload")
    p.add_argument("--offload-param", action="store_true",
                   help="ZeRO-3 parameter partitions in host memory (DeepSpeed offload_param)")
    p.add_argument("--long-sequences", action="store_true",
                   help="a task that fits no plain choice may tile its MLP and loss and offload "
                        "recomputed layers' inputs to the host (docs/USAGE.md, Long sequences)")
    p.add_argument("--schedule", default="auto", choices=("auto", "free", "lockstep"),
                   help="micro-step schedule: auto (lockstep for ZeRO-2/3), free, lockstep")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", help="file: one token count per line, or a Megatron .idx")
    src.add_argument("--idx", help="a Megatron indexed dataset .idx (its sequence lengths)")
    src.add_argument("--dist", choices=sorted(DISTRIBUTIONS), help="built-in length distribution")
    src.add_argument("--plan", help="evaluate this plan JSON (docs/PLAN_FORMAT.md) beside the "
                                    "policies")
    src.add_argument("--video-mix", choices=sorted(VIDEO_MIXES),
                     help="built-in video mix (latent shapes, plan/workload.py VIDEO_MIXES)")
    src.add_argument("--video-shapes", help="file: one video per line, 'frames height width' in "
                                            "latent patches ('#' comments)")
    src.add_argument("--corpus", action="store_true",
                     help="the embedded corpus's documents (byte tokens, file order)")
    src.add_argument("--replay", metavar="LOG.jsonl",
                     help="replay a training run's --log-json: its predicted vs measured step "
                          "times per iteration (how the online calibration's error fell)")
    p.add_argument("--global-batch-tokens", type=int, default=None,
                   help="tokens of the sampled global batch (default 65536 per GPU, 131072 per "
                        "GPU for --video-mix)")
    p.add_argument("--max-len", type=int, default=DEFAULT_MAX_LEN, help="longest sampled sequence")
    p.add_argument("--seq-length", type=int, default=None,
                   help="with --idx: cut the documents laid end to end into samples of this "
                        "many tokens, as Megatron-LM's GPT dataset and the launcher do (each "
                        "document piece of a sample, with its last token's target, is a "
                        "sequence); with --global-batch-tokens, --idx plans global batch "
                        "--seed of that many tokens, not the whole dataset")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--policy", default="all", help="all, or a comma list of: " + ", ".join(ORDER))
    p.add_argument("--memory-budget-gb", type=float, default=None, help="GiB per rank for the "
                                                                        "planner")
    p.add_argument("--recompute", default="auto",
                   choices=("auto", "none", "full"),
                   help="recomputed layers per task: auto (fewest that fit), none, full")
    p.add_argument("--oversize", default="error",
                   choices=("error", "truncate", "skip"),
                   help="a sequence that fits nowhere: error, truncate, skip")
    p.add_argument("--max-degree", type=int, default=None, help="largest group size")
    p.add_argument("--baseline-degree", default=None, type=baseline_degree,
                   help="baselines' fixed SP degree: tuned (fastest that fits), min (smallest "
                        "that fits) or a group size (default: tuned for text, min for videos)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", help="PNG: DCP plan timeline beside the bucket plan (needs "
                                  "matplotlib)")
    p.add_argument("--save-plan", help="write the DCP plan (else the first policy's) as JSON")
    p.add_argument("--overwrite", action="store_true",
                   help=OVERWRITE_HELP + "; --plot and --save-plan are never an input file")
    args = p.parse_args(argv)
    problem = output_problems(args)
    if problem:
        p.error(problem)
    return args


def output_problems(args: argparse.Namespace) -> str:
    """Why ``--plot`` or ``--save-plan`` may not be written, checked before any planning
    (`output_problem`: not an input, not a file dcp-simulate did not write without
    ``--overwrite``, writable), or ``""``."""
    inputs = [(f"--{name.replace('_', '-')}", getattr(args, name)) for name in
              ("lengths", "idx", "plan", "replay", "video_shapes")]
    inputs += [(f"--{name}", getattr(args, name)) for name in ("model", "hardware")
               if os.path.isfile(getattr(args, name))]
    if args.plot and args.save_plan and same_file(args.plot, args.save_plan):
        return f"--plot and --save-plan are the same file {args.plot}: give each its own"
    for flag, path in (("--plot", args.plot), ("--save-plan", args.save_plan)):
        if path is not None:
            problem = output_problem(path, flag=flag, tool=TOOL, inputs=inputs,
                                     overwrite=args.overwrite)
            if problem:
                return problem
    return ""


def baseline_degree(text: str) -> "str | int":
    """``--baseline-degree``: tuned, min or a positive group size."""
    if text in ("tuned", "min"):
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: tuned, min or a positive group size")
    return value


def load_workload(args: argparse.Namespace, world: int) -> tuple[list[int], Optional[list[int]]]:
    """The global batch's lengths, and tokens per frame of each video (``None`` for text): a
    lengths file, an .idx, a sampled distribution, a video shapes file or a video mix."""
    if args.video_shapes or args.video_mix:
        if args.video_shapes:
            shapes = read_shapes_file(args.video_shapes)
        else:
            tokens = args.global_batch_tokens if args.global_batch_tokens is not None \
                else 131072 * world
            shapes = sample_videos(args.video_mix, tokens, seed=args.seed)
        return video_workload(shapes)
    if args.lengths:
        return read_lengths_file(args.lengths), None
    if args.corpus:
        return corpus_batch(args, world), None
    if args.idx:
        if not args.idx.endswith(".idx"):
            raise WorkloadError(f"--idx {args.idx!r}: expected a .idx file")
        documents = read_lengths_file(args.idx)
        if args.global_batch_tokens is None and args.seq_length is None:
            return documents, None  # the whole dataset, its documents whole: one batch
        tokens = args.global_batch_tokens if args.global_batch_tokens is not None \
            else 65536 * world
        return dataset_batch(documents, tokens, batch=args.seed, seq_length=args.seq_length,
                             max_len=args.max_len), None
    if args.seq_length is not None:
        raise WorkloadError("--seq-length cuts the documents of an --idx dataset: give --idx")
    tokens = args.global_batch_tokens if args.global_batch_tokens is not None else 65536 * world
    return sample_lengths(args.dist or "short", tokens, seed=args.seed,
                          max_len=args.max_len), None


def corpus_batch(args: argparse.Namespace, world: int) -> list[int]:
    """Token counts of the embedded corpus's documents (bytes + end of document, at most
    ``--max-len``), in file order from ``--seed`` x the batch, until the batch's tokens."""
    from megatron_dcp.data.datasets import embedded_corpus_texts  # lazy: the data layer

    tokens = args.global_batch_tokens if args.global_batch_tokens is not None else 65536 * world
    docs = [min(len(t.encode("utf-8")) + 1, args.max_len) for t in embedded_corpus_texts()]
    out, k = [], 0
    start = (args.seed * tokens) % max(1, sum(docs))
    while start > 0:
        start -= docs[k % len(docs)]
        k += 1
    while sum(out) < tokens:
        out.append(docs[k % len(docs)])
        k += 1
    out[-1] -= sum(out) - tokens
    return [n for n in out if n > 0]


def policies_of(text: str) -> list[str]:
    """Policy names of ``--policy`` (``all`` or a comma list), checked."""
    if text == "all":
        return list(ORDER)
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in POLICIES]
    if bad or not names:
        raise DCPConfigError(f"--policy {text!r}: unknown {', '.join(bad) or 'empty'}; choose all "
                             "or "
                             f"from {', '.join(ORDER)}")
    return names


def run(args: argparse.Namespace, beat: Optional[Heartbeat] = None) -> dict:
    """Plan with every policy, simulate each plan; the ``--json`` object. ``beat``: told each
    stage, so that work of minutes (a world of 100,000 ranks) says what it is doing."""
    beat = beat or Heartbeat("dcp-simulate", after=float("inf"))
    external = None
    if args.plan:
        try:
            with open(args.plan) as handle:
                external = Plan.from_json(handle.read())
        except OSError as err:
            raise WorkloadError(f"cannot read plan {args.plan!r}: {err.strerror or err}") from None
        except (ValueError, KeyError, TypeError) as err:
            raise PlanError(f"plan {args.plan!r} is not a valid plan JSON: {err}") from None
        if args.gpus is not None and args.gpus != external.world_size:
            raise PlanError(f"--gpus {args.gpus} differs from the plan's world_size "
                            f"{external.world_size}")
    world = external.world_size if external else (args.gpus if args.gpus is not None else 32)
    if world < 1:
        raise PlanError(f"--gpus {world}: must be >= 1")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise PlanError(f"--gpus-per-node {args.gpus_per_node}: must be >= 1")
    model = load_model(args.model)
    try:
        model = replace(model, tensor_parallel=args.tp or model.tensor_parallel,
                        pipeline_parallel=args.pp, virtual_pipeline=args.vpp,
                        sequence_parallel=args.sequence_parallel or model.sequence_parallel)
    except ValueError as err:
        raise PlanError(f"--tp/--pp/--vpp/--sequence-parallel: {err}") from None
    given = " ".join(f"--{name} {value}" for name, value in
                     (("ep", args.ep), ("expert-tp", args.expert_tp)) if value is not None)
    if given:
        if not model.is_moe:
            raise PlanError(f"{given} needs a MoE model (mixtral-8x7b, qwen3-30b-a3b, "
                            f"deepseek-v3 or a ModelShape with num_experts); {model.name} is "
                            "dense")
        try:
            model = replace(model, expert_parallel=args.ep or model.expert_parallel,
                            expert_tensor_parallel=args.expert_tp or model.expert_tensor_parallel)
        except ValueError as err:
            raise PlanError(f"{given}: {err}") from None
    pipe = Pipeline.of(model)
    if external is not None:
        lengths = list(external.lengths)
        frames = list(external.frame_tokens) if external.frame_tokens is not None else None
    else:
        beat.stage(f"sampling the global batch of {world:,} ranks")
        lengths, frames = load_workload(args, world)
    if frames is not None and not model.frame_tokens:
        raise PlanError(f"videos need a video model (--model video-dit or a ModelShape with "
                        f"frame_tokens); {model.name} is a text model")
    names = policies_of(args.policy)
    beat.stage(f"the cost model and group vocabulary of {world:,} ranks ({sum(lengths):,} "
               f"tokens in {len(lengths):,} sequences)")
    base = DCPConfig(hardware=args.hardware, ranks_per_node=args.gpus_per_node,
                     memory_budget_gb=args.memory_budget_gb,
                     recompute=args.recompute,
                     oversize=args.oversize, max_degree=args.max_degree,
                     schedule=args.schedule)
    cm = build_cost_model(model, base, world, zero_stage=args.zero_stage,
                          offload_optimizer=args.offload_optimizer,
                          offload_param=args.offload_param, long_sequences=args.long_sequences)
    plans: dict[str, Plan] = {}
    with Progress("planning", total=len(names)) as bar:
        for k, name in enumerate(names, 1):
            bar.update(0, label=name)
            beat.stage(f"planning with {name} ({k} of {len(names)} policies)")
            t0 = time.perf_counter()
            plans[name] = make_plan(lengths, world_size=world, model=model,
                                    config=base.replace(policy=name),
                                    zero_stage=args.zero_stage, cost_model=cm,
                                    baseline_degree=args.baseline_degree, frame_tokens=frames)
            plans[name].meta["plan_ms"] = (time.perf_counter() - t0) * 1e3
            bar.update(label=name)
    if external is not None:
        validate_plan(external, model, cost_model=cm, check_times=False)
        plans["plan:" + os.path.basename(args.plan)] = external
    first = next(iter(plans.values()))
    beat.stage("the lower bound")
    vocab = Vocabulary.for_cost_model(cm, args.max_degree)  # the planner's own
    ran_seqs = [s for t in first.tasks for s in t.seqs]
    ran = [first.lengths[s] for s in ran_seqs]
    ran_frames = [first.frame_tokens[s] for s in ran_seqs] \
        if first.frame_tokens is not None else None
    bound = lower_bound(ran, cm, world_size=world, max_degree=args.max_degree,
                        recompute_mode=args.recompute, frame_tokens=ran_frames)
    mold = lower_bound(ran, cm, world_size=world, max_degree=args.max_degree,
                       recompute_mode=args.recompute, moldable=True, frame_tokens=ran_frames)
    results = {}
    for name, plan in plans.items():
        beat.stage(f"simulating the {name} plan")
        results[name] = simulate(plan, cm, bound=bound, moldable_bound=mold, pipeline=pipe)
    ref = results.get("bucket")
    sync = cm.time_model.sync_time()
    out = {
        "lower_bound_s": bound + sync, "moldable_lower_bound_s": mold + sync,
        "tokens": sum(ran), "sequences": len(lengths), "videos": frames is not None,
        "world_size": world, "ranks_per_node": cm.ranks_per_node, "model": model.name,
        "hardware": cm.hw.name, "zero_stage": args.zero_stage, "sync_s": sync,
        "schedule": first.meta.get("schedule", "free"), "tensor_parallel": model.tensor_parallel,
        "sequence_parallel": model.sequence_parallel,
        "experts": model.num_experts or 0, "moe_topk": model.moe_topk if model.is_moe else 0,
        "expert_parallel": model.expert_parallel,
        "pipeline_parallel": pipe.stages, "virtual_pipeline": pipe.virtual,
        "vocabulary_groups": len(vocab), "vocabulary": vocab.describe(),
        "communicator_memory_gib": cm.memory_model.communicators.bytes / 2**30,
        "policies": {},
    }
    for name, r in results.items():
        plan = plans[name]
        trained = bool(plan.tasks)  # every sequence skipped: no efficiency to speak of
        out["policies"][name] = {
            "step_time_s": r.step_time_s, "tokens_per_s": r.tokens_per_s,
            "efficiency": r.efficiency if trained else None,
            "imbalance": r.imbalance, "plan_ms": plan.meta.get("plan_ms", 0.0), "mfu": r.mfu,
            "speedup_vs_bucket": (ref.step_time_s / r.step_time_s) if ref and trained else None,
            "moldable_efficiency": r.moldable_efficiency if trained else None,
            "comm_share": r.comm_share, "recompute_share": r.recompute_share, "tasks": r.num_tasks,
            "skipped": len(plan.skipped),
            "skipped_tokens": sum(plan.lengths[i] for i in plan.skipped), "candidate": plan.meta.get("candidate"),
            "digest": plan.digest(),
        }
        if pipe.stages > 1:
            out["policies"][name].update(
                lower_bound_s=r.lower_bound_s, bubble_share=r.bubble_share,
                micro_batches=r.micro_batches, memory_fits=r.memory_fits,
                peak_memory_gib=r.peak_memory_gib)
    if args.save_plan:
        chosen = plans.get("dcp") or first
        saved = dict(chosen.to_dict(), meta={**chosen.meta, "written_by": mark(TOOL)})
        with open(args.save_plan, "w") as handle:  # the mark: a later --save-plan may replace it
            handle.write(json.dumps(saved, indent=1))
    if args.plot:
        beat.stage(f"drawing --plot {args.plot}")
        shown = [(n, plans[n], results[n]) for n in ("dcp", "bucket") if n in plans] or \
            [(n, p, results[n]) for n, p in list(plans.items())[:2]]
        plot_plans(shown, args.plot, cm)
    return out


def simulated_tasks(plan: Plan, result) -> list:
    """The plan's tasks as `timeline_plot` draws them: (start, duration, degree, recomputed
    layers, ranks), at the times of its simulation ``result``."""
    return [(start, duration, t.degree, t.recompute_layers, t.ranks)
            for t, start, duration in zip(plan.tasks, result.starts, result.durations)]


def plot_plans(shown: list, path: str, cm) -> None:
    """Timelines side by side (`timeline_plot.draw_timeline`): one row per rank, tasks coloured
    by degree, recompute hatched."""
    import matplotlib  # lazy: only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = degree_colours(t.degree for _, plan, _ in shown for t in plan.tasks)
    world = shown[0][1].world_size
    fig, axes = plt.subplots(1, len(shown), figsize=(7 * len(shown), 1.5 + min(world, 128) * 0.12),
                             sharey=True, squeeze=False)
    for ax, (name, plan, result) in zip(axes[0], shown):
        bars = sum(t.degree for t in plan.tasks)
        if bars > MAX_BARS:  # a world of 100,000 ranks: minutes of drawing, unreadable
            crowded_note(ax, bars)
        else:
            draw_timeline(ax, simulated_tasks(plan, result), colours, world)
        ax.set_title(f"{name}: step {result.step_time_s:.2f} s, efficiency {result.efficiency:.2f}")
        ax.set_xlim(0, max(r.makespan_s for _, _, r in shown) * 1.02)
    for ax in axes[0][1:]:
        ax.set_ylabel("")
    fig.legend(handles=legend_handles(colours), loc="upper right", fontsize="small")
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    marked = {".png": "Software", ".pdf": "Creator", ".svg": "Creator"}.get(
        os.path.splitext(path)[1].lower())  # where the format holds a text: a later --plot may
    fig.savefig(path, dpi=110, metadata={marked: mark(TOOL)} if marked else None)  # replace it
    plt.close(fig)


def _experts_text(out: dict) -> str:
    """`` (E experts top-k, EP n)`` for a MoE model, empty for a dense one."""
    if not out.get("experts"):
        return ""
    return f" ({out['experts']} experts top-{out['moe_topk']}, EP {out['expert_parallel']})"


def print_table(out: dict) -> None:
    """The human-readable table of `run`'s result."""
    kind = "videos" if out.get("videos") else "sequences"
    print(f"{out['sequences']} {kind}, {out['tokens']} tokens on {out['world_size']} ranks "
          f"({out['ranks_per_node']}/node), {out['model']}{_experts_text(out)} on "
          f"{out['hardware']}, ZeRO "
          f"{out['zero_stage']}, {out['schedule']} schedule; "
          f"lower bound {out['lower_bound_s']:.3f} s (moldable "
          f"{out['moldable_lower_bound_s']:.3f} s; both "
          f"incl. {out['sync_s']:.3f} s gradient sync)")
    print(f"group vocabulary: {out['vocabulary']} "
          f"({out['communicator_memory_gib']:.1f} GiB of communicators per rank)")
    skips = any(r.get("skipped") for r in out["policies"].values())
    head = f"{'policy':<14}{'step s':>9}{'tokens/s':>11}{'vs bucket':>10}{'effic.':>8}" \
           f"{'(mold.)':>8}{'imbal.':>8}" \
           f"{'MFU':>6}{'recomp':>8}{'comm':>6}{'tasks':>7}{'plan ms':>9}" + \
           (f"{'skipped':>9}" if skips else "")
    print(head)
    print("-" * len(head))

    def figure(value) -> str:
        return f"{value:>8.3f}" if value is not None else f"{'-':>8}"

    for name, r in out["policies"].items():
        speed = f"{r['speedup_vs_bucket']:.2f}x" if r["speedup_vs_bucket"] else "-"
        print(f"{name:<14}{r['step_time_s']:>9.3f}{r['tokens_per_s']:>11.0f}{speed:>10}"
              f"{figure(r['efficiency'])}{figure(r['moldable_efficiency'])}"
              f"{r['imbalance']:>8.3f}{r['mfu']:>6.2f}{r['recompute_share']:>8.2f}"
              f"{r['comm_share']:>6.2f}"
              f"{r['tasks']:>7}{r['plan_ms']:>9.1f}" + (f"{r['skipped']:>9}" if skips else ""))
    for name, r in out["policies"].items():
        if r.get("skipped"):
            print(f"{name}: --oversize skip left out {r['skipped']} of {out['sequences']} "
                  f"{kind} ({r['skipped_tokens']} tokens): they fit no group"
                  + ("; nothing trains, so no efficiency" if not r["tasks"] else ""))
    if out.get("pipeline_parallel", 1) > 1:
        print(f"pipeline: {out['pipeline_parallel']} stages x {out['virtual_pipeline']} virtual, "
              f"tp {out['tensor_parallel']} (efficiency against each plan's pipeline-aware bound)")
        print(f"{'policy':<14}{'bound s':>9}{'bubble':>8}{'micro-b.':>9}{'peak GiB':>10}{'fits':>6}")
        for name, r in out["policies"].items():
            print(f"{name:<14}{r['lower_bound_s']:>9.3f}{r['bubble_share']:>8.3f}"
                  f"{r['micro_batches']:>9}{r['peak_memory_gib']:>10.1f}"
                  f"{'yes' if r['memory_fits'] else 'NO':>6}")


def replay(path: str) -> dict:
    """Predicted vs measured step time of every iteration of a ``--log-json`` file; a row whose
    times are not positive numbers (``step_s: 0``, a string) is a `WorkloadError` naming
    ``path:line``, as is a line that is not UTF-8 or JSON."""
    rows = []
    try:
        for number, row in log_rows(path):
            if not isinstance(row, dict) or "step_s" not in row:
                raise WorkloadError(f"{path}:{number}: not a --log-json row (no step_s)")
            predicted = row.get("predicted_s")
            if predicted is None or predicted == 0:  # a row without a plan's prediction
                continue
            for key in ("step_s", "predicted_s"):
                value = row[key]
                if not (_number(value) and math.isfinite(value) and value > 0):
                    raise WorkloadError(f"{path}:{number}: {key} {json.dumps(value)[:40]} is "
                                        "not a positive number of seconds")
            calibration = row.get("calibration_error")
            if calibration is not None and not _number(calibration):
                raise WorkloadError(f"{path}:{number}: calibration_error "
                                    f"{json.dumps(calibration)[:40]} is not a number")
            iteration = row.get("iteration", number)
            rows.append({"iteration": iteration if isinstance(iteration, int) else number,
                         "step_s": float(row["step_s"]), "predicted_s": float(predicted),
                         "error": float(predicted) / row["step_s"] - 1.0,
                         "calibration_error": calibration})
    except ValueError as err:
        raise err if isinstance(err, WorkloadError) else WorkloadError(str(err)) from None
    if not rows:
        raise WorkloadError(f"{path}: no row has predicted_s (a run with --dcp writes it)")
    return {"replay": path, "iterations": rows}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def print_replay(out: dict) -> None:
    """The replay as a table: one line per iteration."""
    print(f"replay of {out['replay']}: predicted vs measured step time")
    print(f"{'iter':>5} {'step ms':>9} {'predicted ms':>13} {'error':>8} {'calib. error':>13}")
    for r in out["iterations"]:
        calib = r["calibration_error"]
        calib_text = f"{calib * 100:.1f} %" if calib is not None else "-"
        print(f"{r['iteration']:>5} {r['step_s'] * 1e3:>9.1f} {r['predicted_s'] * 1e3:>13.1f} "
              f"{r['error'] * 100:>7.1f}% {calib_text:>13}")


def main(argv=None) -> int:
    """Entry point: exit status 0, or 2 with a one-line error on bad input."""
    args = parse_args(argv)
    if args.replay:
        try:
            out = replay(args.replay)
        except (WorkloadError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(json.dumps(out, indent=1)) if args.json else print_replay(out)
        return 0
    try:
        with Heartbeat(TOOL) as beat:
            out = run(args, beat)
    except (PlanError, WorkloadError, HardwareError, ModelPresetError, DCPConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:
        print(f"error: --plot needs matplotlib ({err})", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
