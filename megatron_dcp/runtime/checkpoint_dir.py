"""Atomic checkpoint directories: nothing half-written is ever loaded.

A checkpoint is a directory ``SAVE_DIR/TAG`` of files written by every rank, plus a manifest
(``dcp_manifest.json``: every file with its size, and what the engine records: world size,
ZeRO stage ...) and the pointer file ``SAVE_DIR/latest`` naming the newest tag.

* `save_atomically` (collective): every rank writes into ``TAG.partial``; once *every* rank has
  confirmed (one gather: a rank that failed is named), rank 0 writes the manifest, renames the
  directory to ``TAG`` and only then replaces ``latest`` (write a temporary file, rename it over):
  a crash at any point leaves ``latest`` naming the previous, complete checkpoint. Optionally
  the oldest complete checkpoints beyond ``keep_last`` are deleted.
* `verify_checkpoint` (collective): resolve ``latest`` (or the tag given), check the manifest
  and every file's presence and size on every rank, and fail on all of them alike, naming what
  is missing, before the engine's loader reads anything.

A shared file system is assumed (every rank sees the directory, as DeepSpeed's own ``latest``
file assumes); durability against power loss comes from fsync of the files, the manifest and the
directory before ``latest`` moves.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Callable, Optional

import torch.distributed as dist

MANIFEST = "dcp_manifest.json"
LATEST = "latest"
PARTIAL = ".partial"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, or is missing or incomplete (names what and where)."""


def _gather(value: Any, group: Any) -> list[Any]:
    """Every rank's ``value`` (index = rank in ``group``); the value itself without a group."""
    if not dist.is_available() or not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _rank(group: Any) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _failures(outcomes: list[Any]) -> dict[int, str]:
    return {r: text for r, text in enumerate(outcomes) if text}


def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY if directory else os.O_RDWR)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync of a directory
    finally:
        os.close(fd)


def _write_file(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file, fsync, rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _listing(root: str) -> dict[str, int]:
    """Every file under ``root`` (relative path -> size in bytes)."""
    files = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            files[os.path.relpath(path, root)] = os.path.getsize(path)
    return files


def read_latest(save_dir: str) -> Optional[str]:
    """The tag ``SAVE_DIR/latest`` names, or None when there is none."""
    try:
        with open(os.path.join(save_dir, LATEST)) as handle:
            return handle.read().strip() or None
    except FileNotFoundError:
        return None


def save_atomically(save_dir: str, tag: str, write: Callable[[str], Any], *,
                    group: Any = None, meta: Optional[dict] = None,
                    keep_last: Optional[int] = None, move_latest: bool = True) -> str:
    """Collective: ``write(staging_tag)`` on every rank writes its files into
    ``SAVE_DIR/staging_tag``; the checkpoint becomes ``SAVE_DIR/TAG`` (and ``latest``, with
    ``move_latest``) only after every rank confirmed. ``meta`` goes into the manifest;
    ``keep_last``: delete the oldest complete checkpoints beyond this many. Returns the path.
    Raises `CheckpointError` on every rank, naming the failed ranks, if any rank's write failed;
    ``latest`` then still names the previous checkpoint.
    """
    if os.sep in tag or tag in ("", ".", "..") or tag.endswith(PARTIAL):
        raise CheckpointError(f"checkpoint tag {tag!r}: must be a plain directory name")
    if keep_last is not None and keep_last < 1:
        raise CheckpointError(f"keep_last={keep_last}: must be >= 1")
    rank = _rank(group)
    staging = tag + PARTIAL
    staging_path = os.path.join(save_dir, staging)
    problem = ""
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(staging_path, ignore_errors=True)  # left by a save that crashed
        except OSError as err:
            problem = f"cannot prepare {staging_path}: {err}"
    failed = _failures(_gather(problem, group))  # also: nobody writes before the cleanup
    if not failed:
        try:
            write(staging)
        except Exception as err:  # noqa: BLE001 - reported to every rank, then raised
            problem = f"{type(err).__name__}: {err}"
        failed = _failures(_gather(problem, group))
    if failed:
        raise CheckpointError(_not_saved(save_dir, tag, failed))
    if rank == 0:
        try:
            _publish(save_dir, tag, staging_path, dict(meta or {}), move_latest, keep_last)
        except Exception as err:  # noqa: BLE001 - reported to every rank, then raised
            problem = f"{type(err).__name__}: {err}"
    failed = _failures(_gather(problem, group))
    if failed:
        raise CheckpointError(_not_saved(save_dir, tag, failed))
    return os.path.join(save_dir, tag)


def _not_saved(save_dir: str, tag: str, failed: dict[int, str]) -> str:
    previous = read_latest(save_dir)
    lines = "\n  ".join(f"rank {r}: {text}" for r, text in failed.items())
    kept = f"{LATEST} still names {previous!r}" if previous else f"no {LATEST} file was written"
    return f"checkpoint {tag!r} in {save_dir} was not saved ({kept}):\n  {lines}"


def _publish(save_dir: str, tag: str, staging_path: str, meta: dict, move_latest: bool,
             keep_last: Optional[int]) -> None:
    """Rank 0, after every rank wrote: manifest, rename, ``latest``, pruning."""
    files = _listing(staging_path)
    for name in files:
        _fsync(os.path.join(staging_path, name))
    manifest = {**meta, "tag": tag, "files": files, "saved_at": time.time()}
    _write_file(os.path.join(staging_path, MANIFEST), json.dumps(manifest, indent=1))
    final = os.path.join(save_dir, tag)
    if os.path.exists(final):  # the same tag saved again: the old one goes once the new is in
        old = f"{final}.old-{os.getpid()}"
        os.rename(final, old)
        os.rename(staging_path, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging_path, final)
    _fsync(save_dir, directory=True)
    if move_latest:
        _write_file(os.path.join(save_dir, LATEST), tag + "\n")
        _fsync(save_dir, directory=True)
    if keep_last is not None:
        prune(save_dir, keep_last)


def read_manifest(path: str) -> Optional[dict]:
    """The manifest of the checkpoint directory ``path``, or None when it has none."""
    try:
        with open(os.path.join(path, MANIFEST)) as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)} is unreadable: {err}") from None


