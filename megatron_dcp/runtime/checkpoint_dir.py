"""Atomic, checksummed checkpoint directories: nothing half-written or corrupt is ever loaded.

A checkpoint is a directory ``SAVE_DIR/TAG`` of files written by every rank, plus a manifest
(``dcp_manifest.json``: every file with its size and CRC-32, whether the saver vouched for the
state, and what the engine records: world size, ZeRO stage ...) and the pointer file
``SAVE_DIR/latest`` naming the newest tag.

* `save_atomically` (collective): every rank writes into ``TAG.partial`` (`save_file`: a
  ``torch.save`` that checksums the bytes as they are written, no second read); once *every*
  rank has confirmed (one gather: a rank that failed is named, a full disk is called one),
  rank 0 writes the manifest, renames the directory to ``TAG`` and only then replaces
  ``latest`` (write a temporary file, rename it over): a crash at any point leaves ``latest``
  naming the previous, complete checkpoint. Optionally the oldest complete checkpoints beyond
  ``keep_last`` are deleted, never the newest one saved ``verified``.
* `megatron_dcp.runtime.checkpoint_verify`: the load side (every file's presence, size and
  checksum checked before the engine's loader reads anything; ``latest`` falls back to the
  newest checkpoint that verifies).
* `check_save_dir`: the ``--save`` directory is creatable and writable, and not inside another
  checkpoint (`inside_checkpoint_problem`), checked at start.
* `read_manifest`, `read_latest`, `complete_checkpoints`, `primary_checkpoints`, `prune`: reading
  and pruning the directory; `gather`, `group_rank`, `group_size`, `failures`: the collective
  helpers both sides use (without torch.distributed: one rank).

A shared file system is assumed (every rank sees the directory, as DeepSpeed's own ``latest``
file assumes); durability against power loss comes from fsync of the files, the manifest and the
directory before ``latest`` moves.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch.distributed as dist

from megatron_dcp.config import file_in_the_way

MANIFEST = "dcp_manifest.json"
LATEST = "latest"
PARTIAL = ".partial"
CHECKSUM = "crc32"  # zlib's CRC-32: about 4 GB/s on one core, streamed, in the standard library


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, or is missing, incomplete or corrupt (names what and
    where)."""


class ChecksumWriter:
    """A binary file object that checksums every byte written through it (``torch.save`` and
    pickle write to it as to a file): the checksum costs no second read of the file. A large
    write (a tensor's storage) is checksummed on a helper thread while the file takes it (zlib
    releases the GIL), so on a machine with a core to spare the checksum adds almost no time.
    `close` ends the helper thread."""

    OVERLAP_BYTES = 1 << 20  # smaller writes (pickle data, zip headers) are checksummed inline

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._crc = 0
        self._pool: Optional[ThreadPoolExecutor] = None
        self.size = 0
        self.error: Optional[OSError] = None  # torch's zip writer replaces it by "unexpected pos"

    def write(self, data: Any) -> int:
        """Checksum and write ``data`` (any bytes-like object)."""
        view = memoryview(data)
        if view.nbytes < self.OVERLAP_BYTES:
            self._crc = zlib.crc32(view, self._crc)
            written = self._write(view)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="dcp-checksum")
            crc = self._pool.submit(zlib.crc32, view, self._crc)
            try:
                written = self._write(view)
            finally:
                self._crc = crc.result()  # ``data`` may be freed once write returns
        self.size += view.nbytes
        return written

    def _write(self, view: memoryview) -> int:
        try:
            return self._handle.write(view)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        """Flush the underlying file."""
        self._handle.flush()

    def close(self) -> None:
        """End the helper thread (the underlying file stays open)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    @property
    def checksum(self) -> str:
        """``"crc32:xxxxxxxx"`` of everything written so far."""
        return f"{CHECKSUM}:{self._crc:08x}"


def save_file(obj: Any, path: str, **torch_save_kwargs: Any) -> str:
    """``torch.save(obj, path)`` that returns the file's checksum, computed while writing
    (return it from the ``write`` of `save_atomically` so the manifest records it)."""
    import torch

    with open(path, "wb") as handle:
        writer = ChecksumWriter(handle)
        try:
            torch.save(obj, writer, **torch_save_kwargs)
        except RuntimeError as err:
            if writer.error is not None:  # the OSError (ENOSPC ...) the writer hides
                raise writer.error from err
            raise
        finally:
            writer.close()
    return writer.checksum


def file_checksum(path: str, chunk_bytes: int = 16 << 20) -> str:
    """The checksum of the file at ``path`` (read once, in chunks)."""
    crc, buffer = 0, bytearray(chunk_bytes)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while True:
            n = handle.readinto(buffer)
            if not n:
                return f"{CHECKSUM}:{crc:08x}"
            crc = zlib.crc32(view[:n], crc)


def gather(value: Any, group: Any) -> list[Any]:
    """Every rank's ``value`` (index = rank in ``group``); the value itself without a group."""
    if not dist.is_available() or not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def group_rank(group: Any) -> int:
    """This process's rank in ``group`` (0 without torch.distributed)."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def group_size(group: Any) -> int:
    """Ranks of ``group`` (1 without torch.distributed)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def failures(outcomes: list[Any]) -> dict[int, str]:
    """The ranks (index of ``outcomes``) that reported a problem, with its text."""
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


