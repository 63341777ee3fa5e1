"""async_dapo.checkpoint.safe_dcp: a DCP checkpoint (written by torch's own dcp.save, one process) loads back exactly, and a
file crafted to run code when unpickled — the metadata, its per-rank fallback, or a non-tensor entry — is
refused naming the file, without running it (the payload writes a marker file) and before any tensor of the
target state dict is overwritten. So are metadata that would make DCP read outside the checkpoint directory
or allocate more than a file holds; a metadata that sets state on an object the process shares (a class, a
function, an enum member), which changes nothing; a file that is not a regular one (a symlink, FIFO, device
or directory), which is refused without blocking; and metadata declaring more than the bounds allow
(a million chunks is refused in milliseconds)."""

import os
import pathlib
import pickle
import shutil
import stat
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, BytesStorageMetadata

from async_dapo.checkpoint import safe_dcp
from async_dapo.checkpoint.rank_state import CheckpointError
from tests.unit.test_rank_state import RunsCode


def state(w: torch.Tensor, lr) -> dict:
    """Shaped like the learner's: a tensor, and an optimizer whose param_groups DCP stores as pickled bytes."""
    return {"model": {"w": w}, "optim": {"param_groups": [{"lr": lr, "betas": (0.9, 0.999), "params": ["w"]}]}}


SAVED = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "step_1"
    dcp.save(state(SAVED, 0.25), checkpoint_id=path)
    return path


def target() -> dict:
    return state(torch.full((2, 3), -1.0), 9.0)


def assert_untouched(t: dict) -> None:
    assert torch.equal(t["model"]["w"], torch.full((2, 3), -1.0)) and t["optim"]["param_groups"][0]["lr"] == 9.0


def test_a_checkpoint_loads_back_exactly(ckpt):
    t = target()
    safe_dcp.load(t, ckpt)
    assert torch.equal(t["model"]["w"], SAVED)
    assert t["optim"]["param_groups"] == [{"lr": 0.25, "betas": (0.9, 0.999), "params": ["w"]}]


def test_the_metadata_is_read_as_pickle_reads_it_using_only_listed_classes(ckpt):
    seen = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(ckpt / ".metadata", "rb") as f:
        plain = Recording(f).load()
    assert safe_dcp.read_metadata_file(ckpt / ".metadata") == plain  # dataclass equality: every field
    assert seen <= safe_dcp._ALLOWED.keys()
    assert ("torch", "float32") in seen and ("torch.distributed.checkpoint.metadata", "Metadata") in seen


def hostile_metadata(ckpt, marker, name: str) -> None:
    (ckpt / name).write_bytes(pickle.dumps(RunsCode(marker)))  # DCP writes its metadata with pickle.dump


@pytest.mark.parametrize("layout", ["global", "rank fallback", "global beside a good fallback"])
def test_a_metadata_file_that_runs_code_is_refused_unrun(ckpt, tmp_path, layout):
    marker = tmp_path / "ran"
    if layout == "rank fallback":  # DCP reads __{rank}.metadata only when .metadata cannot be read
        (ckpt / ".metadata").unlink()
        hostile_metadata(ckpt, marker, "__0.metadata")
        refused = ckpt / "__0.metadata"
    else:
        if layout == "global beside a good fallback":  # a refused .metadata is not worked around
            shutil.copy(ckpt / ".metadata", ckpt / "__0.metadata")
        hostile_metadata(ckpt, marker, ".metadata")
        refused = ckpt / ".metadata"
    t = target()
    with pytest.raises(CheckpointError) as e:
        safe_dcp.load(t, ckpt)
    assert str(e.value).startswith(f"{refused}: not loaded, nothing in it was run")
    assert "refused global builtins.exec" in str(e.value)
    assert not marker.exists()
    assert_untouched(t)


def test_a_non_tensor_entry_that_runs_code_is_refused_before_any_tensor_is_copied(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "step_1"
    dcp.save(state(SAVED, RunsCode(marker)), checkpoint_id=path)  # torch.save pickles it; nothing runs yet
    t = target()
    with pytest.raises(CheckpointError) as e:
        safe_dcp.load(t, path)
    assert str(e.value).startswith(f"{path / '__0_0.distcp'}: entry 'optim.param_groups.0.lr' not loaded")
    assert str(e.value).endswith(": UnpicklingError: Unsupported global: GLOBAL exec was not an allowed global "
                                 "by default.")  # torch's own weights_only refusal, its advice cut off
    assert not marker.exists()
    assert_untouched(t)  # "w" comes first in the plan: without bytes-first reading it would be overwritten


def rewrite_metadata(ckpt, edit) -> None:
    """Edits this test's own (trusted) metadata and writes it back with pickle, as DCP does."""
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)
    for info in md.storage_data.values():
        edit(info)
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)


