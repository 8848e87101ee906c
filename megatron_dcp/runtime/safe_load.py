"""Loads that run no code: every pickle a checkpoint load reads admits only the classes its
format needs, and anything else is refused naming the file and the class.

A checksum in the manifest catches corruption, not a crafted file (whoever writes the file can
write the manifest too); unpickling an arbitrary file runs whatever callable it names. So:

* `load_weights` (``torch.save`` files: ``rank_{r}.pt``, ``state.pt``, Megatron's
  ``common.pt``): ``torch.load(weights_only=True)``, tensors and plain types only (plus the
  ``safe_globals`` a caller names). A refusal is an `UnsafeCheckpointError` naming the file and
  the global the file asked for.
* `read_pickle` (a plain pickle, such as torch.distributed.checkpoint's ``.metadata``): a
  restricted unpickler whose ``find_class`` admits only the (module, name) pairs it is given.
* `SafeFileSystemReader`: torch.distributed.checkpoint's ``FileSystemReader`` whose
  ``.metadata`` goes through `read_pickle` with `METADATA_CLASSES` (torch reads it with a plain
  ``pickle.load``), and whose byte items (non-tensor values inside the ``.distcp`` files, which
  torch's default planner unpickles with ``weights_only=False``) are checked with
  ``weights_only=True`` before the planner sees them.
* `check_folder`: before a host framework's own loader reads a checkpoint folder (Megatron-LM's
  ``load_checkpoint`` through the launcher), every pickle it would unpickle is read as above:
  each ``.metadata`` with its own classes, its byte items and every ``.pt`` file
  ``weights_only``, admitting only what the caller's ``admit`` grants of the globals a file
  names.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any, Callable, Iterable, Optional

import torch

from megatron_dcp.runtime.checkpoint_dir import CheckpointError


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asks for a class or function its format does not need: it was not
    unpickled (nothing in it ran)."""


_DCP = "torch.distributed.checkpoint"
# what torch.distributed.checkpoint's .metadata holds (torch 2.4-2.13): its dataclasses and
# enums, torch.Size, dtypes, layouts and memory formats
METADATA_CLASSES = frozenset({
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # torch's own saves: checkpoint_id
    ("builtins", "set"), ("builtins", "frozenset"),
    *((f"{_DCP}.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "BytesStorageMetadata",
        "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "_MEM_FORMAT_ENCODING")),
    *((f"{_DCP}.planner", n) for n in (
        "SavePlan", "LoadPlan", "WriteItem", "ReadItem", "WriteItemType", "LoadItemType",
        "TensorWriteData", "BytesIOWriteData")),
    *((f"{_DCP}.filesystem", n) for n in ("_StorageInfo", "_StoragePrefix")),
    *((f"{_DCP}._extension", n) for n in ("StreamTransformExtension",)),
})


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _Restricted(pickle.Unpickler):
    def __init__(self, handle: Any, allowed: frozenset, path: str) -> None:
        super().__init__(handle)
        self._allowed, self._path = allowed, path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._allowed or _is_dtype(module, name):
            found = super().find_class(module, name)
            # a class, an enum, a dtype or torch's layout lookup: never an arbitrary callable
            if isinstance(found, (type, torch.dtype)) or name == "_get_layout":
                return found
        raise UnsafeCheckpointError(
            f"{self._path} asks for {module}.{name}, which its format does not hold: refused "
            "without unpickling (nothing in the file ran); it was crafted, or written by "
            "another program - load only checkpoints you trust")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self._path} holds a persistent reference {pid!r}, which "
                                    "its format does not hold: refused")


def read_pickle(path: str, allowed: Iterable[tuple[str, str]] = METADATA_CLASSES,
                data: Optional[bytes] = None) -> Any:
    """Unpickle ``path`` (or its bytes ``data``) admitting only the ``allowed`` (module, name)
    pairs and torch dtypes; raises `UnsafeCheckpointError` naming the file and the global."""
    allowed = frozenset(allowed)
    try:
        if data is not None:
            return _Restricted(io.BytesIO(data), allowed, path).load()
        with open(path, "rb") as handle:
            return _Restricted(handle, allowed, path).load()
    except UnsafeCheckpointError:
        raise
    except FileNotFoundError:
        raise
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError,
            OSError) as err:
        raise CheckpointError(f"{path} is not a readable pickle: {type(err).__name__}: "
                              f"{err}") from None


def refused_global(err: BaseException) -> str:
    """The global a ``weights_only`` load refused (from torch's message), or ``""``."""
    text = str(err)
    for pattern in (r"GLOBAL ([\w.]+)", r"Unsupported global: ([\w.]+)"):
        found = re.search(pattern, text)
        if found:
            return found.group(1)
    return ""