def files_under(root: str) -> dict[str, int]:
    """Every file under ``root`` (relative path -> size in bytes)."""
    files = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            files[os.path.relpath(path, root)] = os.path.getsize(path)
    return files


def _disk_full(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is a write that ran out of space: ``ENOSPC``, or the
    "unexpected pos" of torch's zip writer (inline_container.cc) when a write came up short."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "unexpected pos" in str(err) or "No space left on device" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _describe(err: BaseException, save_dir: str) -> str:
    text = f"{type(err).__name__}: {err}"
    if _disk_full(err):
        return f"the disk is full (no space left in {save_dir}): {text}"
    return text


CHECKPOINT_FILES = (MANIFEST, ".metadata", "metadata.json", "dcp_planner.json",
                    "mp_rank_00_model_states.pt")
"""Files that make a folder a checkpoint: megatron-dcp's manifest, torch.distributed's (and
megatron-core's) metadata, the launcher's planner state, DeepSpeed's model states."""


def _checkpoint_sign(folder: str, trackers: tuple[str, ...]) -> str:
    """Why ``folder`` is a checkpoint (``""`` when it is none): it holds one of
    `CHECKPOINT_FILES`, or its parent's ``latest`` (or one of ``trackers``, files naming an
    iteration's folder ``iter_N...``) names it."""
    for name in CHECKPOINT_FILES:
        if os.path.isfile(os.path.join(folder, name)):
            return f"it holds {name}"
    parent, name = os.path.split(folder)
    try:
        if read_latest(parent) == name:
            return f"{os.path.join(parent, LATEST)} names it"
    except (CheckpointError, OSError, UnicodeDecodeError):
        pass
    for tracker in trackers if name.startswith("iter_") and name[5:].isdigit() else ():
        if os.path.isfile(os.path.join(parent, tracker)):
            return f"an iteration folder beside {os.path.join(parent, tracker)}"
    return ""


def enclosing_checkpoint(path: str, trackers: tuple[str, ...] = ()) -> Optional[tuple[str, str]]:
    """(checkpoint folder, why) when ``path`` is a checkpoint folder or lies inside one (the
    nearest such folder among ``path`` and its existing parents: `_checkpoint_sign`), else
    None. A ``--save`` there would write checkpoints and ``latest`` into another run's
    checkpoint, whose next load then refuses it for files its manifest does not list."""
    folder = os.path.abspath(path)
    while True:
        if os.path.isdir(folder):
            why = _checkpoint_sign(folder, trackers)
            if why:
                return folder, why
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def inside_checkpoint_problem(save_dir: str, flag: str = "--save",
                              trackers: tuple[str, ...] = ()) -> str:
    """Why ``save_dir`` may not take checkpoints because it is, or lies inside, another
    checkpoint (`enclosing_checkpoint`), naming that checkpoint and ``flag``; ``""`` if not."""
    found = enclosing_checkpoint(save_dir, trackers)
    if found is None:
        return ""
    folder, why = found
    where = "is the checkpoint" if folder == os.path.abspath(save_dir) else \
        "lies inside the checkpoint"
    parent = os.path.dirname(folder)
    return (f"{flag} {save_dir} {where} {folder} ({why}): a save there would write this run's "
            f"checkpoints into that one, which its run would then refuse to load. Give {flag} a "
            f"directory outside every checkpoint (to continue that run: --load {parent} "
            f"{flag} {parent})")


def check_save_dir(save_dir: str) -> None:
    """At start: ``save_dir`` is a writable directory, or can be created (it is created now,
    with a probe file written and removed), and is not inside another checkpoint
    (`inside_checkpoint_problem`, checked before anything is created). Raises `CheckpointError`
    saying why not (a path that is a file has its own message)."""
    if not save_dir.strip():
        raise CheckpointError(f"checkpoint directory {save_dir!r} is an empty name: give a "
                              "directory")
    inside = inside_checkpoint_problem(save_dir)
    if inside:
        raise CheckpointError("checkpoint directory " + inside.removeprefix("--save "))
    where = file_in_the_way(save_dir)
    if where:
        raise CheckpointError(f"checkpoint directory {save_dir} {where}: give a directory")
    try:
        os.makedirs(save_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".dcp-write-test-", dir=save_dir)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as err:
        raise CheckpointError(f"checkpoint directory {save_dir} is not writable: "
                              f"{err.strerror or err}") from None


def read_latest(save_dir: str) -> Optional[str]:
    """The tag ``SAVE_DIR/latest`` names, or None when there is none. Raises `CheckpointError`
    when it names anything but a checkpoint directly inside ``SAVE_DIR``."""
    try:
        with open(os.path.join(save_dir, LATEST)) as handle:
            tag = handle.read().strip() or None
    except FileNotFoundError:
        return None
    if tag is not None and not _plain_tag(tag):
        raise CheckpointError(
            f"{os.path.join(save_dir, LATEST)} names {tag!r}: a {LATEST} file may name only a "
            f"checkpoint inside its own directory ({save_dir}); to load another checkpoint, "
            "give its directory to --load")
    return tag


def _plain_tag(tag: str) -> bool:
    return not (os.sep in tag or (os.altsep and os.altsep in tag) or tag in ("", ".", ".."))


def save_atomically(save_dir: str, tag: str, write: Callable[[str], Any], *,
                    group: Any = None, meta: Optional[dict] = None,
                    keep_last: Optional[int] = None, move_latest: bool = True,
                    verified: bool = True) -> str:
    """Collective: ``write(staging_tag)`` on every rank writes its files into
    ``SAVE_DIR/staging_tag`` and may return ``{path: checksum}`` of the files it checksummed
    while writing (`save_file`; paths absolute or relative to the staging directory): rank 0
    checksums any other file by reading it. The checkpoint becomes ``SAVE_DIR/TAG`` (and
    ``latest``, with ``move_latest``) only after every rank confirmed. ``meta`` goes into the
    manifest; ``keep_last``: delete the oldest complete checkpoints beyond this many;
    ``verified``: the saver vouches for the state (a caller that saves after a non-finite step
    passes False): `prune` keeps the newest checkpoint saved verified whatever ``keep_last``.
    Returns the path. Raises `CheckpointError` on every rank, naming the failed ranks (a full
    disk as such), if any rank's write failed; ``latest`` then still names the previous
    checkpoint and the staging directory is removed.
    """
    if not _plain_tag(tag) or tag.endswith(PARTIAL):
        raise CheckpointError(f"checkpoint tag {tag!r}: must be a plain directory name")
    if keep_last is not None and keep_last < 1:
        raise CheckpointError(f"keep_last={keep_last}: must be >= 1")
    rank = group_rank(group)
    staging = tag + PARTIAL
    staging_path = os.path.join(save_dir, staging)
    problem = ""
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(staging_path, ignore_errors=True)  # left by a save that crashed
        except OSError as err:
            problem = f"cannot prepare {staging_path}: {_describe(err, save_dir)}"
    failed = failures(gather(problem, group))  # also: nobody writes before the cleanup
    checksums: dict[str, str] = {}
    if not failed:
        try:
            checksums = _relative(write(staging), staging_path)
        except Exception as err:  # noqa: BLE001 - reported to every rank, then raised
            problem = _describe(err, save_dir)
        outcomes = gather((problem, checksums), group)
        failed = failures([text for text, _ in outcomes])
        checksums = {name: crc for _, sums in outcomes for name, crc in sums.items()}
    if failed:
        if rank == 0:  # a full disk gets its space back
            shutil.rmtree(staging_path, ignore_errors=True)
        raise CheckpointError(_not_saved(save_dir, tag, failed))
    if rank == 0:
        try:
            _publish(save_dir, tag, staging_path, {**(meta or {}), "verified": bool(verified)},
                     checksums, move_latest, keep_last)
        except Exception as err:  # noqa: BLE001 - reported to every rank, then raised
            problem = _describe(err, save_dir)
            shutil.rmtree(staging_path, ignore_errors=True)
    failed = failures(gather(problem, group))
    if failed:
        raise CheckpointError(_not_saved(save_dir, tag, failed))
    return os.path.join(save_dir, tag)


def _relative(checksums: Any, staging_path: str) -> dict[str, str]:
    """``write``'s ``{path: checksum}`` with paths relative to the staging directory."""
    if not isinstance(checksums, dict):
        return {}
    out = {}
    for path, crc in checksums.items():
        name = os.path.relpath(os.path.join(staging_path, path), staging_path)
        if not name.startswith(os.pardir):
            out[name] = crc
    return out


def _not_saved(save_dir: str, tag: str, failed: dict[int, str]) -> str:
    try:
        previous = read_latest(save_dir)
    except CheckpointError:
        previous = None
    lines = "\n  ".join(f"rank {r}: {text}" for r, text in failed.items())
    kept = f"{LATEST} still names {previous!r}" if previous else f"no {LATEST} file was written"
    return f"checkpoint {tag!r} in {save_dir} was not saved ({kept}):\n  {lines}"


def _publish(save_dir: str, tag: str, staging_path: str, meta: dict, checksums: dict[str, str],
             move_latest: bool, keep_last: Optional[int]) -> None:
    """Rank 0, after every rank wrote: manifest, rename, ``latest``, pruning."""
    files = files_under(staging_path)
    for name in files:
        _fsync(os.path.join(staging_path, name))
    # a file written without `save_file` (DeepSpeed's copy of zero_to_fp32.py, a converter's
    # output) is checksummed here, by reading it back
    sums = {name: checksums.get(name) or file_checksum(os.path.join(staging_path, name))
            for name in files}
    manifest = {**meta, "tag": tag, "files": files, "checksums": sums, "saved_at": time.time()}
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
    if move_latest and not _older(meta, _latest_manifest(save_dir)):
        _write_file(os.path.join(save_dir, LATEST), tag + "\n")
        _fsync(save_dir, directory=True)
    if keep_last is not None:
        prune(save_dir, keep_last, newest=meta.get("iteration"))


def _latest_manifest(save_dir: str) -> Optional[dict]:
    """The manifest of the checkpoint ``latest`` names, or None."""
    try:
        tag = read_latest(save_dir)
        return read_manifest(os.path.join(save_dir, tag)) if tag else None
    except CheckpointError:
        return None


def _older(meta: dict, than: Optional[dict]) -> bool:
    """Whether a checkpoint of manifest ``meta`` is of an earlier iteration than ``than``'s
    (``latest`` never moves back: a run saving among a newer run's checkpoints)."""
    mine, theirs = meta.get("iteration"), (than or {}).get("iteration")
    return mine is not None and theirs is not None and int(mine) < int(theirs)


def read_manifest(path: str) -> Optional[dict]:
    """The manifest of the checkpoint directory ``path``, or None when it has none."""
    try:
        with open(os.path.join(path, MANIFEST)) as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)} is unreadable: {err}") from None