@pytest.mark.parametrize("where", ["../outside.distcp", "ABS"])
def test_a_data_file_outside_the_checkpoint_directory_is_refused(ckpt, tmp_path, where):
    outside = tmp_path / "outside.distcp"
    shutil.copy(ckpt / "__0_0.distcp", outside)  # loadable, so only the name can be the reason
    name = str(outside) if where == "ABS" else where
    rewrite_metadata(ckpt, lambda info: setattr(info, "relative_path", name))
    t = target()
    with pytest.raises(CheckpointError, match=f"^{ckpt / '.metadata'}: data file '{name}' is not a file name"):
        safe_dcp.load(t, ckpt)
    assert_untouched(t)


def test_a_declared_length_past_the_end_of_its_file_is_refused_before_anything_is_read(ckpt):
    size = (ckpt / "__0_0.distcp").stat().st_size
    rewrite_metadata(ckpt, lambda info: setattr(info, "length", 1 << 40))  # torch would read(1 TiB)
    t = target()
    with pytest.raises(CheckpointError, match=rf"claims bytes \d+\+1099511627776 of __0_0.distcp \({size} bytes\)"):
        safe_dcp.load(t, ckpt)
    assert_untouched(t)


def test_an_entry_stored_through_a_stream_transform_is_refused(ckpt):
    """DCP's one transform is zstd: a small compressed entry can expand to any size when read."""
    rewrite_metadata(ckpt, lambda info: setattr(info, "transform_descriptors", ["stream.zstd/1"]))
    t = target()
    with pytest.raises(CheckpointError, match=r"is stored through stream transforms \['stream.zstd/1'\]"):
        safe_dcp.load(t, ckpt)
    assert_untouched(t)


def test_allowed_classes_in_another_shape_are_refused(ckpt):
    (ckpt / ".metadata").write_bytes(pickle.dumps(torch.Size([3])))
    with pytest.raises(CheckpointError, match=f"^{ckpt / '.metadata'}: holds a Size, not DCP Metadata"):
        safe_dcp.load(target(), ckpt)


# ---------------------------------------------------------------- BUILD only on what the pickle built

def text(s: str) -> bytes:
    data = s.encode()
    return pickle.BINUNICODE + len(data).to_bytes(4, "little") + data


