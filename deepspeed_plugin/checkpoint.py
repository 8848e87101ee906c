"""DeepSpeed checkpoints of a `DCPEngine`: atomic saves, verified loads, another world size.

* ``save``: DeepSpeed writes every rank's files into a staging directory, through a checkpoint
  engine that checksums each file as it is written (`ChecksummingEngine`, over DeepSpeed's
  ``TorchCheckpointEngine``); the checkpoint and ``latest`` appear only after every rank
  confirmed (`megatron_dcp.runtime.checkpoint_dir`).
* ``load``: the checkpoint is verified on every rank first (manifest, every file's size and
  checksum; a corrupt ``latest`` falls back to the newest checkpoint that verifies:
  `megatron_dcp.runtime.checkpoint_verify`).
  Saved at the same world size and ZeRO stage, DeepSpeed loads it as usual. Saved at another
  world size (or ZeRO 1 <-> 2) with ZeRO 1-3, whose optimizer states are partitioned by rank, it is
  converted once to DeepSpeed's *universal* checkpoint (``ds_to_universal``: one file per
  parameter and state, independent of the partitioning; written beside it as ``TAG.universal``,
  atomically) and loaded from there. ZeRO 0 keeps whole optimizer states and loads at any world
  size directly. DCP's update does not depend on the plan, so the resumed run continues the
  trajectory of the run that saved (elastic training). A change between ZeRO 3 and ZeRO 1 or 2,
  or to or from ZeRO 0, is refused at start naming both stages (`stage_change_refused`).

Loading runs no code from a crafted file as far as a check can see to it: before DeepSpeed
reads anything, every ``.pt`` file is read with ``weights_only=True`` (tensors, plain types and
DeepSpeed's own state classes: `check_files`); a file that asks for anything else is refused
naming it and the class. DeepSpeed's loader then unpickles the files fully
(``torch.load(weights_only=False)``, which it needs; rank 0 says so at every load), so a file
replaced between the check and the load would still run its code: only load checkpoints you
trust. The checksums catch corruption, not a crafted file.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

import torch.distributed as dist

from megatron_dcp.runtime.checkpoint_dir import (CheckpointError, read_manifest,
                                                 save_atomically, save_file)
from megatron_dcp.runtime.checkpoint_verify import verify_checkpoint

UNIVERSAL = ".universal"


class ChecksummingEngine:
    """DeepSpeed's ``TorchCheckpointEngine`` whose ``save`` checksums each file while writing
    it (`save_file`); everything else is the wrapped engine's. ``checksums``: path -> checksum
    of the files saved through it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.checksums: dict[str, str] = {}

    def save(self, state_dict: Any, path: str) -> None:
        """``torch.save`` as DeepSpeed's engine does it, through the checksumming writer."""
        self.checksums[path] = save_file(
            state_dict, path, _use_new_zipfile_serialization=self.inner.zipfile_serialization)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def save(engine: Any, save_dir: str, tag: str, client_state: dict, *,
         keep_last: Optional[int] = None, verified: bool = True, **kwargs: Any) -> str:
    """Collective: DeepSpeed's ``save_checkpoint`` of ``engine`` (a `DCPEngine`) made atomic,
    every file checksummed while written (with DeepSpeed's torch checkpoint engine; with another
    one, rank 0 reads the files back to checksum them); ``verified``: see `save_atomically`.
    Returns the checkpoint's path."""
    import deepspeed
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    ds = engine.deepspeed

    def write(staging: str) -> dict[str, str]:
        own = ds.checkpoint_engine
        hashing = ChecksummingEngine(own) if type(own) is TorchCheckpointEngine else None
        ds.checkpoint_engine = hashing or own
        try:
            ds.save_checkpoint(save_dir, tag=staging, client_state=client_state,
                               save_latest=False, **kwargs)
        finally:
            ds.checkpoint_engine = own
        return hashing.checksums if hashing is not None else {}

    meta = {"world_size": engine.world_size, "zero_stage": engine.zero_stage,
            "iteration": engine.iteration, "deepspeed": deepspeed.__version__}
    return save_atomically(save_dir, tag, write, meta=meta, keep_last=keep_last,
                           verified=verified)


def load(engine: Any, load_dir: str, tag: Optional[str] = None,
         **kwargs: Any) -> tuple[str, dict]:
    """Collective: verify, then load into ``engine`` (a `DCPEngine`), converting to a universal
    checkpoint when the world size or ZeRO stage differs; returns ``(path, client_state)``."""
    tag, manifest = verify_checkpoint(load_dir, tag)
    saved_world, saved_stage = int(manifest["world_size"]), int(manifest["zero_stage"])
    refused = stage_change_refused(saved_stage, engine.zero_stage)
    if refused:
        raise CheckpointError(f"checkpoint {os.path.join(load_dir, tag)} {refused}")
    check_files(os.path.join(load_dir, tag), manifest)  # before anything unpickles them
    if engine.rank == 0:
        print(f"loading {os.path.join(load_dir, tag)}: {FULL_UNPICKLE}", file=sys.stderr,
              flush=True)
    universal = saved_stage > 0 and (saved_world, saved_stage) != (engine.world_size,
                                                                    engine.zero_stage)
    if universal:
        tag = _universal(load_dir, tag, manifest)
    ds = engine.deepspeed
    previous = ds._config.load_universal_checkpoint
    ds._config.load_universal_checkpoint = universal
    try:
        path, client_state = ds.load_checkpoint(load_dir, tag=tag, **kwargs)
    finally:
        ds._config.load_universal_checkpoint = previous
    if path is None:
        raise CheckpointError(f"DeepSpeed found nothing to load in {os.path.join(load_dir, tag)}")
    return path, client_state or {}