def complete_checkpoints(save_dir: str) -> list[tuple[str, dict]]:
    """``(tag, manifest)`` of the complete checkpoints in ``save_dir``, oldest first."""
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
            found.append((float(manifest.get("saved_at", 0.0)), name, manifest))
    return [(name, manifest) for _, name, manifest in sorted(found, key=lambda f: f[:2])]


def primary_checkpoints(checkpoints: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """Without the derived checkpoints (``TAG.universal`` beside ``TAG``)."""
    tags = [t for t, _ in checkpoints]
    return [(t, m) for t, m in checkpoints
            if not any(t.startswith(p + ".") for p in tags if p != t)]


def prune(save_dir: str, keep_last: int, newest: Optional[int] = None) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints, never the one ``latest``
    names, the newest one saved ``verified``, nor one of a later iteration than ``newest``
    (the one just written) (with their derived directories ``TAG.*``), and the partial
    directories; returns the tags deleted."""
    primary = primary_checkpoints(complete_checkpoints(save_dir))
    keep = {t for t, _ in primary[-keep_last:]} if keep_last else set()
    keep.add(read_latest(save_dir))
    keep.update([t for t, m in primary if m.get("verified") is True][-1:])
    if newest is not None:
        keep.update(t for t, m in primary if _older({"iteration": newest}, m))
    doomed = [t for t, _ in primary if t not in keep]
    for tag in doomed:
        for name in os.listdir(save_dir):
            if name == tag or name.startswith(tag + "."):
                shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    for name in os.listdir(save_dir):
        if name.endswith(PARTIAL):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    return doomed
