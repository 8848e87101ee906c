"""Megatron-LM's checkpoints under the launcher's ``--dcp``: the planner's state beside them
(`PlannerCheckpoint`), nothing run from a file Megatron-LM loads (`check_sources`), no tensor of
another shape loaded (`layout_problem`), and no ``--save`` taking over another run's checkpoints
(`save_takeover_problem`).

Megatron-LM unpickles what it loads (torch.distributed.checkpoint's ``.metadata`` with a plain
``pickle.load``, its byte items and legacy ``.pt`` files with ``weights_only=False`` or
Megatron-LM's own safe globals): a crafted file runs code. `load_sources` names every folder
Megatron-LM's loaders read, whichever flag chose it (``--load``, ``--pretrained-checkpoint``,
``--ckpt-step``, a newer ``--non-persistent-ckpt-type global`` checkpoint, ``release``), and
`check_sources` reads every pickle of those folders first, on every rank, the way
`megatron_dcp.runtime.safe_load` reads the examples' checkpoints, admitting beside tensors only
what a Megatron-LM checkpoint holds (`megatron_lm_globals`); a refusal stops every rank before
Megatron-LM reads anything.
"""

from __future__ import annotations

import enum
import functools
import importlib
import json
import os
from typing import Any, Callable, NamedTuple, Optional

from megatron_dcp.runtime.checkpoint_verify import agree
from megatron_dcp.runtime.safe_load import check_folder

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron-LM's file naming the newest iteration of a ``--save`` directory."""

_PLAIN_GLOBALS = {"argparse.Namespace", "signal.Signals", "numpy.ndarray", "numpy.dtype",
                  "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct",
                  "_codecs.encode"}


def megatron_lm_globals(names: list) -> list:
    """Of the globals a file names, those a Megatron-LM checkpoint holds: its arguments
    (``argparse.Namespace``), the enums of megatron-core and Megatron-LM (attention backend,
    rerun state machine), numpy arrays and dtypes (RNG states), ``signal.Signals``. Anything
    else stays refused (`megatron_dcp.runtime.safe_load.load_weights` names it)."""
    out = []
    for name in names:
        module, _, attr = str(name).rpartition(".")
        plain = name in _PLAIN_GLOBALS or module == "numpy.dtypes"
        if not (plain or module.startswith(("megatron.core.", "megatron.training."))):
            continue
        try:
            found = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
        if plain or (isinstance(found, type) and issubclass(found, enum.Enum)):
            out.append(found)
    return out


class LoadSource(NamedTuple):
    """A checkpoint folder Megatron-LM's loaders read, and the flag that chose it."""

    flag: str
    """The flag and its directory as the user gave them (``--pretrained-checkpoint DIR``), or
    ``--non-persistent-ckpt-type global (DIR)`` for a non-persistent checkpoint."""
    folder: str
    """The iteration folder read (``DIR/iter_NNNNNNN`` or ``DIR/release``)."""


def _tracked(root: str) -> tuple[int, bool]:
    """``(iteration, release)`` of ``root``'s tracker file as Megatron-LM's ``read_metadata``
    parses it, ``(-1, False)`` where it loads nothing from it (no file, or text it exits on).
    Its own function cannot be called here: it all-reduces on a CUDA tensor once
    torch.distributed runs, and ``sys.exit()``s on a bad file."""
    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    tracker = get_checkpoint_tracker_filename(root)
    if not os.path.isfile(tracker):
        return -1, False
    with open(tracker) as f:
        text = f.read().strip()
    try:
        iteration = int(text)
    except ValueError:
        return (0, True) if text == "release" else (-1, False)
    return (iteration, False) if iteration > -1 else (-1, False)


