"""Load a torch.distributed.checkpoint (DCP) directory without running code from it.

torch 2.14's own loader unpickles twice: ``FileSystemReader.read_metadata`` is a bare ``pickle.load`` of
``.metadata`` (or, when that fails, ``__{rank}.metadata``), and ``DefaultLoadPlanner.load_bytes`` reads each
non-tensor entry (the optimizer's lr, betas, eps, ...) with ``torch.load(weights_only=False)``. Either lets a
checkpoint directory someone else wrote run any code in every learner rank. Here:

- the metadata is unpickled by an ``Unpickler`` whose ``find_class`` returns only the classes DCP's metadata
  is made of (``_ALLOWED``; anything else is refused before it is called), and the result is checked to be a
  ``Metadata`` whose data files all lie inside the checkpoint directory;
- ``__{rank}.metadata`` is read only when ``.metadata`` does not exist: a refused ``.metadata`` stays refused;
- non-tensor entries go through ``torch.load(weights_only=True)`` (torch's maintained allow-list: tensors,
  numbers, strings, tuples, lists, dicts, ...), and all of them are read before any tensor is copied, because
  DCP copies tensors into the model and optimizer in place: a refusal leaves both as they were.

Tensors were already read with ``weights_only=True`` by torch. The files DCP writes are unchanged.
"""

from __future__ import annotations

import dataclasses
import pickle
import re
from pathlib import Path, PosixPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING, BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
    TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.distributed.checkpoint._traverse import set_element
from torch.serialization import _get_layout

from async_dapo.rank_state import CheckpointError

# Every global a DCP metadata pickle of this torch references (pickletools on a learner checkpoint; they are
# the types of metadata.py's dataclass fields), keyed as pickle names them: (__module__, __qualname__).
# torch.serialization._get_layout is how torch pickles a torch.layout (copyreg: _get_layout("torch.strided"));
# TensorProperties stores memory_format as _MEM_FORMAT_ENCODING, since torch.memory_format cannot be pickled;
# PosixPath is StorageMeta.checkpoint_id. Each is a plain constructor or a table lookup.
_ALLOWED: dict[tuple[str, str], Any] = {(c.__module__, c.__qualname__): c for c in (
    Metadata, StorageMeta, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
    _MEM_FORMAT_ENCODING, MetadataIndex, _StorageInfo, torch.Size, _get_layout, PosixPath)}
