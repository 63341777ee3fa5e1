"""A real learner rank (in this process: one rank over gloo, no Ray) resumes from its own checkpoint exactly,
and refuses a checkpoint file that would run code when read, without running it and before touching its
weights or optimizer: a pickled rank state, and DCP's own pickles (the metadata, its per-rank fallback, a
non-tensor entry in the .distcp).

Each payload writes a marker file: before the rank state became JSON, load_checkpoint unpickled
extra_rank0.pt with weights_only=False, and until async_dapo.checkpoint.safe_dcp it loaded DCP's files with torch's
own reader and planner, which unpickle the metadata and the non-tensor entries unrestricted; the marker
appeared."""

import io
import pickle
import random
import re
import shutil

import pytest
import torch

from async_dapo.config import load_config
from async_dapo.checkpoint.rank_state import CheckpointError
from async_dapo.weights.sync import free_port
from tests.conftest import CPU_CONFIG
from tests.integration.test_learner import make_groups

pytestmark = pytest.mark.integration


class RunsCode:
    """Unpickling this calls exec: what a hostile checkpoint file would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


@pytest.fixture(scope="module")
def worker(tiny_model):
    from async_dapo.learner.rank import LearnerWorker

    cfg = load_config(CPU_CONFIG, [
        f"model.path={tiny_model}", "algorithm.train_batch_groups=4", "learner.mini_batch_groups=2",
        "learner.micro_batch_tokens=64", "rollout.n=4", "learner.lr=1e-3", "learner.warmup_steps=3",
    ])
    w = LearnerWorker(cfg, 0, 1, "127.0.0.1", free_port())
    yield w
    w.shutdown()


@pytest.fixture(scope="module")
def checkpoint(worker, tmp_path_factory):
    """A checkpoint after one step (warm-up under way, a skipped update counted, both RNGs moved on),
    and everything it should restore."""
    worker.train_step(make_groups(4, 4, seed=2))
    worker.skipped_updates = 3  # a value no fresh rank has
    torch.rand(11), random.random()
    path = tmp_path_factory.mktemp("ckpt") / "step_1"
    worker.save_checkpoint(str(path))
    saved = {"weights": weights(worker), "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
             "scheduler": worker.scheduler.state_dict(), "lr": worker.scheduler.get_last_lr()}
    worker.train_step(make_groups(4, 4, seed=3))  # everything moves on past the checkpoint
    return path, saved


def weights(worker) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor().clone() for n, p in worker.model.named_parameters()}


def test_the_checkpoint_holds_dcp_files_and_a_json_rank_state(checkpoint):
    path, _ = checkpoint
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "extra_rank0.json"]


def test_resume_restores_weights_rng_states_schedule_and_counters(worker, checkpoint):
    path, saved = checkpoint
    torch.rand(5), random.random()
    assert any(not torch.equal(saved["weights"][n], w) for n, w in weights(worker).items())
    assert worker.load_checkpoint(str(path)) == 1
    assert (worker.version, worker.skipped_updates) == (1, 3)
    got = weights(worker)
    assert all(torch.equal(saved["weights"][n], got[n]) for n in got)
    assert torch.equal(torch.get_rng_state(), saved["torch_rng"]) and random.getstate() == saved["python_rng"]
    assert worker.scheduler.state_dict() == saved["scheduler"]
    assert worker.scheduler.get_last_lr() == saved["lr"] == [1e-3 / 3]  # step 1 of a 3-step warm-up


def test_a_pickled_rank_state_is_refused_unrun_and_the_weights_are_untouched(worker, checkpoint, tmp_path):
    path, _ = checkpoint
    hostile = tmp_path / "step_1"
    shutil.copytree(path, hostile)
    (hostile / "extra_rank0.json").unlink(missing_ok=True)
    marker = tmp_path / "ran"
    torch.save(RunsCode(marker), hostile / "extra_rank0.pt")  # where the old loader looked
    worker.train_step(make_groups(4, 4, seed=4))
    before = weights(worker), worker.version
    with pytest.raises(ValueError, match=r"extra_rank0\.json: missing; extra_rank0\.pt .* not loaded"):
        worker.load_checkpoint(str(hostile))
    assert not marker.exists()
    after = weights(worker)
    assert all(torch.equal(before[0][n], after[n]) for n in after) and worker.version == before[1]


def optimizer_state(worker) -> dict:
    sd = worker.optimizer.state_dict()
    local = {i: {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in st.items()}
             for i, st in sd["state"].items()}
    return {"state": local, "param_groups": sd["param_groups"]}


def assert_same_optimizer(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])


def plant_metadata(hostile, marker, name: str) -> None:
    (hostile / name).write_bytes(pickle.dumps(RunsCode(marker)))  # DCP writes its metadata with pickle.dump


def plant_lr_entry(hostile, marker) -> None:
    """Appends a pickle that runs code to the .distcp and points the optimizer's lr entry at it (the metadata,
    rewritten here with pickle as DCP writes it, stays well-formed)."""
    data = hostile / "__0_0.distcp"
    buf = io.BytesIO()
    torch.save(RunsCode(marker), buf)  # how DCP stores a non-tensor value
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(buf.getvalue())
    with open(hostile / ".metadata", "rb") as f:
        md = pickle.load(f)
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == "optim.param_groups.0.lr"]
    info.offset, info.length = offset, len(buf.getvalue())
    with open(hostile / ".metadata", "wb") as f:
        pickle.dump(md, f)


@pytest.mark.parametrize("planted", [".metadata", "__0.metadata", "__0_0.distcp"])
def test_a_dcp_file_that_runs_code_is_refused_unrun_and_nothing_is_touched(worker, checkpoint, tmp_path, planted):
    """torch's own dcp.load would unpickle each of these unrestricted (docs/reliability.md, "What a checkpoint
    directory is trusted with"); async_dapo.checkpoint.safe_dcp refuses them, naming the file."""
    path, saved = checkpoint
    hostile = tmp_path / "step_1"
    shutil.copytree(path, hostile)
    marker = tmp_path / "ran"
    if planted == "__0_0.distcp":
        plant_lr_entry(hostile, marker)
        expected = f"{hostile / planted}: entry 'optim.param_groups.0.lr' not loaded, nothing in it was run"
    else:
        if planted == "__0.metadata":  # DCP's fallback, read only when .metadata is missing
            (hostile / ".metadata").unlink()
        plant_metadata(hostile, marker, planted)
        expected = (f"{hostile / planted}: not loaded, nothing in it was run: "
                    "UnpicklingError: refused global builtins.exec")
    worker.train_step(make_groups(4, 4, seed=5))
    before = weights(worker), optimizer_state(worker), worker.version
    assert any(not torch.equal(saved["weights"][n], w) for n, w in before[0].items())  # a load would show
    with pytest.raises(CheckpointError, match="^" + re.escape(expected)):
        worker.load_checkpoint(str(hostile))
    assert not marker.exists()
    after = weights(worker)
    assert all(torch.equal(before[0][n], after[n]) for n in after) and worker.version == before[2]
    assert_same_optimizer(before[1], optimizer_state(worker))