def base_sources(load_dir: Optional[str], flag: str, args: Any) -> list[LoadSource]:
    """The folder Megatron-LM's ``_load_base_checkpoint(load_dir, args)`` reads (its choice
    mirrored: a ``--non-persistent-ckpt-type global`` checkpoint at least as new as the
    persistent one first, in ``--non-persistent-global-ckpt-dir`` or ``load_dir/non_persistent``;
    else ``--ckpt-step`` or the tracker's iteration or ``release`` of ``load_dir``), or none.
    ``flag``: the flag that named ``load_dir``. ``local`` non-persistent checkpoints are refused
    under ``--dcp`` at start (`non_persistent_local_problem`)."""
    from megatron.training import checkpointing

    given = getattr(args, "non_persistent_global_ckpt_dir", None)
    np_dir = given if given or load_dir is None else os.path.join(
        load_dir, checkpointing._NON_PERSISTENT_CKPT_SUBDIR)
    np_iteration = -1
    if getattr(args, "non_persistent_ckpt_type", None) == "global" and np_dir:
        np_iteration, np_release = _tracked(np_dir)
        np_iteration = -1 if np_release else np_iteration  # Megatron-LM raises: nothing read
    iteration, release = _tracked(load_dir) if load_dir is not None else (-1, False)
    if getattr(args, "ckpt_step", None):  # truthy, as Megatron-LM tests it
        iteration = args.ckpt_step
    if np_iteration != -1 and np_iteration >= iteration:
        return [LoadSource(f"--non-persistent-ckpt-type global ({np_dir})",
                           checkpointing.get_checkpoint_name(np_dir, np_iteration,
                                                             return_base_dir=True))]
    if iteration == -1 or load_dir is None:
        return []
    return [LoadSource(f"{flag} {load_dir}", checkpointing.get_checkpoint_name(
        load_dir, iteration, release, return_base_dir=True))]


def load_sources(args: Any, load_arg: str = "load") -> list[LoadSource]:
    """Every checkpoint folder Megatron-LM's ``load_checkpoint(..., load_arg=load_arg)`` reads
    with these ``args``, and the flag that chose it: ``--load`` (``load_arg``), or
    ``--pretrained-checkpoint`` where that has no tracker file, each through `base_sources`
    (non-persistent checkpoints, ``--ckpt-step``, release folders); with ``--ckpt-format
    fsdp_dtensor`` also the ``--load`` folder whose ``.metadata`` it reads
    (``get_load_checkpoint_path_by_args``). ``--finetune`` changes what is loaded of the folder
    (no optimizer, RNG, iteration), not which folder. Megatron-LM's own helpers name the files
    (tracker, iteration folders, ``non_persistent``) so the choice follows its layout."""
    from megatron.training.checkpointing import checkpoint_exists, get_checkpoint_name

    load_dir = getattr(args, load_arg, None)
    flag = "--" + load_arg.replace("_", "-")
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if pretrained is not None and not checkpoint_exists(load_dir):
        if not checkpoint_exists(pretrained):
            return []  # Megatron-LM raises FileNotFoundError before reading anything
        load_dir, flag = pretrained, "--pretrained-checkpoint"
    sources = base_sources(load_dir, flag, args)
    if getattr(args, "ckpt_format", None) == "fsdp_dtensor" and getattr(args, "load", None):
        iteration, release = _tracked(args.load)
        if getattr(args, "ckpt_step", None):
            iteration = args.ckpt_step
        folder = get_checkpoint_name(args.load, iteration, release, return_base_dir=True)
        if iteration != -1 and all(s.folder != folder for s in sources):
            sources.append(LoadSource(f"--load {args.load}", folder))
    return sources


def check_sources(sources: list[LoadSource]) -> None:
    """Collective: every pickle of every folder of ``sources`` read without running anything
    (`check_folder` with `megatron_lm_globals`), on every rank; a refusal names the flag and the
    file and raises on every rank (`agree`) before Megatron-LM reads a byte."""
    from megatron_dcp.runtime.checkpoint_dir import CheckpointError

    problem = ""
    for source in sources:
        if not problem and os.path.isdir(source.folder):
            try:  # a crafted file (UnsafeCheckpointError) or one that is no pickle at all
                check_folder(source.folder, megatron_lm_globals)
            except (CheckpointError, OSError) as err:
                problem = f"{source.flag}: {err}"
    agree(problem)