def complete_checkpoints(save_dir: str) -> list[str]:
    """Tags of the complete checkpoints in ``save_dir`` (with a manifest), oldest first."""
    found = []
    for name in os.listdir(save_dir) if os.path.isdir(save_dir) else ():
        path = os.path.join(save_dir, name)
        if name.endswith(PARTIAL) or not os.path.isdir(path):
            continue
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            continue
        if manifest is not None:
            found.append((float(manifest.get("saved_at", 0.0)), name))
    return [name for _, name in sorted(found)]


def prune(save_dir: str, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints (never the one ``latest``
    names), their derived directories (``TAG.*``) and partial directories; returns the tags
    deleted."""
    tags = complete_checkpoints(save_dir)
    latest = read_latest(save_dir)
    primary = [t for t in tags if not any(t.startswith(p + ".") for p in tags if p != t)]
    doomed = [t for t in primary[:-keep_last] if t != latest] if keep_last else []
    for tag in doomed:
        for name in os.listdir(save_dir):
            if name == tag or name.startswith(tag + "."):
                shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    for name in os.listdir(save_dir):
        if name.endswith(PARTIAL):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    return doomed


def split_load_path(path: str) -> tuple[str, Optional[str]]:
    """``--load`` takes a checkpoint directory (its ``latest`` is loaded) or one checkpoint in
    it: ``(load_dir, tag)``."""
    path = os.path.normpath(path)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return os.path.dirname(path), os.path.basename(path)
    return path, None


def _problems(load_dir: str, tag: Optional[str]) -> tuple[Optional[str], Optional[dict], str]:
    """(tag, manifest, problem) of one rank's view of the checkpoint."""
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            where = "does not exist" if not os.path.isdir(load_dir) else \
                f"has no {LATEST} file (no save completed there)"
            return None, None, f"no checkpoint to load: {load_dir} {where}"
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path):
        return tag, None, f"checkpoint {path} does not exist"
    try:
        manifest = read_manifest(path)
    except CheckpointError as err:
        return tag, None, str(err)
    if manifest is None:
        return tag, None, (f"checkpoint {path} is incomplete: it has no {MANIFEST} (its save did "
                           "not finish, or megatron-dcp did not write it)")
    missing, short = [], []
    for name, size in manifest.get("files", {}).items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            missing.append(name)
        elif os.path.getsize(file) != size:
            short.append(f"{name} ({os.path.getsize(file)} of {size} bytes)")
    if missing or short:
        parts = ([f"missing {', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else "")]
                 if missing else []) + ([f"wrong size {', '.join(short[:10])}"] if short else [])
        return tag, manifest, f"checkpoint {path} is incomplete: {'; '.join(parts)}"
    return tag, manifest, ""


def verify_checkpoint(load_dir: str, tag: Optional[str] = None, *,
                      group: Any = None) -> tuple[str, dict]:
    """Collective: the tag to load (``tag``, or the one ``latest`` names) and its manifest,
    after every rank checked every file of the manifest. Raises `CheckpointError` on every
    rank alike, naming the ranks and what they miss, so that no rank starts loading alone."""
    tag, manifest, problem = _problems(load_dir, tag)
    failed = _failures(_gather(problem, group))
    if failed:
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() \
            else 1
        if len(set(failed.values())) == 1 and len(failed) == world:
            raise CheckpointError(next(iter(failed.values())))
        raise CheckpointError("\n  ".join(["cannot load the checkpoint:"] + [
            f"rank {r}: {text}" for r, text in failed.items()]))
    assert tag is not None and manifest is not None
    return tag, manifest
