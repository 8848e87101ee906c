"""Megatron-LM's checkpoints under the launcher's ``--dcp``: the planner's state beside them
(`PlannerCheckpoint`), nothing run from a file on ``--load`` (`check_load`), and no ``--save``
taking over another run's checkpoints (`save_takeover_problem`).

Megatron-LM unpickles what it loads (torch.distributed.checkpoint's ``.metadata`` with a plain
``pickle.load``, its byte items and legacy ``.pt`` files with ``weights_only=False`` or
Megatron-LM's own safe globals): a crafted file runs code. `check_load` reads every pickle of the
checkpoint folder Megatron-LM is about to load first, on every rank, the way
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
from typing import Any, Callable, Optional

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


def folder_to_load(root: str, ckpt_step: Optional[int] = None) -> Optional[str]:
    """The checkpoint folder Megatron-LM's ``load_checkpoint`` will read from ``--load root``
    (``--ckpt-step``, else the tracker file's iteration or ``release``; a folder that is itself
    a checkpoint), or None when there is none (Megatron-LM then starts afresh)."""
    from megatron.training.checkpointing import get_checkpoint_name

    if ckpt_step is not None:
        return get_checkpoint_name(root, int(ckpt_step), return_base_dir=True)
    tracker = os.path.join(root, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        if text == "release":
            return get_checkpoint_name(root, 0, release=True, return_base_dir=True)
        if text.isdigit():
            return get_checkpoint_name(root, int(text), return_base_dir=True)
        return None  # Megatron-LM names the bad tracker itself
    is_checkpoint = any(os.path.exists(os.path.join(root, n)) for n in (".metadata",
                                                                         "metadata.json"))
    return root if is_checkpoint else None


def check_load(root: str, ckpt_step: Optional[int] = None) -> None:
    """Collective: every pickle of the folder `folder_to_load` names read without running
    anything (`check_folder` with `megatron_lm_globals`), on every rank; a refusal raises on
    every rank (`agree`) before Megatron-LM reads a byte."""
    from megatron_dcp.runtime.checkpoint_dir import CheckpointError

    folder = folder_to_load(root, ckpt_step)
    problem = ""
    if folder is not None and os.path.isdir(folder):
        try:  # a crafted file (UnsafeCheckpointError) or one that is no pickle at all
            check_folder(folder, megatron_lm_globals)
        except (CheckpointError, OSError) as err:
            problem = f"--load {root}: {err}"
    agree(problem)


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
    torch.distributed starts) after `check_load` of the folder it reads, under ``--dcp``."""
    @functools.wraps(load_args_from_checkpoint)
    def run(args: Any, load_arg: str = "load", *rest: Any, **kwargs: Any):
        where = getattr(args, load_arg, None)
        if args.dcp and where:
            check_load(where, getattr(args, "ckpt_step", None) if load_arg == "load" else None)
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

    def wrap_save(self, save_checkpoint: Callable) -> Callable:
        @functools.wraps(save_checkpoint)
        def run(iteration, *args: Any, **kwargs: Any):
            import torch.distributed as dist
            from megatron.training import get_args

            out = save_checkpoint(iteration, *args, **kwargs)
            margs = get_args()
            # rank 0 alone: only a driver already built (building one is collective)
            planned = self.step is not None and self.step.step.started
            if planned and margs.save and dist.get_rank() == 0:
                folder = _iteration_folder(margs.save, iteration)
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
            where = getattr(margs, kwargs.get("load_arg", "load"), None)
            if getattr(margs, "dcp", False) and where:
                step = getattr(margs, "ckpt_step", None)
                step = step if kwargs.get("load_arg", "load") == "load" else None
                check_load(where, step)
                model = args[0] if args else kwargs.get("ddp_model")
                problem = ""
                try:  # every rank alike (agree): a tensor of another shape than saved
                    problem = layout_problem(folder_to_load(where, step), model, margs)
                except Exception as err:  # noqa: BLE001 - raised on every rank by agree
                    problem = f"--load {where}: {type(err).__name__}: {err}"
                agree(problem)
            out = _exit_status_kept(load_checkpoint, where, *args, **kwargs)
            iteration = out[0] if isinstance(out, tuple) else None
            if getattr(margs, "dcp", False) and where and iteration:
                path = os.path.join(_iteration_folder(where, iteration), PLANNER_FILE)
                if os.path.exists(path):
                    self.loaded = read_planner_state(path)
            return out

        return run


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
        raise SystemExit(f"[dcp] Megatron-LM's load_checkpoint of --load {where} exited "
                         "without loading (its message is above): stopped with status 1, "
                         "not 0") from None


def read_planner_state(path: str) -> Optional[dict]:
    """The planner's state in ``path`` (`PLANNER_FILE`), or None, said on stderr naming the file,
    when it is unreadable or not a state (a truncated write): the planner then starts afresh and
    the checkpoint itself still loads."""
    import sys

    try:
        with open(path) as f:
            state = json.load(f)
        if isinstance(state, dict):
            return state
        why = f"holds a {type(state).__name__}, not the planner's state"
    except (OSError, ValueError) as err:
        why = f"is unreadable ({type(err).__name__}: {err})"
    print(f"[dcp] {path} {why}: the planner starts afresh (its iteration and calibrated "
          "hardware are not restored); the checkpoint itself loads", file=sys.stderr, flush=True)
    return None


def _iteration_folder(root: str, iteration: int) -> str:
    from megatron.training.checkpointing import get_checkpoint_name

    return get_checkpoint_name(root, iteration, return_base_dir=True)