def non_persistent_local_problem(args: Any) -> str:
    """Why ``--non-persistent-ckpt-type local`` cannot run under ``--dcp``, or ``""``: its
    checkpoints are nvidia-resiliency-ext's per-rank files, which its manager loads and the
    load gate (`check_sources`) cannot read first (Megatron-LM itself needs the package, which
    only GPU machines have)."""
    if getattr(args, "non_persistent_ckpt_type", None) != "local":
        return ""
    return ("--non-persistent-ckpt-type local: DCP's load gate cannot check nvidia-resiliency-"
            "ext's local checkpoints before they are unpickled; use --non-persistent-ckpt-type "
            "global (checked like --load), or run without --dcp")


def layout_problem(folder: Optional[str], model: Any, args: Any) -> str:
    """Why this run's model cannot load the torch_dist checkpoint ``folder`` (a model tensor
    whose global shape differs from the saved one: megatron-core would load the overlapping
    part of one it marks ``allow_shape_mismatch``, the padded vocabulary rows after a change of
    tensor parallelism among them, and keep the rest as initialised: another model), or
    ``""`` (also for other formats, which refuse a layout change themselves)."""
    from megatron.core.utils import unwrap_model

    from megatron_dcp.megatron.checkpointing import saved_shapes, shape_problem

    if folder is None or not os.path.isfile(os.path.join(folder, ".metadata")):
        return ""
    chunks = unwrap_model(model if isinstance(model, list) else [model])
    sharded = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
    return shape_problem(folder, sharded, saved_shapes(folder), vocab_size(args),
                         getattr(args, "make_vocab_size_divisible_by", None),
                         int(args.tensor_model_parallel_size))


def vocab_size(args: Any) -> int:
    """The tokenizer's vocabulary (Megatron-LM's ``get_tokenizer()``), else the padded one."""
    try:
        from megatron.training import get_tokenizer

        return int(get_tokenizer().vocab_size)
    except Exception:  # noqa: BLE001 - no tokenizer built (a script of its own): the rows
        return int(args.padded_vocab_size)


def gated_load_args(load_args_from_checkpoint: Callable) -> Callable:
    """Megatron-LM's ``load_args_from_checkpoint`` (``--use-checkpoint-args``, before
    torch.distributed starts, once for ``--pretrained-checkpoint`` and once for ``--load``)
    after `check_sources` of the folder it reads (`base_sources`), under ``--dcp``."""
    @functools.wraps(load_args_from_checkpoint)
    def run(args: Any, load_arg: str = "load", *rest: Any, **kwargs: Any):
        where = getattr(args, load_arg, None)
        if getattr(args, "dcp", False) and where is not None:
            check_sources(base_sources(where, "--" + load_arg.replace("_", "-"), args))
        return load_args_from_checkpoint(args, load_arg, *rest, **kwargs)

    return run


