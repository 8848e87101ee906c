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
"""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any, Iterable, Optional

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
