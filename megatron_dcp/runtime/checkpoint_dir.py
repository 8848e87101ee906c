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
* `verify_checkpoint` (collective): resolve ``latest`` (a tag inside ``SAVE_DIR`` only) or the
  tag given, check the manifest, every file's presence and size on every rank and every file's
  checksum (the files shared out over the ranks), before the engine's loader reads anything.
  A checkpoint that fails names the file; loading ``latest``, the newest older checkpoint that
  verifies is loaded instead, saying so.
* `check_save_dir`: the ``--save`` directory is creatable and writable, checked at start.

A shared file system is assumed (every rank sees the directory, as DeepSpeed's own ``latest``
file assumes); durability against power loss comes from fsync of the files, the manifest and the
directory before ``latest`` moves.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch.distributed as dist

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


def _gather(value: Any, group: Any) -> list[Any]:
    """Every rank's ``value`` (index = rank in ``group``); the value itself without a group."""
    if not dist.is_available() or not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _rank(group: Any) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _world(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _failures(outcomes: list[Any]) -> dict[int, str]:
    return {r: text for r, text in enumerate(outcomes) if text}


def agree(problem: str, group: Any = None) -> None:
    """Collective: raise `CheckpointError` on every rank when any rank found a ``problem``
    (one text per rank, ``""`` for none): the same text when every rank found the same one,
    else each rank's, so that no rank goes on loading alone."""
    failed = _failures(_gather(problem, group))
    if not failed:
        return
    texts = set(failed.values())
    if len(texts) == 1:
        raise CheckpointError(texts.pop())
    raise CheckpointError("\n  ".join(["cannot load the checkpoint:"] + [
        f"rank {r}: {text}" for r, text in failed.items()]))


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


def check_save_dir(save_dir: str) -> None:
    """At start: ``save_dir`` is a writable directory, or can be created (it is created now,
    with a probe file written and removed). Raises `CheckpointError` saying why not (a path
    that is a file has its own message)."""
    if not save_dir.strip():
        raise CheckpointError(f"checkpoint directory {save_dir!r} is an empty name: give a "
                              "directory")
    blocker = os.path.abspath(save_dir)
    while not os.path.exists(blocker) and os.path.dirname(blocker) != blocker:
        blocker = os.path.dirname(blocker)
    if os.path.exists(blocker) and not os.path.isdir(blocker):
        where = "is a file" if blocker == os.path.abspath(save_dir) else \
            f"lies under {blocker}, which is a file"
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
    rank = _rank(group)
    staging = tag + PARTIAL
    staging_path = os.path.join(save_dir, staging)
    problem = ""
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(staging_path, ignore_errors=True)  # left by a save that crashed
        except OSError as err:
            problem = f"cannot prepare {staging_path}: {_describe(err, save_dir)}"
    failed = _failures(_gather(problem, group))  # also: nobody writes before the cleanup
    checksums: dict[str, str] = {}
    if not failed:
        try:
            checksums = _relative(write(staging), staging_path)
        except Exception as err:  # noqa: BLE001 - reported to every rank, then raised
            problem = _describe(err, save_dir)
        outcomes = _gather((problem, checksums), group)
        failed = _failures([text for text, _ in outcomes])
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
    failed = _failures(_gather(problem, group))
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
    files = _listing(staging_path)
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


def _complete(save_dir: str) -> list[tuple[str, dict]]:
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


def _primary(checkpoints: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """Without the derived checkpoints (``TAG.universal`` beside ``TAG``)."""
    tags = [t for t, _ in checkpoints]
    return [(t, m) for t, m in checkpoints
            if not any(t.startswith(p + ".") for p in tags if p != t)]


def prune(save_dir: str, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints, never the one ``latest``
    names nor the newest one saved ``verified`` (with their derived directories ``TAG.*``),
    and the partial directories; returns the tags deleted."""
    primary = _primary(_complete(save_dir))
    keep = {t for t, _ in primary[-keep_last:]} if keep_last else set()
    keep.add(read_latest(save_dir))
    keep.update([t for t, m in primary if m.get("verified") is True][-1:])
    doomed = [t for t, _ in primary if t not in keep]
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


def _problems(load_dir: str, tag: Optional[str], rank: int,
              world: int) -> tuple[Optional[str], Optional[dict], str, list[str]]:
    """(tag, manifest, problem, corrupt files) of one rank's view of the checkpoint: presence
    and size of every file, the checksums of this rank's share of the files."""
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
    tag, manifest, problem, corrupt = _problems(load_dir, tag, _rank(group), _world(group))
    outcomes = _gather((problem, corrupt), group)
    failed = _failures([text for text, _ in outcomes])
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
    for older, _ in reversed(_primary(_complete(load_dir))):
        if older == found:
            continue
        older, manifest, why_not = _verify(load_dir, older, group)
        if not why_not:
            if _rank(group) == 0:
                print(f"{problem}\nloading {os.path.join(load_dir, str(older))} instead: the "
                      "newest checkpoint that verifies", file=sys.stderr, flush=True)
            assert older is not None and manifest is not None
            return older, manifest
    raise CheckpointError(f"{problem}\nno other checkpoint in {load_dir} verifies either")