def save_takeover_problem(save: Optional[str], load: Optional[str],
                          ckpt_step: Optional[int] = None) -> str:
    """Why ``--save save`` would take over checkpoints this run does not resume, or ``""``:
    ``save`` holds Megatron-LM checkpoints (its tracker file or ``iter_*`` folders) and this run
    does not ``--load`` that directory, or loads an older ``--ckpt-step`` than its newest. A
    save there would replace a checkpoint of the same iteration and move the tracker back, and
    the next ``--load`` would resume a mix of two runs. A ``save`` that is, or lies inside,
    a checkpoint folder (an ``iter_*`` folder beside a tracker file, one holding ``.metadata``,
    a manifest or the planner's state: `inside_checkpoint_problem`) is refused too: its saves
    would land inside that checkpoint."""
    from megatron_dcp.runtime.checkpoint_dir import inside_checkpoint_problem

    inside = inside_checkpoint_problem(save, trackers=(TRACKER,)) if save else ""
    if inside:
        return inside
    if not save or not os.path.isdir(save):
        return ""
    iterations = sorted(int(n[5:]) for n in os.listdir(save)
                        if n.startswith("iter_") and n[5:].isdigit())
    tracked = os.path.isfile(os.path.join(save, TRACKER))
    if not iterations and not tracked:
        return ""
    held = (f"iterations {', '.join(map(str, iterations[-3:]))}" if iterations
            else "no iteration folder") + (f", {TRACKER}" if tracked else "")
    if load is None or os.path.realpath(load) != os.path.realpath(save):
        return (f"--save {save} holds another run's checkpoints ({held}): a save there would "
                f"replace them and move {TRACKER}. Resume that run with --load {save}, or "
                "give --save another directory")
    newer = [i for i in iterations if ckpt_step is not None and i > int(ckpt_step)]
    if newer:
        return (f"--ckpt-step {ckpt_step} resumes an older checkpoint than --save {save} holds "
                f"(iterations {', '.join(map(str, newer[-3:]))}): this run's saves would mix "
                "with them. Give --save another directory")
    return ""


PLANNER_FILE = "dcp_planner.json"
"""The planner's state (`StepDriver.state_dict`: its iteration, the calibrated hardware) in the
folder of each checkpoint Megatron-LM's ``--save`` writes (``iter_NNNNNNN/``)."""


class PlannerCheckpoint:
    """The planner's state beside Megatron-LM's own checkpoints: after Megatron-LM's
    ``save_checkpoint`` returns, rank 0 writes `PLANNER_FILE` into the iteration's folder (JSON,
    written to a temporary name and renamed); after ``load_checkpoint``, every rank reads the
    loaded iteration's file, and the step restores it before its first plan. A checkpoint
    without the file (saved without ``--dcp``) starts the planner afresh."""

    def __init__(self) -> None:
        self.step: Any = None  # the launcher's LMForwardBackward (lm.py imports this module)
        self.loaded: Optional[dict] = None
        self.learning_rate: Optional[float] = None  # the optimizer's at this train_step

    def wrap_save(self, save_checkpoint: Callable) -> Callable:
        @functools.wraps(save_checkpoint)
        def run(iteration, *args: Any, **kwargs: Any):
            import torch.distributed as dist
            from megatron.training import get_args

            out = save_checkpoint(iteration, *args, **kwargs)
            margs = get_args()
            # rank 0 alone: only a driver already built (building one is collective)
            planned = self.step is not None and self.step.step.started
            folder = _saved_folder(margs, iteration, **kwargs)
            if planned and folder and dist.get_rank() == 0:
                os.makedirs(folder, exist_ok=True)
                target = os.path.join(folder, PLANNER_FILE)
                with open(target + ".tmp", "w") as f:
                    json.dump(self.step.step.driver.state_dict(), f)
                os.replace(target + ".tmp", target)
            return out

        return run

    def wrap_load(self, load_checkpoint: Callable) -> Callable:
        @functools.wraps(load_checkpoint)
        def run(*args: Any, **kwargs: Any):
            from megatron.training import get_args

            margs = get_args()
            load_arg = kwargs.get("load_arg", args[3] if len(args) > 3 else "load")
            dcp = getattr(margs, "dcp", False)
            sources = load_sources(margs, load_arg) if dcp else []
            if dcp:  # on every rank: the gate, then the shapes, each one collective
                check_sources(sources)
                agree(_layout_problems(sources, args[0] if args else kwargs.get("ddp_model"),
                                       margs))
            where = sources[0].flag if sources else f"--{load_arg.replace('_', '-')} " \
                f"{getattr(margs, load_arg, None)}"
            out = _exit_status_kept(load_checkpoint, where, *args, **kwargs)
            iteration = out[0] if isinstance(out, tuple) else None
            if sources and iteration:
                path = os.path.join(sources[0].folder, PLANNER_FILE)
                if os.path.exists(path):
                    self.loaded = read_planner_state(path)
            return out

        return run