def load_weights(path: Any, *, name: Optional[str] = None, safe_globals: Iterable[Any] = (),
                 map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` (``path``: a file name or a seekable file object,
    ``name`` the file named in errors) with ``safe_globals`` also admitted. A file that asks for
    anything else raises `UnsafeCheckpointError` naming the file and the global; nothing in it
    runs."""
    where = name or str(path)
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, map_location=map_location, weights_only=True,
                              **({"mmap": True} if mmap else {}))
    except pickle.UnpicklingError as err:
        what = refused_global(err)
        raise UnsafeCheckpointError(
            f"{where} is not a checkpoint of megatron-dcp: it asks for "
            f"{what or 'more than tensors and plain types'}, which a load refuses to unpickle "
            "(nothing in the file ran); load only checkpoints you trust") from None
    except (RuntimeError, EOFError, ValueError, OSError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise CheckpointError(f"{where} is not readable as a checkpoint file: "
                              f"{type(err).__name__}: {str(err).splitlines()[0]}") from None


def _file_reader_base() -> type:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader


class _CheckedBytes:
    """A load planner whose ``load_bytes`` first checks the bytes with ``weights_only=True``
    (torch's default planner unpickles them fully); everything else is the planner's."""

    def __init__(self, planner: Any, where: str) -> None:
        self._planner, self._where = planner, where

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """Check ``value``, then hand it to the planner."""
        fqn = getattr(getattr(read_item, "dest_index", None), "fqn", "?")
        # torch.distributed.checkpoint saves a BytesIO value as itself
        load_weights(value, name=f"{self._where} (item {fqn})", safe_globals=[io.BytesIO])
        value.seek(0)
        self._planner.load_bytes(read_item, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


class SafeFileSystemReader(_file_reader_base()):  # type: ignore[misc]
    """torch.distributed.checkpoint's ``FileSystemReader`` that runs no code from the files:
    ``.metadata`` through `read_pickle` (`METADATA_CLASSES`), read once and cached; byte items
    checked with ``weights_only=True`` before the planner unpickles them."""

    def __init__(self, path: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self._safe_metadata: dict[str, Any] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The checkpoint's ``Metadata`` (``rank=``: a rank's own ``__{rank}.metadata``, as
        torch's reader), unpickled with only its own classes admitted; cached per file."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        named = getattr(self, "_get_metadata_path", None)
        path = str(named(rank)) if named is not None else os.path.join(str(self.path),
                                                                        ".metadata")
        if path not in self._safe_metadata:
            metadata = read_pickle(path)
            if type(metadata).__name__ != "Metadata":
                raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not "
                                            "torch.distributed.checkpoint's Metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._safe_metadata[path] = metadata
        return self._safe_metadata[path]

    def read_data(self, plan: Any, planner: Any) -> Any:
        """torch's ``read_data`` with the byte items checked first."""
        return super().read_data(plan, _CheckedBytes(planner, str(self.path)))


Admit = Callable[[list], list]
"""The globals a file names (``module.name`` strings) -> the objects a load may admit of them."""


def check_folder(folder: str, admit: Admit) -> list[str]:
    """Read, running nothing, every pickle in ``folder`` (and below) that a loader would
    unpickle: ``*.metadata`` (torch.distributed.checkpoint's, `METADATA_CLASSES`) and the byte
    items they index in the ``.distcp`` files, and every ``*.pt`` file; a byte item or ``.pt``
    file is loaded ``weights_only`` with ``admit(its globals)`` admitted. Raises
    `UnsafeCheckpointError` naming the file (and item) and the global; returns the files
    checked."""
    checked = []
    for where, _, names in sorted(os.walk(folder)):
        for name in sorted(names):
            path = os.path.join(where, name)
            if name.endswith(".metadata"):
                _check_byte_items(where, path, read_pickle(path), admit)
            elif name.endswith((".pt", ".pth")):
                _check_torch_file(path, path, admit, mmap=True)
            else:
                continue
            checked.append(path)
    return checked


def _check_torch_file(source: Any, where: str, admit: Admit, mmap: bool = False) -> None:
    from torch.serialization import get_unsafe_globals_in_checkpoint

    try:  # names only: nothing is unpickled
        asked = get_unsafe_globals_in_checkpoint(source)
    except Exception:  # noqa: BLE001 - not torch's zip format: the load below refuses it
        asked = []
    if hasattr(source, "seek"):
        source.seek(0)
    load_weights(source, name=where, safe_globals=admit(list(asked)), mmap=mmap)


def _check_byte_items(folder: str, path: str, metadata: Any, admit: Admit) -> None:
    """Every byte item ``metadata`` indexes, read from its file and loaded ``weights_only``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    byte_keys = {fqn for fqn, meta in metadata.state_dict_metadata.items()
                 if isinstance(meta, BytesStorageMetadata)}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn not in byte_keys:
            continue
        item = f"{os.path.join(folder, info.relative_path)} (item {index.fqn} of {path})"
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(f"{item} is stored transformed "
                                        f"({info.transform_descriptors}): not checked, refused")
        target = os.path.realpath(os.path.join(folder, info.relative_path))
        if os.path.dirname(target) != os.path.realpath(folder):
            raise UnsafeCheckpointError(f"{item} points outside its folder: refused")
        with open(target, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        _check_torch_file(io.BytesIO(data), item, lambda asked: [io.BytesIO, *admit(asked)])