FULL_UNPICKLE = ("every file was first read with weights_only=True (tensors, plain types and "
                 "DeepSpeed's own state classes), then DeepSpeed's loader unpickles them fully "
                 "(torch.load with weights_only=False): a file replaced between the two reads "
                 "would run its code, so load only checkpoints you trust")


def deepspeed_safe_globals() -> list:
    """The classes DeepSpeed 0.19's checkpoint files hold besides tensors and plain types: its
    loss scalers, the ZeRO stage enum and the fragment addresses of ZeRO 1/2's optimizer
    state."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def check_files(path: str, manifest: dict) -> None:
    """Collective: every ``.pt`` file of the checkpoint ``path`` (those in its manifest) read
    with ``weights_only=True`` and `deepspeed_safe_globals` (memory-mapped: the tensors' bytes
    are not read), the files shared out over the ranks; a file that asks for anything else is
    an `UnsafeCheckpointError` on every rank naming the file and the class, before DeepSpeed's
    loader (which unpickles fully) or its universal converter reads anything."""
    from megatron_dcp.runtime.checkpoint_verify import agree
    from megatron_dcp.runtime.safe_load import load_weights

    allowed = deepspeed_safe_globals()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    names = sorted(n for n in manifest.get("files", {}) if n.endswith(".pt"))
    problem = ""
    for name in names[rank::world]:
        file = os.path.join(path, name)
        try:
            try:
                load_weights(file, safe_globals=allowed, mmap=True)
            except CheckpointError as err:
                if "mmap" not in str(err) and "zip" not in str(err):
                    raise
                load_weights(file, safe_globals=allowed)  # the legacy format maps nothing
        except CheckpointError as err:
            problem = str(err)
            break
        except OSError as err:  # raised on every rank alike by agree, not on this one alone
            problem = f"{file}: {type(err).__name__}: {err}"
            break
    agree(problem)


def stage_change_refused(saved: int, now: int) -> str:
    """Why a checkpoint saved at ZeRO ``saved`` cannot load at ZeRO ``now`` (``""``: it can).
    ZeRO 0 keeps whole optimizer states, 1-3 partition them: 0 loads only at 0. Between 1 and 2
    the universal checkpoint carries the states exactly; between 3 and 1 or 2 DeepSpeed's
    universal loader fails (an AssertionError in its state_dict_factory, DeepSpeed 0.19), so
    that is refused here, before anything is converted or loaded."""
    if saved == now:
        return ""
    fix = f"resume with --zero-stage {saved} (the stage it was saved at)"
    if 0 in (saved, now):
        return (f"was saved at ZeRO {saved}; this run uses ZeRO {now}: ZeRO 0 checkpoints "
                f"load only at ZeRO 0, and ZeRO 1-3 ones only at ZeRO 1-3: {fix}")
    if 3 in (saved, now):
        return (f"was saved at ZeRO {saved}; this run uses ZeRO {now}: DeepSpeed's universal "
                "checkpoint does not load between ZeRO 3 and ZeRO 1 or 2 (ZeRO 1 <-> 2 "
                f"works): {fix}")
    return ""


def _universal(load_dir: str, tag: str, manifest: dict) -> str:
    """Collective: the tag of the universal conversion of ``tag`` (made now by rank 0 unless a
    complete one exists; an existing one is verified like any checkpoint). Its files, written
    by DeepSpeed's converter, are checksummed by reading them back once."""
    target = tag + UNIVERSAL
    if read_manifest(os.path.join(load_dir, target)) is not None:
        try:
            _, converted = verify_checkpoint(load_dir, target)
            check_files(os.path.join(load_dir, target), converted)
        except CheckpointError as err:
            raise CheckpointError(f"{err}\n(delete {os.path.join(load_dir, target)} to convert "
                                  f"{tag} again)") from None
    else:
        rank = dist.get_rank()

        def convert(staging: str) -> None:
            if rank == 0:
                to_universal(os.path.join(load_dir, tag), os.path.join(load_dir, staging))

        meta = {key: manifest[key] for key in ("world_size", "zero_stage", "iteration")
                if key in manifest}
        save_atomically(load_dir, target, convert, meta={**meta, "universal_of": tag},
                        move_latest=False)
    return target


def to_universal(checkpoint: str, output: str) -> None:
    """Convert one DeepSpeed checkpoint directory (ZeRO 1-3) into a universal one, in this
    process (DeepSpeed's ``ds_to_universal`` without worker processes)."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=checkpoint, output_folder=output,
                              num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=True)
    ds_to_universal.main(args)
    # the converter also points PARENT/latest_universal at its output folder (here a staging
    # directory that is renamed next): nothing may name a partial directory
    pointer = os.path.join(os.path.dirname(os.path.normpath(output)), "latest_universal")
    try:
        with open(pointer) as handle:
            stale = handle.read().strip() == os.path.basename(os.path.normpath(output))
        if stale:
            os.remove(pointer)
    except FileNotFoundError:
        pass
