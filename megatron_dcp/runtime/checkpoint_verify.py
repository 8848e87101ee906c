"""Before a checkpoint is loaded: every file present, of its size and checksum, on every rank.

* `verify_checkpoint` (collective): resolve ``latest`` (a tag inside ``SAVE_DIR`` only,
  `megatron_dcp.runtime.checkpoint_dir.read_latest`) or the tag given, check the manifest,
  every file's presence and size on every rank and every file's checksum (the files shared out
  over the ranks), before the engine's loader reads anything. A checkpoint that fails names the
  file; loading ``latest``, the newest older checkpoint that verifies is loaded instead, saying
  so.
* `agree` (collective): an engine's own pre-checks of a load raise on every rank alike, so that
  no rank starts loading alone.
* `split_load_path`: ``--load`` names a checkpoint directory or one checkpoint in it.
* `takeover_problem`: at start, a ``--save`` directory holding another run's checkpoints (or
  newer ones than the checkpoint this run resumes from) is refused, so that no save replaces,
  prunes or re-points another run's work.

The directory format (manifest, ``latest``, checksums) is `megatron_dcp.runtime.checkpoint_dir`'s.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from megatron_dcp.runtime.checkpoint_dir import (LATEST, MANIFEST, CheckpointError,
                                                 complete_checkpoints, failures, file_checksum,
                                                 files_under, gather, group_rank, group_size,
                                                 primary_checkpoints, read_latest, read_manifest)

__all__ = ["agree", "split_load_path", "takeover_problem", "verify_checkpoint"]


def agree(problem: str, group: Any = None) -> None:
    """Collective: raise `CheckpointError` on every rank when any rank found a ``problem``
    (one text per rank, ``""`` for none): the same text when every rank found the same one,
    else each rank's, so that no rank goes on loading alone."""
    failed = failures(gather(problem, group))
    if not failed:
        return
    texts = set(failed.values())
    if len(texts) == 1:
        raise CheckpointError(texts.pop())
    raise CheckpointError("\n  ".join(["cannot load the checkpoint:"] + [
        f"rank {r}: {text}" for r, text in failed.items()]))


def split_load_path(path: str) -> tuple[str, Optional[str]]:
    """``--load`` takes a checkpoint directory (its ``latest`` is loaded) or one checkpoint in
    it: ``(load_dir, tag)``."""
    path = os.path.normpath(path)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return os.path.dirname(path), os.path.basename(path)
    return path, None


def takeover_problem(save_dir: Optional[str], load: Optional[str]) -> str:
    """Why saving into ``save_dir`` would take over checkpoints this run did not come from, or
    ``""``: ``save_dir`` holds checkpoints (or a ``latest``) and this run does not ``load``
    from that directory, or it loads an older checkpoint there than the newest one in it. A
    save would replace a checkpoint of the same iteration, prune the others and point
    ``latest`` at this run's, and the next ``--load`` would resume a mix."""
    if not save_dir or not os.path.isdir(save_dir):
        return ""
    found = [tag for tag, _ in primary_checkpoints(complete_checkpoints(save_dir))]
    try:
        latest = read_latest(save_dir)
    except CheckpointError as err:
        return f"--save {save_dir}: {err}"
    if not found and latest is None:
        return ""
    shown = ", ".join(found[-3:]) + (f" and {len(found) - 3} older" if len(found) > 3 else "")
    held = f"{shown or 'no complete checkpoint'}; {LATEST}: {latest}"
    if load is None or os.path.realpath(split_load_path(load)[0]) != \
            os.path.realpath(save_dir):
        return (f"--save {save_dir} holds another run's checkpoints ({held}): a save there "
                f"would replace or prune them and move {LATEST}. Resume that run with --load "
                f"{save_dir}, or give --save another directory")
    tag = split_load_path(load)[1]
    newer = found[found.index(tag) + 1:] if tag in found else []
    if newer:
        return (f"--load {load} resumes from {tag}, but --save {save_dir} holds newer "
                f"checkpoints of that run ({', '.join(newer)}): this run's saves would mix "
                f"with them. Give --save another directory")
    return ""