# A dtype pickles as the global torch.<name> (its __reduce__ returns the name). Taken from torch's namespace
# once, rather than getattr(torch, name) per request: torch's module __getattr__ imports submodules.
_ALLOWED |= {("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:  # nothing is imported or called for a name that is not listed
            raise pickle.UnpicklingError(f"refused global {module}.{name}: not a DCP metadata class") from None


def read_metadata_file(path: Path) -> Metadata:
    """The DCP ``Metadata`` in ``path``, unpickled with only DCP's own classes. A missing file raises
    FileNotFoundError (DCP then tries its fallback); anything else unusable raises CheckpointError."""
    with open(path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except Exception as e:  # a refused global, a truncated stream, a constructor given bad arguments
            raise CheckpointError(f"{path}: not loaded, nothing in it was run: {type(e).__name__}: {e}") from e
    _check(path, metadata)
    return metadata


def _check(path: Path, metadata: Any) -> None:
    """Only allowed classes were built, but not necessarily in DCP's shape; and where each entry's bytes are
    is checked beyond what DCP checks (``_check_entry``)."""
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
    if not (metadata.storage_meta is None or isinstance(metadata.storage_meta, StorageMeta)):
        raise CheckpointError(f"{path}: storage_meta is a {type(metadata.storage_meta).__name__}")
    if not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{path}: storage_data is a {type(metadata.storage_data).__name__}, not a dict")
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        _check_entry(path, getattr(index, "fqn", index), info, sizes)


def _check_entry(path: Path, fqn: Any, info: Any, sizes: dict[str, int]) -> None:
    """A data file named ``../x`` or ``/x`` would make DCP read a file outside the checkpoint directory; a
    declared length is allocated before it is read (a non-tensor entry's ``read(length)``), so it must fit
    the file; and a stream transform (DCP's only one is zstd) could expand a small entry without bound —
    this project's dcp.save never writes one."""
    name = getattr(info, "relative_path", None)
    if not isinstance(info, _StorageInfo) or not _is_plain_name(name):
        raise CheckpointError(f"{path}: data file {name!r} is not a file name inside the checkpoint directory")
    if name not in sizes:
        sizes[name] = _size(path, path.parent / name)
    if not (_is_count(info.offset) and _is_count(info.length) and info.offset + info.length <= sizes[name]):
        raise CheckpointError(f"{path}: {fqn!r} claims bytes {info.offset!r}+{info.length!r} of {name} "
                              f"({sizes[name]} bytes)")
    if info.transform_descriptors:
        raise CheckpointError(f"{path}: {fqn!r} is stored through stream transforms "
                              f"{info.transform_descriptors!r}, which are not accepted")


def _size(path: Path, data_file: Path) -> int:
    try:
        return data_file.stat().st_size
    except OSError as e:
        raise CheckpointError(f"{path}: its data file {data_file} cannot be read: {e}") from e


def _is_count(n: Any) -> bool:
    return type(n) is int and n >= 0


def _is_plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and not {"/", "\\", "\0"} & set(name)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` with the metadata unpickled by ``read_metadata_file``; ``refusal`` keeps the
    first refusal, which DCP would otherwise bury in a traceback text."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.refusal: CheckpointError | None = None

    # The parameter must be called kwargs: DCP calls read_metadata(rank=r) only if its signature has one.
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is not None and self.refusal is not None:
            raise self.refusal  # DCP's fallback after a refused .metadata: that file decides, not another one
        try:
            metadata = read_metadata_file(Path(self._get_metadata_path(rank)))
        except CheckpointError as e:
            self.refusal = e
            raise
        if metadata.storage_meta is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: Any) -> Any:
        # Non-tensor entries first: DCP copies tensors into the live model and optimizer as it reads them,
        # so a hostile entry refused after them would leave both half-overwritten. (torch reads them in plan
        # order, file by file; its read_data finishes before returning.)
        def only(byte_io: bool) -> LoadPlan:
            return dataclasses.replace(plan, items=[
                i for i in plan.items if (i.type == LoadItemType.BYTE_IO) == byte_io])

        super().read_data(only(True), planner)
        return super().read_data(only(False), planner)


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor entries are read with ``weights_only=True``; ``path`` (the
    checkpoint directory) names the file in a refusal, which ``refusal`` keeps."""

    def __init__(self, path: str | Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = Path(path)
        self.refusal: CheckpointError | None = None

    def load_bytes(self, read_item: Any, value: Any) -> None:
        obj = self._parse(read_item, value)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:  # the two branches of DefaultLoadPlanner.load_bytes, minus its torch.load
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    def _parse(self, read_item: Any, value: Any) -> Any:
        try:
            return torch.load(value, weights_only=True)
        except Exception as e:  # weights_only refuses a global it does not know before calling it
            file = self.path / self.metadata.storage_data[read_item.storage_index].relative_path
            self.refusal = CheckpointError(f"{file}: entry {read_item.dest_index.fqn!r} not loaded, nothing in "
                                           f"it was run: {type(e).__name__}: {_reason(e)}")
            raise self.refusal from e


def _reason(e: Exception) -> str:
    """torch's weights_only refusal, without its advice to load with weights_only=False or to allow-list the
    global: the sentence naming the global."""
    found = re.search(r"WeightsUnpickler error: (.*?\.)(?: |$)", str(e), re.MULTILINE)
    return found.group(1) if found else str(e)


def load(state_dict: dict[str, Any], path: str | Path) -> None:
    """``dcp.load`` of ``path`` into ``state_dict`` (in place) through the two classes above. A refusal on
    this rank is raised as the CheckpointError naming the file, not as DCP's CheckpointException (a
    BaseException whose message is a traceback text)."""
    reader, planner = SafeFileSystemReader(path), SafeLoadPlanner(path)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner)
    except CheckpointException as e:
        refusal = reader.refusal or planner.refusal
        if refusal is None:
            raise
        raise refusal from e