def glob(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


LAYOUT = glob("torch.serialization", "_get_layout")
# Each: opcodes pushing an object every process shares (all allowed globals, or made from them), and a BUILD
# state that would set an attribute on it. The C unpickler applies it before anything can check the result.
SHARED = {
    "an allowed class": (  # slot state: setattr(PosixPath, "__fspath__", _get_layout), for every path
        lambda: pathlib.PosixPath, glob("pathlib", "PosixPath"),
        pickle.NONE + pickle.EMPTY_DICT + text("__fspath__") + LAYOUT + pickle.SETITEM + pickle.TUPLE2,
        "the class pathlib.PosixPath"),
    "an allowed function": (  # its __dict__: torch.load would then build every strided tensor as sparse
        lambda: torch.serialization._get_layout, LAYOUT,
        pickle.EMPTY_DICT + text("cache") + pickle.EMPTY_DICT + text("torch.strided") + LAYOUT
        + text("torch.sparse_coo") + pickle.TUPLE1 + pickle.REDUCE + pickle.SETITEM + pickle.SETITEM,
        "a builtins.function"),
    "an enum member": (  # REDUCE returns the member itself: its value would change for every TensorProperties
        lambda: _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT,
        glob(_MEM_FORMAT_ENCODING.__module__, "_MEM_FORMAT_ENCODING") + pickle.BININT1 + b"\0" + pickle.TUPLE1
        + pickle.REDUCE,
        pickle.EMPTY_DICT + text("_value_") + pickle.BININT1 + b"\2" + pickle.SETITEM,
        f"a {_MEM_FORMAT_ENCODING.__module__}._MEM_FORMAT_ENCODING"),
}


@pytest.mark.parametrize("shared", SHARED)
def test_a_build_on_a_shared_object_is_refused_and_changes_nothing(ckpt, shared):
    obj, push, state, named = SHARED[shared]
    before = dict(vars(obj()))
    (ckpt / ".metadata").write_bytes(pickle.PROTO + b"\2" + push + state + pickle.BUILD + pickle.STOP)
    t = target()
    try:
        with pytest.raises(CheckpointError) as e:
            safe_dcp.load(t, ckpt)
        after = dict(vars(obj()))
        assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    finally:  # a regression must not leave the class, function or member patched for the other tests
        for k in set(vars(obj())) - set(before):
            delattr(obj(), k)
        for k, v in before.items():
            if vars(obj()).get(k) is not v:
                setattr(obj(), k, v) if isinstance(obj(), type) else vars(obj()).__setitem__(k, v)
    assert str(e.value).startswith(f"{ckpt / '.metadata'}: not loaded, nothing in it was run: UnpicklingError: "
                                   f"refused BUILD on {named}: state is set only on a DCP metadata object")
    assert_untouched(t)


def test_a_build_setting_more_than_a_dataclass_field_is_refused(ckpt):
    rewrite_metadata(ckpt, lambda info: setattr(info, "read", 0))  # an instance attribute beside the fields
    with pytest.raises(CheckpointError, match=r"refused BUILD on a torch\.distributed\.checkpoint\.filesystem\."
                                              r"_StorageInfo: state \[.*'read'.*\] is not a dict of its fields"):
        safe_dcp.load(target(), ckpt)


# ---------------------------------------------------------------- regular files only

def make(kind: str, where, good) -> None:
    """Replaces ``where`` by a ``kind`` (``good``: a regular file with the right content, outside the
    directory, for a symlink to point at)."""
    where.unlink()
    if kind == "symlink":
        where.symlink_to(good)
    elif kind == "FIFO":
        os.mkfifo(where)
    elif kind == "directory":
        where.mkdir()
    else:  # a character device: /dev/null's numbers
        try:
            os.mknod(where, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("mknod is not permitted here")


KINDS = {"symlink": "a symbolic link", "FIFO": "a FIFO", "directory": "a directory",
         "device": "a character device"}


def load_in_a_thread(t, ckpt, fifo=None):
    """safe_dcp.load's outcome, or a failure if it is still waiting after 10 s (a FIFO opened without
    O_NONBLOCK waits for a writer: then one is opened, so the thread ends)."""
    outcome = []

    def run():
        try:
            safe_dcp.load(t, ckpt)
            outcome.append(None)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail(f"load still blocked on {fifo} after 10 s")
    return outcome[0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_only_regular_files_are_read_and_a_fifo_does_not_block(ckpt, tmp_path, kind, name):
    good = tmp_path / name
    shutil.copy(ckpt / name, good)  # the same bytes: only what the file is can be the reason
    make(kind, ckpt / name, good)
    t = target()
    refused = load_in_a_thread(t, ckpt, fifo=ckpt / name if kind == "FIFO" else None)
    assert isinstance(refused, CheckpointError), refused
    assert str(refused) == (f"{ckpt / name}: is {KINDS[kind]}, not a regular file; only regular files in the "
                            f"checkpoint directory are read")
    assert_untouched(t)


@pytest.mark.parametrize("kind", ["symlink", "FIFO"])
def test_a_data_file_swapped_after_the_metadata_check_is_not_followed(ckpt, tmp_path, kind, monkeypatch):
    """What the reader opens is checked again once open (O_NOFOLLOW, O_NONBLOCK, fstat): here the first
    check, an lstat, is made to pass, as if the file were swapped just after it."""
    good = tmp_path / "__0_0.distcp"
    shutil.copy(ckpt / "__0_0.distcp", good)
    monkeypatch.setattr(safe_dcp, "_regular_size", lambda file: good.stat().st_size)
    make(kind, ckpt / "__0_0.distcp", good)
    t = target()
    refused = load_in_a_thread(t, ckpt, fifo=ckpt / "__0_0.distcp" if kind == "FIFO" else None)
    assert isinstance(refused, CheckpointError), refused
    assert str(refused).startswith(f"{ckpt / '__0_0.distcp'}: is {KINDS[kind]}, not a regular file")
    assert_untouched(t)


# ---------------------------------------------------------------- bounds on what the metadata declares

def with_chunks(ckpt, n: int, pickler=pickle.Pickler) -> None:
    """model.w declares ``n`` chunks: one object referenced n times, so the file stays small (~2 bytes each)."""
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.state_dict_metadata["model.w"].chunks *= n
    with open(ckpt / ".metadata", "wb") as f:
        pickler(f, protocol=4).dump(md)


class OneBatch(pickle._Pickler):
    """Writes a list's items all on the stack before the list takes them (pickle writes 1000 at a time)."""
    _BATCHSIZE = 10**7


@pytest.mark.parametrize("batches", ["as pickle writes it", "in one batch"])
def test_a_million_chunks_are_refused_in_well_under_a_second(ckpt, batches):
    """DCP plans each declared chunk (~0.4 ms): unbounded, this one would hold the resume ~7 minutes."""
    with_chunks(ckpt, 10**6, OneBatch if batches == "in one batch" else pickle.Pickler)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError) as e:
        safe_dcp.read_metadata_file(ckpt / ".metadata")
    assert time.perf_counter() - t0 < 0.5
    reason = ("a list of more than 4096 items" if batches == "as pickle writes it"
              else "more than 8192 items gathered at once")
    assert str(e.value) == (f"{ckpt / '.metadata'}: not loaded, nothing in it was run: UnpicklingError: "
                            f"refused: {reason}")


def test_more_chunks_of_a_tensor_than_data_files_are_refused(ckpt):
    with_chunks(ckpt, 2)  # one rank wrote this checkpoint: one chunk per tensor
    t = target()
    with pytest.raises(CheckpointError, match=f"^{ckpt / '.metadata'}: 'model.w' declares 2 chunks, more than "
                                              f"the 1 data files it names"):
        safe_dcp.load(t, ckpt)
    assert_untouched(t)


def test_more_entries_than_twice_the_state_are_refused(ckpt):
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.state_dict_metadata |= {f"extra.{i}": BytesStorageMetadata() for i in range(21)}  # 4 + 21 > 2 * 4 + 16
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    t = target()
    with pytest.raises(CheckpointError, match=f"^{ckpt / '.metadata'}: declares 25 entries, more than the 24 "
                                              f"the state being loaded allows$"):
        safe_dcp.load(t, ckpt)
    assert_untouched(t)


def test_entries_declaring_more_bytes_than_their_file_holds_are_refused(ckpt):
    """Each entry fits the file, but together they would read it several times over."""
    size = (ckpt / "__0_0.distcp").stat().st_size
    rewrite_metadata(ckpt, lambda info: (setattr(info, "offset", 0), setattr(info, "length", size)))
    t = target()
    with pytest.raises(CheckpointError, match=f"^{ckpt / '.metadata'}: its entries in __0_0.distcp declare more "
                                              f"bytes than its {size}$"):
        safe_dcp.load(t, ckpt)
    assert_untouched(t)


def test_a_metadata_file_over_the_size_bound_is_refused_unread(ckpt):
    with open(ckpt / ".metadata", "r+b") as f:
        f.truncate((64 << 20) + 1)  # sparse: nothing is written, and nothing should be read
    t = target()
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=f"^{ckpt / '.metadata'}: larger than 67108864 bytes, not read$"):
        safe_dcp.load(t, ckpt)
    assert time.perf_counter() - t0 < 0.5
    assert_untouched(t)


@pytest.mark.parametrize("opcode", ["BINBYTES8", "BYTEARRAY8"])
def test_a_declared_length_in_the_pickle_allocates_nothing(ckpt, opcode):
    """1 TiB declared in a 20-byte file: read, it is as long as the file; BYTEARRAY8 (a bytearray of the
    declared length first, then filled) is refused."""
    (ckpt / ".metadata").write_bytes(pickle.PROTO + b"\5" + getattr(pickle, opcode) + (1 << 40).to_bytes(8, "little")
                                     + pickle.STOP)
    reason = {"BINBYTES8": "EOFError: the file ends before the pickle does",
              "BYTEARRAY8": "UnpicklingError: refused BYTEARRAY8: a bytearray is not DCP metadata"}[opcode]
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError) as e:
        safe_dcp.load(target(), ckpt)
    assert time.perf_counter() - t0 < 0.5
    assert str(e.value) == f"{ckpt / '.metadata'}: not loaded, nothing in it was run: {reason}"
