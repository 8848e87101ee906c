"""Per-iteration output of a training run, the same for every engine adapter.

`plan_summary` condenses a step's plan (degrees used, micro-steps per rank, recomputed layers,
predicted step time) into a JSON-ready dict, `plan_timeline` its tasks' predicted times and
ranks (read back by `timeline_tasks`); `TrainingLog` prints one line per iteration with a
progress bar, writes the ``--log-json`` lines (one JSON object per iteration: ``iteration``,
``loss``, ``tokens``, ``tokens_per_s``, ``step_s``, ``skipped`` and ``skipped_steps``, with DCP
``predicted_s`` and ``calibration_error``, ``plan``, every ``timeline_interval`` iterations
``timeline``, ``checkpoint_dir`` (whose resume continues this log: `log_file`), and whatever
else the caller adds, e.g. `peak_memory_mb`) and the final
throughput line. ``tokens`` are the tokens trained (targets of non-zero loss weight: a loss mask
leaves prompts out; a skipped step trains none), ``tokens_run`` those the step ran (the plan's
lengths, `tokens_run`: a masked token still costs compute; MFU counts these), each with its
rate (``tokens_per_s``, ``tokens_run_per_s``). A sequence the oversize policy skipped is counted
as skipped (``skipped_sequences``), neither trained nor run. Pure Python (torch only where a CUDA
device is measured): the examples of both engines use it.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any, Iterator, Optional, Sequence, Union

from megatron_dcp.plan.plan import MAX_WORLD_SIZE, Plan
from megatron_dcp.runtime.log_file import CHECKPOINT_DIR_KEY, open_log


def plan_summary(plan: Optional[Plan], *, micro_steps: Union[int, Sequence[int], None] = None,
                 plan_s: Optional[float] = None,
                 plan_wait_s: Optional[float] = None) -> dict[str, Any]:
    """Degrees used, micro-steps per rank, recomputed layers and predicted step time of
    ``plan``, with ``plan_ms`` (time spent planning) and ``plan_wait_ms`` (time the step waited
    for its plan: less than ``plan_ms`` for a plan made ahead) when given; for plain data
    parallel (no plan, or `data_parallel_plan`'s) only the micro-steps per rank (the plan's, else
    ``micro_steps`` given by the caller)."""
    if plan is None or plan.policy == "data-parallel":
        if plan is not None:  # plain data parallel as a plan: its micro-steps per rank
            micro_steps = plan.micro_steps_per_rank()
        steps = list(micro_steps) if isinstance(micro_steps, (list, tuple)) else micro_steps
        return {"mode": "data-parallel", "micro_steps_per_rank": steps}
    degrees = Counter(t.degree for t in plan.tasks)
    summary = {"mode": "dcp", "degrees": {str(k): v for k, v in sorted(degrees.items())},
               "micro_steps_per_rank": plan.micro_steps_per_rank(),
               "recompute_layers": sorted({t.recompute_layers for t in plan.tasks}),
               "predicted_s": round(plan.makespan, 6)}
    if plan.lockstep:  # every rank runs every slot: its tasks and empty micro-steps
        summary["slots"] = len(plan.slot_recompute_layers())
    if plan_s is not None:
        summary["plan_ms"] = round(plan_s * 1e3, 2)
    if plan_wait_s is not None:
        summary["plan_wait_ms"] = round(plan_wait_s * 1e3, 2)
    return summary


TIMELINE_INTERVAL = 100
"""Default of ``--log-timeline-interval`` (examples) and ``--dcp-log-timeline-interval`` (the
launcher): a row carries the plan's timeline at the first logged iteration and every this many
(0: never); a row of a 64-rank plan grows by a few KB with it."""

TimelineTask = tuple[float, float, int, int, tuple[int, ...]]
"""(start s, duration s, degree, recomputed layers, ranks) of one task of a timeline."""


def plan_timeline(plan: Plan) -> dict[str, Any]:
    """The predicted timeline of ``plan``'s tasks, compact, for a log row: ``{"world_size": W,
    "tasks": [[start, duration, degree, recompute_layers, ranks], ...]}``, seconds rounded to
    the microsecond, as the planner predicted them (the times ``predicted_s`` is made of: its
    makespan plus the step's overhead); ``ranks`` is the group's first rank where the group is
    the ``degree`` ranks from it in order, else the list of its ranks."""
    tasks = []
    for t in plan.tasks:
        first = t.ranks[0]
        ranks = first if t.ranks == tuple(range(first, first + t.degree)) else list(t.ranks)
        tasks.append([round(t.start, 6), round(t.duration, 6), t.degree, t.recompute_layers,
                      ranks])
    return {"world_size": plan.world_size, "tasks": tasks}


def timeline_tasks(timeline: Any) -> list[TimelineTask]:
    """The tasks of a `plan_timeline` (a log row's ``timeline``), every group's ranks spelled
    out, once `timeline_bars` has checked them (``ValueError`` naming the task)."""
    timeline_bars(timeline)
    return [(float(start), float(duration), degree, recompute,
             tuple(range(ranks, ranks + degree)) if _whole(ranks) else tuple(ranks))
            for start, duration, degree, recompute, ranks in timeline["tasks"]]


def timeline_bars(timeline: Any) -> int:
    """The bars a drawing of the timeline holds (one per task and rank: the sum of the
    degrees), every task checked first without spelling out its ranks: ``ValueError`` naming
    the task where a field has the wrong type, a time is not a finite number >= 0, or a degree
    or rank lies outside the world (at most `MAX_WORLD_SIZE` ranks). A crafted row then cannot
    make a reader spell out 10^9 ranks; a reader bounds what it draws by this count."""
    if not isinstance(timeline, dict) or not isinstance(timeline.get("tasks"), list):
        raise ValueError("timeline: not an object with a 'tasks' list")
    world = timeline.get("world_size")
    if not _whole(world) or not 1 <= world <= MAX_WORLD_SIZE:
        raise ValueError(f"timeline world_size {world!r}: a whole number of ranks from 1 to "
                         f"{MAX_WORLD_SIZE}")
    bars = 0
    for k, task in enumerate(timeline["tasks"]):
        where = f"timeline task {k}"
        if not isinstance(task, list) or len(task) != 5:
            raise ValueError(f"{where}: {str(task)[:80]} is not [start, duration, degree, "
                             "recompute_layers, ranks]")
        start, duration, degree, recompute, ranks = task
        for name, value in (("start", start), ("duration", duration)):
            if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value) and value >= 0):
                raise ValueError(f"{where}: {name} {value!r} is not a finite number >= 0")
        if not _whole(degree) or not 1 <= degree <= world:
            raise ValueError(f"{where}: degree {degree!r} is not a whole number from 1 to the "
                             f"world's {world} ranks")
        if not _whole(recompute) or recompute < 0:
            raise ValueError(f"{where}: recompute_layers {recompute!r} is not a whole number "
                             ">= 0")
        if _whole(ranks):
            if not 0 <= ranks <= world - degree:
                raise ValueError(f"{where}: ranks {ranks}..{ranks + degree - 1} lie outside "
                                 f"the world's ranks 0..{world - 1}")
        elif isinstance(ranks, list) and len(ranks) == degree and all(map(_whole, ranks)):
            if len(set(ranks)) != degree or min(ranks) < 0 or max(ranks) >= world:
                raise ValueError(f"{where}: ranks {str(ranks)[:80]} are not {degree} distinct "
                                 f"ranks of the world's 0..{world - 1}")
        else:
            raise ValueError(f"{where}: ranks {str(ranks)[:80]} is neither a first rank nor a "
                             f"list of {degree} ranks (its degree)")
        bars += degree
    return bars


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def log_rows(path: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) of every non-blank line of a JSON log (``--log-json``), a line
    that is not UTF-8, not JSON or nested too deep for the parser raising ``ValueError`` that
    names ``path:line`` (a bare ``UnicodeDecodeError`` or ``RecursionError`` names neither).
    Blank lines are skipped, so a line number is the file's, as an editor shows it."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{number}: not UTF-8 text (byte "
                                 f"0x{raw[err.start]:02x} at column {err.start + 1}); a log "
                                 "written by --log-json is UTF-8") from None
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except RecursionError:
                raise ValueError(f"{path}:{number}: JSON nested too deeply to read (not a "
                                 "log row)") from None
            except ValueError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err})") from None


def tokens_run(plan: Optional[Plan], lengths: Sequence[int]) -> tuple[int, int]:
    """(tokens run, sequences skipped) of a global batch of sequences with these lengths:
    without a plan every token; with one, the sequences in its tasks at their planned lengths
    (``dcp.oversize`` truncate shortens them, skip leaves them out). Tokens run cost compute
    whether or not they are trained (a masked prompt token runs): what MFU counts."""
    if plan is None:
        return sum(int(n) for n in lengths), 0
    return sum(plan.lengths[s] for t in plan.tasks for s in t.seqs), len(plan.skipped)


trained_tokens = tokens_run
"""The old name of `tokens_run` (from before loss masks, when every token run was trained)."""


def _planned_tokens(plan: Plan) -> int:
    """The tokens ``plan`` runs (`tokens_run`)."""
    return tokens_run(plan, plan.lengths)[0]


def check_resume_point(start: int, train_iters: int, load: str, *, primary: bool) -> None:
    """A checkpoint past ``--train-iters`` is an error (`SystemExit`, exit 1: nothing would be
    trained, and ``done: 0 iterations`` would hide it); one at it says the run is complete."""
    if start > train_iters:
        raise SystemExit(f"error: --load {load} is at iteration {start}, past --train-iters "
                         f"{train_iters}: nothing to train (raise --train-iters to continue)")
    if start == train_iters and primary:
        print(f"--load {load} is at iteration {start} = --train-iters: already complete, "
              "nothing to train", flush=True)


def peak_memory_mb(device: Any = None) -> float:
    """Peak memory of this process since `reset_peak_memory` (else since it started), MiB:
    CUDA's max allocated on ``device`` when it is a CUDA device, else the peak resident set size
    (what a CPU run uses)."""
    if device is not None and str(device).startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:  # Linux: the high-water mark clear_refs resets
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, else KiB


def reset_peak_memory(device: Any = None) -> None:
    """Measure `peak_memory_mb` from now on (after start-up: building the model unsharded before
    ZeRO partitions it is not what training holds). CUDA: its peak statistics; Linux: the peak
    RSS (``/proc/self/clear_refs``); elsewhere nothing is reset."""
    if device is not None and str(device).startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def progress_bar(done: int, total: int, width: int = 20) -> str:
    """``[#####.....]`` for ``done`` of ``total``."""
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _per_rank(steps: Any) -> str:
    """Micro-steps per rank: each rank's (``4/6``) up to 8 ranks, else the range (``3-7``)."""
    if not isinstance(steps, (list, tuple)):
        return str(steps)
    if len(steps) <= 8:
        return "/".join(map(str, steps))
    return f"{min(steps)}-{max(steps)}" if steps else "0"


def plan_text(summary: dict[str, Any]) -> str:
    """A step's plan (`plan_summary`) in words: its tasks by sequence-parallel degree, the
    micro-steps each rank runs, the layers its tasks recompute, e.g. ``tasks 6 at SP 1, 2 at SP
    2 | micro-steps/rank 4/6 | recompute 0-2 layers``."""
    steps = f"micro-steps/rank {_per_rank(summary['micro_steps_per_rank'])}"
    if summary["mode"] != "dcp":
        return steps
    tasks = ", ".join(f"{n} at SP {d}" for d, n in summary["degrees"].items()) or "none"
    layers = summary["recompute_layers"]
    recompute = "no recompute" if not any(layers) else \
        f"recompute {min(layers)}-{max(layers)} layers" if len(layers) > 1 else \
        f"recompute {layers[0]} layers"
    return f"tasks {tasks} | {steps} | {recompute}"


def plan_line(iteration: int, result: Any, step_s: float) -> str:
    """The launcher's line beside Megatron-LM's own at each ``--log-interval``: the step's plan
    in words (`plan_text`), its measured and predicted time, the cost model's median error:
    ``[dcp] iteration 3: step 506 ms, predicted 315 ms (median error 8%) | tasks ...``."""
    plan = plan_summary(result.plan) if result.plan is not None else \
        plan_summary(None, micro_steps=result.micro_steps)
    skipped = " | SKIPPED step" if result.skipped else ""
    return (f"[dcp] iteration {iteration}: step {step_s * 1e3:.0f} ms,"
            f"{_prediction_text(result.predicted_s, result.calibration_error)} | "
            f"{plan_text(plan)}{skipped}")


def _prediction_text(predicted_s: Optional[float], error: Optional[float]) -> str:
    """`` predicted 701 ms (median error 12%)``: the cost model's step time, and its median
    relative error over the calibration window of recent steps (not this step's own)."""
    if not predicted_s:
        return ""
    text = f" predicted {predicted_s * 1e3:.0f} ms"
    return text + (f" (median error {error * 100:.0f}%)" if error is not None else "")


def _tokens_text(record: dict[str, Any]) -> str:
    """``tokens 900 trained/1000 run 450 tok/s trained`` of a log row (the old ``tokens 900
    450 tok/s`` where the tokens run are not known)."""
    if "tokens_run" not in record:
        return f"tokens {record['tokens']} {record['tokens_per_s']:.0f} tok/s"
    return (f"tokens {record['tokens']} trained/{record['tokens_run']} run "
            f"{record['tokens_per_s']:.0f} tok/s trained")


def _mfu_text(figures: Optional[dict[str, float]]) -> str:
    """`` MFU 41.3%`` from a step's figures (`megatron_dcp.runtime.figures`), where known."""
    return f" MFU {figures['mfu'] * 100:.1f}%" if figures and "mfu" in figures else ""


def _skip_text(step: bool, steps: int, sequences: int, empty: bool = False,
               cut: tuple[int, int] = (0, 0)) -> str:
    why = "no trained token" if empty else "non-finite"
    text = f" | SKIPPED step ({why}; {steps} so far)" if step else ""
    text += f" | {sequences} sequences skipped (oversize)" if sequences else ""
    return text + (f" | {cut[0]} sequences truncated ({cut[1]} tokens cut, oversize)"
                   if cut[0] else "")


class TrainingLog:
    """Iteration lines, ``--log-json`` records and the final line of one training run.

    ``primary``: this process reports (rank 0); others only count. ``quiet``: no iteration lines
    (the final line is still printed). ``resume_at``: the run resumed at this iteration: its JSON
    log keeps its rows up to it and continues (`megatron_dcp.runtime.log_file.open_log`; None:
    the log is replaced, which the front end allowed while parsing: `log_problem`).
    ``checkpoint_dir``: every row names it (`log_file.checkpoint_dir`: how a resume recognises
    its own log); ``log_flag``: the flag naming the JSON log, for messages.
    ``timeline_interval``: the rows of the first iteration logged and of every iteration
    divisible by it carry the step plan's `plan_timeline` (0: none).
    """

    def __init__(self, mode: str, train_iters: int, *, json_path: Optional[str] = None,
                 primary: bool = True, quiet: bool = False, resume_at: Optional[int] = None,
                 checkpoint_dir: Optional[str] = None, log_flag: str = "--log-json",
                 timeline_interval: int = TIMELINE_INTERVAL) -> None:
        self.mode = mode
        self.timeline_interval = timeline_interval
        self.train_iters = train_iters
        self.primary = primary
        self.quiet = quiet
        self.iterations = 0
        self.tokens = 0
        self.tokens_run = 0
        self._run_rows = 0  # rows that knew their tokens run (the final line needs all)
        self.seconds = 0.0
        self.skipped_steps = 0
        self.skipped_sequences = 0
        self.truncated_tokens = 0
        self.checkpoint_dir = checkpoint_dir
        self.json_path = json_path  # the same on every rank (only the primary writes it)
        self._json = open_log(json_path, resume_at, flag=log_flag) \
            if (json_path and primary) else None

    def iteration(self, iteration: int, *, loss: float, tokens: int, step_s: float,
                  plan: dict[str, Any], tokens_run: Optional[int] = None,
                  predicted_s: Optional[float] = None,
                  calibration_error: Optional[float] = None, skipped: bool = False,
                  skipped_sequences: int = 0, step_plan: Optional[Plan] = None,
                  timeline_extra: Optional[Any] = None, **extra: Any) -> dict[str, Any]:
        """Record one iteration (1-based ``iteration``); returns the JSON record.
        ``tokens``: tokens trained (targets of non-zero weight: `StepResult.tokens`);
        ``tokens_run``: tokens run (default: ``step_plan``'s, `tokens_run`); ``predicted_s``:
        the step time the cost model predicted (DCP); ``calibration_error``: the online calibration's current median
        relative error of that prediction; ``skipped``: the step applied no update (a non-finite
        loss skipped, an fp16 overflow): it trained no tokens; ``skipped_sequences``: sequences
        of the batch the oversize policy left out; ``step_plan``: the step's DCP plan, whose
        `plan_timeline` the row carries when due (``timeline_interval``), with what
        ``timeline_extra()`` returns, called then only (measured task seconds, per-rank
        figures: `megatron_dcp.runtime.run_info.TimelineExtras`). An ``extra``
        ``sequences`` (the batch's count) is recorded like ``tokens``: the sequences trained
        (without those left out; none in a skipped step), the batch's count as
        ``batch_sequences``. The sequences the oversize policy truncated and the tokens cut from
        them are read from ``step_plan`` (`Plan.truncated`): ``truncated_sequences`` and
        ``truncated_tokens``; a skipped step of ``step_plan`` with no target token, or ``tokens``
        0 (every target masked), is skipped for that reason (``SKIPPED step (no trained token
        ...)``)."""
        cut = (len(step_plan.truncated), step_plan.truncated_tokens) \
            if step_plan is not None else (0, 0)
        # no target at all, or none of non-zero weight (a loss mask over the whole batch)
        empty = skipped and (tokens == 0 or getattr(step_plan, "target_tokens", 1) == 0)
        self.truncated_tokens += cut[1]
        self.iterations += 1
        self.seconds += step_s
        self.skipped_steps += int(skipped)
        self.skipped_sequences += skipped_sequences
        record = {"iteration": iteration, "loss": loss,
                  **self._tokens(0 if skipped else tokens, tokens_run, step_s, step_plan),
                  "step_s": step_s, "skipped": skipped, "skipped_steps": self.skipped_steps,
                  "skipped_sequences": skipped_sequences, "truncated_sequences": cut[0],
                  "truncated_tokens": cut[1]}
        if predicted_s is not None:
            record["predicted_s"] = predicted_s
            record["calibration_error"] = calibration_error
        record.update(extra)
        if "sequences" in extra:  # counted as the tokens are: the trained ones
            record["batch_sequences"] = extra["sequences"]
            record["sequences"] = 0 if skipped else extra["sequences"] - skipped_sequences
        record["plan"] = plan
        if self.checkpoint_dir is not None:
            record[CHECKPOINT_DIR_KEY] = self.checkpoint_dir
        record.update(self._timeline(iteration, step_plan, timeline_extra))
        if self._json is not None:
            self._json.write(json.dumps(record) + "\n")
            self._json.flush()
        if self.primary and not self.quiet:
            print(f"{progress_bar(iteration, self.train_iters)} iter {iteration}/"
                  f"{self.train_iters} loss {loss:.4f} {_tokens_text(record)}"
                  f"{_mfu_text(extra.get('figures'))} "
                  f"step {step_s * 1e3:.0f} ms"
                  f"{_prediction_text(predicted_s, calibration_error)} | {plan_text(plan)}"
                  f"{_skip_text(skipped, self.skipped_steps, skipped_sequences, empty, cut)}",
                  flush=True)
        return record

    def _timeline(self, iteration: int, step_plan: Optional[Plan],
                  extra: Optional[Any]) -> dict[str, Any]:
        """``{"timeline": ...}`` of a row that carries one (`_timeline_due`, a DCP plan), with
        what ``extra()`` returns; else {}."""
        if not (self.primary and self._timeline_due(iteration) and step_plan is not None
                and step_plan.policy != "data-parallel"):
            return {}
        timeline = plan_timeline(step_plan)
        timeline.update(extra() if extra is not None else {})
        return {"timeline": timeline}

    def _tokens(self, tokens: int, tokens_run: Optional[int], step_s: float,
                step_plan: Optional[Plan]) -> dict[str, Any]:
        """A row's tokens trained and run (``step_plan``'s where not given; none without
        either) with their rates, added to the run's totals."""
        if tokens_run is None and step_plan is not None:
            tokens_run = _planned_tokens(step_plan)
        self.tokens += tokens
        self.tokens_run += tokens_run or 0
        self._run_rows += tokens_run is not None
        out = {"tokens": tokens, "tokens_per_s": tokens / step_s if step_s > 0 else 0.0}
        if tokens_run is not None:
            out.update(tokens_run=tokens_run,
                       tokens_run_per_s=tokens_run / step_s if step_s > 0 else 0.0)
        return out

    def _timeline_due(self, iteration: int) -> bool:
        """Whether this row carries the timeline: the first one logged, then every
        ``timeline_interval`` iterations."""
        every = self.timeline_interval
        return every > 0 and (self.iterations == 1 or iteration % every == 0)

    def close(self) -> None:
        """Print the final line (throughput over the iterations run) and close the JSON log."""
        if self.primary:
            rate = self.tokens / self.seconds if self.seconds else 0.0
            skips = [f"{n} {what} skipped" for n, what in
                     ((self.skipped_steps, "steps"), (self.skipped_sequences, "sequences")) if n]
            if self.truncated_tokens:
                skips.append(f"{self.truncated_tokens} tokens truncated")
            run = f" ({self.tokens_run} run)" if self._run_rows == self.iterations else ""
            print(f"done: {self.mode}, {self.iterations} iterations, {self.tokens} tokens "
                  f"trained{run}, {rate:.0f} tokens/s{' trained' if run else ''}" +
                  "".join(f", {t}" for t in skips), flush=True)
        if self._json is not None:
            self._json.close()
            self._json = None


def setup_line(config: Any, cost_model: Any, world_size: int, pipelined: bool = False) -> str:
    """What DCP will do, in one line (rank 0 prints it at start): the policy and schedule, the
    DCP world, the hardware the cost model uses and where it comes from, the memory budget with
    its static part and reserve and the tokens a degree-1 task may hold (no layer recomputed,
    every layer recomputed), the layer memory's implementation row and whether it is measured
    or counted (`megatron_dcp.plan.layer_memory.describe`), the token cap, recompute, the largest degree, long sequences.
    ``pipelined``: the model has pipeline stages (whose plans are lockstep slots)."""
    from megatron_dcp.plan.hardware import AUTO, PRESETS
    from megatron_dcp.plan.layer_memory import describe
    from megatron_dcp.plan.schedule import schedule_for
    from megatron_dcp.plan.units import size_text

    memory, chosen = cost_model.memory_model, str(config.hardware)
    source = ("detected" if chosen.lower() == AUTO else "preset" if chosen in PRESETS
              else f"profile {chosen}")
    plain, full = memory.max_tokens(1, 0), memory.max_tokens(1, memory.num_layers)
    schedule = schedule_for(config.schedule, cost_model.zero_stage,
                            getattr(cost_model.model, "expert_dcp_ranks", 1))
    if pipelined:  # make_plan plans a pipelined model in lockstep slots
        schedule = "lockstep (pipeline stages)"
    parts = [f"policy {config.policy}", f"schedule {schedule}",
             f"DCP world {world_size} ranks", f"hardware {cost_model.hw.name} ({source})",
             f"memory budget {size_text(memory.budget)} per rank (static "
             f"{size_text(memory.static_memory)}, reserve {size_text(memory.reserve)}): a "
             f"degree-1 task holds {plain} tokens, {full} with every layer recomputed",
             describe(cost_model.model)]
    if config.max_tokens_per_rank is not None:
        parts.append(f"at most {config.max_tokens_per_rank} tokens per rank")
    parts += [f"recompute {config.recompute}",
              f"max degree {config.max_degree or world_size}",
              f"long sequences {config.long_sequences}"]
    return "DCP: " + ", ".join(parts)