def _layout_problems(sources: list[LoadSource], model: Any, args: Any) -> str:
    """`layout_problem` of the first of ``sources`` whose tensors this run's model cannot load,
    naming its flag, or ``""``."""
    for source in sources:
        try:  # every rank alike (agree): a tensor of another shape than saved
            problem = layout_problem(source.folder, model, args)
        except Exception as err:  # noqa: BLE001 - raised on every rank by agree
            problem = f"{type(err).__name__}: {err}"
        if problem:
            return f"{source.flag}: {problem}"
    return ""


def _exit_status_kept(load_checkpoint: Callable, where: Optional[str], *args: Any,
                      **kwargs: Any) -> Any:
    """Megatron-LM's ``load_checkpoint``, whose ``sys.exit()`` (status 0) on a checkpoint it
    cannot load (a bad tracker file, an RNG state it cannot restore, a failed legacy load,
    ``--exit-on-missing-checkpoint``) becomes status 1: a resume that did not load never
    reads as a success to the script that started it."""
    try:
        return load_checkpoint(*args, **kwargs)
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
        raise SystemExit(f"[dcp] Megatron-LM's load_checkpoint of {where} exited "
                         "without loading (its message is above): stopped with status 1, "
                         "not 0") from None


def read_planner_state(path: str) -> Optional[dict]:
    """The planner's state in ``path`` (`PLANNER_FILE`), or None, said on stderr naming the file,
    when it is unreadable or not a state (a truncated write, JSON of other types: an iteration
    that is no count, a hardware the profile reader refuses): the planner then starts afresh and
    the checkpoint itself still loads. Read as JSON only, its types checked here, so that
    nothing of it fails later, at the first step."""
    import sys

    from megatron_dcp.plan.hardware import HardwareError, hardware_from_dict

    try:
        with open(path) as f:
            state = json.load(f)
        why = _planner_state_problem(state)
    except (OSError, ValueError, RecursionError) as err:
        why = f"is unreadable ({type(err).__name__}: {err})"
    if not why and state.get("hardware") is not None:
        try:  # what load_state_dict builds from it
            hardware_from_dict(dict(state["hardware"]), where="its 'hardware'")
        except HardwareError as err:
            why = f"holds a hardware profile the planner refuses ({err})"
    if not why:
        return state
    print(f"[dcp] {path} {why}: the planner starts afresh (its iteration and calibrated "
          "hardware are not restored); the checkpoint itself loads", file=sys.stderr, flush=True)
    return None


def _planner_state_problem(state: Any) -> str:
    """Why JSON ``state`` is not `StepDriver.state_dict`'s form, or ``""``."""
    if not isinstance(state, dict):
        return f"holds a {type(state).__name__}, not the planner's state"
    iteration = state.get("iteration", 0)
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        return f"has iteration {iteration!r}, not a count of steps"
    hardware = state.get("hardware")
    if hardware is not None and not isinstance(hardware, dict):
        return f"has hardware {type(hardware).__name__}, not a profile object"
    return ""


def _saved_folder(args: Any, iteration: int, non_persistent_ckpt: bool = False,
                  release: bool = False, **_: Any) -> Optional[str]:
    """The folder Megatron-LM's ``save_checkpoint`` just wrote (a ``global`` non-persistent
    save goes to ``--non-persistent-global-ckpt-dir`` or ``--save``'s ``non_persistent/``, where
    `load_sources` finds it), or None (no ``--save``; a ``local`` one is not a folder)."""
    from megatron.training import checkpointing

    root = args.save
    if non_persistent_ckpt:
        if args.non_persistent_ckpt_type != "global":
            return None
        root = args.non_persistent_global_ckpt_dir or (
            root and os.path.join(root, checkpointing._NON_PERSISTENT_CKPT_SUBDIR))
    if not root:
        return None
    return checkpointing.get_checkpoint_name(root, iteration, release, return_base_dir=True)