def _problems(load_dir: str, tag: Optional[str], rank: int,
              world: int) -> tuple[Optional[str], Optional[dict], str, list[str]]:
    """(tag, manifest, problem, corrupt files) of one rank's view of the checkpoint: no file
    the manifest does not list, presence and size of every file it lists, the checksums of this
    rank's share of the files."""
    if tag is None:
        try:
            tag = read_latest(load_dir)
        except CheckpointError as err:
            return None, None, str(err), []
        if tag is None:
            where = "does not exist" if not os.path.isdir(load_dir) else \
                f"has no {LATEST} file (no save completed there)"
            return None, None, f"no checkpoint to load: {load_dir} {where}", []
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path):
        return tag, None, f"checkpoint {path} does not exist", []
    try:
        manifest = read_manifest(path)
    except CheckpointError as err:
        return tag, None, str(err), []
    if manifest is None:
        return tag, None, (f"checkpoint {path} is incomplete: it has no {MANIFEST} (its save did "
                           "not finish, or megatron-dcp did not write it)"), []
    listed = manifest.get("files", {})
    unlisted = sorted(set(files_under(path)) - set(listed) - {MANIFEST})
    if unlisted:  # a loader that reads the whole folder (a universal conversion) would read it
        return tag, manifest, (
            f"checkpoint {path} holds files its {MANIFEST} does not list: "
            f"{', '.join(unlisted[:10])}{' ...' if len(unlisted) > 10 else ''} (added after the "
            "save: nothing of this checkpoint is loaded while they are there; remove them if "
            "you trust them, or load another checkpoint)"), []
    missing, short = [], []
    for name, size in listed.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            missing.append(name)
        elif os.path.getsize(file) != size:
            short.append(f"{name} ({os.path.getsize(file)} of {size} bytes)")
    if missing or short:
        parts = ([f"missing {', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else "")]
                 if missing else []) + ([f"wrong size {', '.join(short[:10])}"] if short else [])
        return tag, manifest, f"checkpoint {path} is incomplete: {'; '.join(parts)}", []
    corrupt = []
    for name, want in sorted(manifest.get("checksums", {}).items())[rank::world]:
        try:
            got = file_checksum(os.path.join(path, name))
        except OSError as err:
            return tag, manifest, f"checkpoint {path}: cannot read {name}: {err}", []
        if got != want:
            corrupt.append(f"{name} ({got}, saved as {want})")
    return tag, manifest, "", corrupt


def _verify(load_dir: str, tag: Optional[str],
            group: Any) -> tuple[Optional[str], Optional[dict], str]:
    """Collective: (tag, manifest, the reason it cannot be loaded or "")."""
    tag, manifest, problem, corrupt = _problems(load_dir, tag, group_rank(group), group_size(group))
    outcomes = gather((problem, corrupt), group)
    failed = failures([text for text, _ in outcomes])
    if failed:
        if len(set(failed.values())) == 1 and len(failed) == len(outcomes):
            return tag, manifest, next(iter(failed.values()))
        return tag, manifest, "\n  ".join(["cannot load the checkpoint:"] + [
            f"rank {r}: {text}" for r, text in failed.items()])
    corrupt = sorted(name for _, names in outcomes for name in names)
    if corrupt:
        return tag, manifest, (
            f"checkpoint {os.path.join(load_dir, str(tag))} is corrupt: the checksum of "
            f"{', '.join(corrupt)} differs from the one recorded when it was saved")
    return tag, manifest, ""


def verify_checkpoint(load_dir: str, tag: Optional[str] = None, *,
                      group: Any = None) -> tuple[str, dict]:
    """Collective: the tag to load and its manifest, after every rank checked every file's
    presence and size and its share of the checksums. Given a ``tag``, that checkpoint or a
    `CheckpointError`; without, the one ``latest`` names, or if that one is missing a file or
    corrupt, the newest other complete checkpoint that verifies (rank 0 says so on stderr).
    Raises `CheckpointError` on every rank alike, so that no rank starts loading alone."""
    found, manifest, problem = _verify(load_dir, tag, group)
    if not problem:
        assert found is not None and manifest is not None
        return found, manifest
    if tag is not None or found is None:  # asked for this one, or no latest to fall back from
        raise CheckpointError(problem)
    for older, _ in reversed(primary_checkpoints(complete_checkpoints(load_dir))):
        if older == found:
            continue
        older, manifest, why_not = _verify(load_dir, older, group)
        if not why_not:
            if group_rank(group) == 0:
                print(f"{problem}\nloading {os.path.join(load_dir, str(older))} instead: the "
                      "newest checkpoint that verifies", file=sys.stderr, flush=True)
            assert older is not None and manifest is not None
            return older, manifest
    raise CheckpointError(f"{problem}\nno other checkpoint in {load_dir} verifies either")
