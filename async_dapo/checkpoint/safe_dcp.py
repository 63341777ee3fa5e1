"""Load a torch.distributed.checkpoint (DCP) directory without running code from it.

torch 2.14's own loader unpickles twice: ``FileSystemReader.read_metadata`` is a bare ``pickle.load`` of
``.metadata`` (or, when that fails, ``__{rank}.metadata``), and ``DefaultLoadPlanner.load_bytes`` reads each
non-tensor entry (the optimizer's lr, betas, eps, ...) with ``torch.load(weights_only=False)``. Either lets a
checkpoint directory someone else wrote run any code in every learner rank. Here:

- the metadata is unpickled by ``_MetadataUnpickler``: ``find_class`` returns only the classes DCP's metadata
  is made of (``_ALLOWED``; anything else is refused before it is called), and every opcode that changes an
  object (BUILD, APPEND(S), SETITEM(S), ADDITEMS) is refused unless that object is one this pickle built: a
  DCP metadata dataclass taking its own fields, a list, a dict, a set. So a refused file has changed nothing
  outside itself (no BUILD sets attributes on an allowed class, function or enum member);
- only regular files are read, each named inside the checkpoint directory: lstat first (a symlink, FIFO,
  device or directory is refused unopened), then opened with O_NOFOLLOW | O_NONBLOCK and fstat'ed again, so
  nothing swapped in between is followed and nothing blocks the resume;
- its size and what it declares are bounded before DCP plans a read (``_check``): at most
  ``_MAX_METADATA_BYTES``; no list longer than ``_MAX_CHUNKS`` (refused while unpickling); per tensor no more
  chunks than data files; no more entries than twice the state being loaded; each entry's bytes inside its
  file, and no file's entries declaring more bytes than it holds; a length field inside the pickle
  allocates no more than the file holds (it is read from memory; BYTEARRAY8, which allocates first, is refused);
- ``__{rank}.metadata`` is read only when ``.metadata`` does not exist: a refused ``.metadata`` stays refused;
- non-tensor entries go through ``torch.load(weights_only=True)`` (torch's maintained allow-list: tensors,
  numbers, strings, tuples, lists, dicts, ...), and all of them are read before any tensor is copied, because
  DCP copies tensors into the model and optimizer in place: a refusal leaves both as they were.

Tensors were already read with ``weights_only=True`` by torch. The files DCP writes are unchanged.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import pickle
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PosixPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING, BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
    TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.serialization import _get_layout

from async_dapo.checkpoint.run_dir import file_kind
from async_dapo.checkpoint.rank_state import CheckpointError

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

# What BUILD may set state on: an instance of one of DCP's metadata dataclasses (which the pickle built: no
# allowed global returns an existing one), and only its own fields. TensorProperties' state is the tuple its
# own __setstate__ takes. BUILD on anything else (an allowed class, _get_layout, an enum member, a path, a
# dtype) would set attributes on an object the whole process shares.
_BUILDABLE: dict[type, frozenset[str]] = {c: frozenset(f.name for f in dataclasses.fields(c)) for c in (
    Metadata, StorageMeta, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
    _StorageInfo)}

# Bounds the parse: the pure-Python unpickler spends ~0.6 us a byte on the cheapest opcodes (busy 2-core
# machine), ~40 s at this size. An honest metadata takes ~140 bytes a chunk: Qwen2.5-32B's ~2,300 sharded
# tensors over 64 ranks (configs/dapo_qwen2.5_32b_16x8.yaml) is 21 MB, parsed here in 9.6 s (C pickle: 4.2 s).
_MAX_METADATA_BYTES = 64 << 20
# DCP writes a tensor as one chunk per rank holding part of it (FSDP2 shards each parameter once per rank);
# 64 times the largest learner here. The chunk list is the longest list a metadata holds, so any longer list
# is refused as it is read, before the rest is parsed (DCP then spends ~0.4 ms planning each chunk).
_MAX_CHUNKS = 4096
# Items gathered between a MARK and the opcode that takes them (pickle writes lists and dicts in batches of
# 1000); checked where a pickle can push an item for one or two bytes (a memo reference, DUP, a global).
_MAX_GATHERED = 2 * _MAX_CHUNKS


def _refuse(op: str, target: Any, why: str) -> pickle.UnpicklingError:
    what = (f"the class {target.__module__}.{target.__qualname__}" if isinstance(target, type)
            else f"a {type(target).__module__}.{type(target).__qualname__}")
    return pickle.UnpicklingError(f"refused {op} on {what}: {why}")


def _stack_bounded(load: Any) -> Any:
    def guarded(self: _MetadataUnpickler) -> None:
        self._bound_stack()
        load(self)
    return guarded


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (the C one cannot be told which opcodes to refuse) with the guards above.
    Nothing it runs before a refusal changes an object that existed before it started (but torch's own
    table of layouts, which _get_layout fills with torch's layouts on first use, as for any torch.load)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        self._bound_stack()
        try:
            return _ALLOWED[(module, name)]
        except KeyError:  # nothing is imported or called for a name that is not listed
            raise pickle.UnpicklingError(f"refused global {module}.{name}: not a DCP metadata class") from None

    def _bound_stack(self) -> None:
        if len(self.stack) >= _MAX_GATHERED:
            raise pickle.UnpicklingError(f"refused: more than {_MAX_GATHERED} items gathered at once")

    def _build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        fields = _BUILDABLE.get(type(inst))
        if type(inst) is TensorProperties:
            if type(state) is not tuple:
                raise _refuse("BUILD", inst, f"its state is a {type(state).__name__}, not a tuple")
        elif fields is None:
            raise _refuse("BUILD", inst, "state is set only on a DCP metadata object this pickle built")
        elif type(state) is not dict or not state.keys() <= fields:
            raise _refuse("BUILD", inst, f"state {sorted(map(repr, state)) if type(state) is dict else state!r} "
                                         f"is not a dict of its fields {sorted(fields)}")
        pickle._Unpickler.load_build(self)

    def _into(self, op: str, target: Any, kind: type) -> None:
        if type(target) is not kind:
            raise _refuse(op, target, f"items go only into a {kind.__name__}")

    def _bound_list(self, target: list) -> None:
        if len(target) > _MAX_CHUNKS:
            raise pickle.UnpicklingError(f"refused: a list of more than {_MAX_CHUNKS} items")

    def _append(self) -> None:
        self._into("APPEND", self.stack[-2], list)
        pickle._Unpickler.load_append(self)
        self._bound_list(self.stack[-1])

    def _appends(self) -> None:  # the target sits under the MARK, on the stack that MARK put aside
        self._into("APPENDS", self.metastack[-1][-1], list)
        pickle._Unpickler.load_appends(self)
        self._bound_list(self.stack[-1])

    def _setitem(self) -> None:
        self._into("SETITEM", self.stack[-3], dict)
        pickle._Unpickler.load_setitem(self)

    def _setitems(self) -> None:
        self._into("SETITEMS", self.metastack[-1][-1], dict)
        pickle._Unpickler.load_setitems(self)

    def _additems(self) -> None:
        self._into("ADDITEMS", self.metastack[-1][-1], set)
        pickle._Unpickler.load_additems(self)

    def _extension(self) -> None:  # copyreg's extension codes fill a cache the whole process shares
        raise pickle.UnpicklingError("refused EXT: extension codes are not DCP metadata")

    def _bytearray(self) -> None:  # the one opcode that allocates its declared length before reading it
        raise pickle.UnpicklingError("refused BYTEARRAY8: a bytearray is not DCP metadata")

    dispatch[pickle.BUILD[0]] = _build
    dispatch[pickle.APPEND[0]] = _append
    dispatch[pickle.APPENDS[0]] = _appends
    dispatch[pickle.SETITEM[0]] = _setitem
    dispatch[pickle.SETITEMS[0]] = _setitems
    dispatch[pickle.ADDITEMS[0]] = _additems
    for _op in (pickle.DUP, pickle.GET, pickle.BINGET, pickle.LONG_BINGET):
        dispatch[_op[0]] = _stack_bounded(pickle._Unpickler.dispatch[_op[0]])
    for _op in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = _extension
    dispatch[pickle.BYTEARRAY8[0]] = _bytearray
    del _op


def read_metadata_file(path: Path, max_entries: int | None = None) -> Metadata:
    """The DCP ``Metadata`` in ``path``, unpickled with only DCP's own classes and bounded as the module says
    (``max_entries``: the most entries it may declare). A missing file raises FileNotFoundError (DCP then
    tries its fallback); anything else unusable raises CheckpointError."""
    try:
        with _open_regular(path) as f:
            if os.fstat(f.fileno()).st_size > _MAX_METADATA_BYTES:
                raise CheckpointError(f"{path}: larger than {_MAX_METADATA_BYTES} bytes, not read")
            data = f.read(_MAX_METADATA_BYTES + 1)  # bounded even if it grows after the fstat
    except (CheckpointError, FileNotFoundError):
        raise
    except OSError as e:  # unreadable is refused, not worked around with the fallback
        raise CheckpointError(f"{path}: cannot be read: {e}") from e
    if len(data) > _MAX_METADATA_BYTES:
        raise CheckpointError(f"{path}: larger than {_MAX_METADATA_BYTES} bytes, not read")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # a refused global or opcode, a truncated stream, a constructor given bad arguments
        detail = str(e) or ("the file ends before the pickle does" if isinstance(e, EOFError) else "")
        raise CheckpointError(f"{path}: not loaded, nothing in it was run: {type(e).__name__}: {detail}") from e
    _check(path, metadata, max_entries)
    return metadata


def _check(path: Path, metadata: Any, max_entries: int | None) -> None:
    """Only allowed classes were built, but not necessarily in DCP's shape. Counts first (each a len()), so a
    metadata declaring too much is refused before anything is iterated; then where each entry's bytes are
    (``_check_entry``)."""
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
    if not (metadata.storage_meta is None or isinstance(metadata.storage_meta, StorageMeta)):
        raise CheckpointError(f"{path}: storage_meta is a {type(metadata.storage_meta).__name__}")
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    for field, value in (("state_dict_metadata", entries), ("storage_data", storage)):
        if type(value) is not dict:
            raise CheckpointError(f"{path}: {field} is a {type(value).__name__}, not a dict")
    if max_entries is not None and len(entries) > max_entries:
        raise CheckpointError(f"{path}: declares {len(entries)} entries, more than the {max_entries} the state "
                              f"being loaded allows")
    chunks = {fqn: _chunk_count(path, fqn, md) for fqn, md in entries.items()}
    if len(storage) > sum(chunks.values()):  # DCP stores one entry per chunk or non-tensor value
        raise CheckpointError(f"{path}: {len(storage)} storage entries for {sum(chunks.values())} declared "
                              f"chunks and values")
    files: dict[str, list[int]] = {}
    for index, info in storage.items():
        _check_entry(path, getattr(index, "fqn", index), info, files)
    fqn = max(chunks, key=chunks.__getitem__, default=None)
    if fqn is not None and chunks[fqn] > len(files):
        raise CheckpointError(f"{path}: {fqn!r} declares {chunks[fqn]} chunks, more than the {len(files)} data "
                              f"files it names (DCP writes a tensor as one chunk per rank, each rank to its file)")


def _chunk_count(path: Path, fqn: Any, md: Any) -> int:
    if isinstance(md, BytesStorageMetadata):
        return 1
    if not (isinstance(md, TensorStorageMetadata) and type(md.chunks) is list):
        raise CheckpointError(f"{path}: entry {fqn!r} is a {type(md).__name__}, not a tensor's or value's metadata")
    if len(md.chunks) > _MAX_CHUNKS:  # already refused while unpickling; kept here beside the other counts
        raise CheckpointError(f"{path}: {fqn!r} declares {len(md.chunks)} chunks, more than {_MAX_CHUNKS}")
    return len(md.chunks)


def _check_entry(path: Path, fqn: Any, info: Any, files: dict[str, list[int]]) -> None:
    """A data file named ``../x`` or ``/x`` would make DCP read a file outside the checkpoint directory; a
    declared length is allocated before it is read (a non-tensor entry's ``read(length)``), so it must fit
    the file, and the entries of one file may not declare more bytes than it holds (DCP writes each once),
    which bounds what a load reads; a stream transform (DCP's only one is zstd) could expand a small entry
    without bound — this project's dcp.save never writes one. ``files``: name -> [size, bytes declared]."""
    name = getattr(info, "relative_path", None)
    if not isinstance(info, _StorageInfo) or not _is_plain_name(name):
        raise CheckpointError(f"{path}: data file {name!r} is not a file name inside the checkpoint directory")
    if name not in files:
        files[name] = [_data_file_size(path, path.parent / name), 0]
    size = files[name][0]
    if not (_is_count(info.offset) and _is_count(info.length) and info.offset + info.length <= size):
        raise CheckpointError(f"{path}: {fqn!r} claims bytes {info.offset!r}+{info.length!r} of {name} "
                              f"({size} bytes)")
    files[name][1] += info.length
    if files[name][1] > size:
        raise CheckpointError(f"{path}: its entries in {name} declare more bytes than its {size}")
    if info.transform_descriptors:
        raise CheckpointError(f"{path}: {fqn!r} is stored through stream transforms "
                              f"{info.transform_descriptors!r}, which are not accepted")


def _data_file_size(path: Path, data_file: Path) -> int:
    try:
        return _regular_size(data_file)
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"{path}: its data file {data_file} cannot be read: {e}") from e


def _is_count(n: Any) -> bool:
    return type(n) is int and n >= 0


def _is_plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and not {"/", "\\", "\0"} & set(name)


def _not_regular(file: Path, mode: int) -> CheckpointError:
    kind = file_kind(mode, "of an unknown kind")
    return CheckpointError(f"{file}: is {kind}, not a regular file; only regular files in the checkpoint "
                           f"directory are read")


def _regular_size(file: Path) -> int:
    """The size of ``file`` if it is a regular file itself (lstat: a symlink is not followed); OSError (e.g.
    FileNotFoundError) passes."""
    mode_size = os.lstat(file)
    if not stat.S_ISREG(mode_size.st_mode):
        raise _not_regular(file, mode_size.st_mode)
    return mode_size.st_size


def _open_regular(file: Path) -> io.BufferedReader:
    """``file`` opened for reading, only if it is a regular file: refused unopened after an lstat (opening a
    device can act on it), then opened without following a symlink and without waiting (a FIFO opened
    O_NONBLOCK returns at once; reads of a regular file ignore the flag) and fstat'ed, since it may have been
    swapped since the lstat."""
    _regular_size(file)
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _not_regular(file, stat.S_IFLNK) from e
        raise
    f = open(fd, "rb")
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        f.close()
        raise _not_regular(file, mode)
    return f


class _RegularFiles(FileSystem):
    """DCP's file access, every file opened by ``_open_regular``: torch's ``read_data`` opens the data files
    through ``create_stream``."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            raise CheckpointError(f"{path}: opened for {mode!r}; a checkpoint is only read")
        with _open_regular(Path(path)) as f:
            yield f


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` with the metadata unpickled by ``read_metadata_file`` (at most ``max_entries``
    entries) and only regular files opened; ``refusal`` keeps the first refusal, which DCP would otherwise
    bury in a traceback text."""

    def __init__(self, path: str | Path, max_entries: int | None = None) -> None:
        super().__init__(path)
        self.fs = _RegularFiles()
        self.max_entries = max_entries
        self.refusal: CheckpointError | None = None

    # The parameter must be called kwargs: DCP calls read_metadata(rank=r) only if its signature has one.
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is not None and self.refusal is not None:
            raise self.refusal  # DCP's fallback after a refused .metadata: that file decides, not another one
        try:
            metadata = read_metadata_file(Path(self._get_metadata_path(rank)), self.max_entries)
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

        try:
            super().read_data(only(True), planner)
            return super().read_data(only(False), planner)
        except CheckpointError as e:  # a data file swapped for a non-regular one since the metadata's check
            self.refusal = self.refusal or e
            raise


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
    # DCP plans with the state flattened the same way; an honest checkpoint of it declares exactly these entries.
    expected = len(flatten_state_dict(state_dict)[0])
    reader, planner = SafeFileSystemReader(path, max_entries=2 * expected + 16), SafeLoadPlanner(path)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner)
    except CheckpointException as e:
        refusal = reader.refusal or planner.refusal
        if refusal is None:
            raise
        raise refusal from e
