"""async_dapo.safe_dcp: a DCP checkpoint (written by torch's own dcp.save, one process) loads back exactly, and a
file crafted to run code when unpickled — the metadata, its per-rank fallback, or a non-tensor entry — is
refused naming the file, without running it (the payload writes a marker file) and before any tensor of the
target state dict is overwritten. So are metadata that would make DCP read outside the checkpoint directory
or allocate more than a file holds."""

import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from async_dapo import safe_dcp
from async_dapo.rank_state import CheckpointError
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
