"""The learner's per-rank resume state (async_dapo.checkpoint.rank_state): JSON that round-trips the RNG states, schedule
and counters exactly, and a loader that refuses, naming the file, anything else — above all a pickle, whose
unpickling would run code (the payload here writes a marker file; it must never appear)."""

import json
import random
import re

import pytest
import torch

from async_dapo.checkpoint import rank_state
from async_dapo.checkpoint.rank_state import CheckpointError


class RunsCode:
    """Unpickling this calls exec: what a hostile checkpoint file would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def scheduler(steps: int):
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 3))
    for _ in range(steps):
        opt.step()
        sched.step()
    return sched


def saved(tmp_path, steps: int = 2):
    """A rank state written after some draws from both RNGs; returns its path and what was saved."""
    random.seed(5), torch.manual_seed(5)
    random.random(), torch.rand(7)
    sched = scheduler(steps)
    path = rank_state.state_path(tmp_path, 0)
    rank_state.write(path, rank_state.capture(sched.state_dict(), version=7, skipped_updates=2))
    return path, sched.state_dict(), torch.get_rng_state(), random.getstate()


def test_round_trip_restores_rng_states_schedule_and_counters_exactly(tmp_path):
    path, sched_state, torch_rng, py_rng = saved(tmp_path)
    expected_draws = (torch.rand(5), [random.random() for _ in range(5)])
    torch.set_rng_state(torch_rng), random.setstate(py_rng)
    torch.rand(100), random.random()  # move both RNGs on, as training would
    fresh = scheduler(0)  # a new run's schedule, at step 0

    state = rank_state.read(path)
    assert rank_state.restore(path, state, fresh) == (7, 2)
    assert torch.equal(torch.get_rng_state(), torch_rng)
    assert random.getstate() == py_rng
    assert fresh.state_dict() == sched_state and fresh.get_last_lr() == [1e-3 * 2 / 3]
    got_draws = (torch.rand(5), [random.random() for _ in range(5)])
    assert torch.equal(got_draws[0], expected_draws[0]) and got_draws[1] == expected_draws[1]


def test_the_file_is_plain_json(tmp_path):
    path, *_ = saved(tmp_path)
    assert path.name == "extra_rank0.json" and not path.with_suffix(".pt").exists()
    assert json.loads(path.read_text())["version"] == 7


def test_an_older_versions_pickle_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    legacy = tmp_path / "extra_rank0.pt"
    torch.save(RunsCode(marker), legacy)
    with pytest.raises(CheckpointError, match=r"extra_rank0\.json: missing; extra_rank0\.pt .* not loaded"):
        rank_state.read(rank_state.state_path(tmp_path, 0))
    assert not marker.exists()
    torch.load(legacy, weights_only=False)  # the payload is live: the old loader would have run it
    assert marker.read_text() == "ran"


def test_a_pickle_in_place_of_the_json_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    path = rank_state.state_path(tmp_path, 0)
    torch.save(RunsCode(marker), path)
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: not a JSON rank state")):
        rank_state.read(path)
    assert not marker.exists()


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"extra_rank3\.json: missing \(not a learner checkpoint"):
        rank_state.read(rank_state.state_path(tmp_path, 3))


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("torch_rng"), "expected the keys"),
    (lambda s: s.update(extra=1), "expected the keys"),
    (lambda s: s.update(format=2), "format 2"),
    (lambda s: s.update(version=-1), "version must be an integer >= 0"),
    (lambda s: s.update(version=True), "version must be an integer >= 0"),
    (lambda s: s.update(skipped_updates="3"), "skipped_updates must be an integer >= 0"),
    (lambda s: s.update(scheduler=[1]), "scheduler must be an object"),
    (lambda s: s["torch_rng"].pop(), "torch_rng must be 5056 byte values"),
    (lambda s: s["torch_rng"].__setitem__(0, 256), "torch_rng must be 5056 byte values"),
    (lambda s: s.update(python_rng=[3, [1, 2]]), "python_rng must be"),
    (lambda s: s["python_rng"].__setitem__(2, "x"), "python_rng must be"),
])
def test_a_tampered_state_is_refused_naming_the_file(tmp_path, edit, message):
    path, *_ = saved(tmp_path)
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="^" + re.escape(f"{path}: {message}")):
        rank_state.read(path)


def test_unknown_scheduler_keys_are_refused_before_anything_is_set(tmp_path):
    """LambdaLR.load_state_dict sets every key as an attribute: a key such as 'optimizer' would replace the
    scheduler's optimizer with a JSON value."""
    path, *_ = saved(tmp_path)
    state = rank_state.read(path)
    state["scheduler"]["optimizer"] = {}
    fresh = scheduler(0)
    rng = torch.get_rng_state()
    refused = "^" + re.escape(f"{path}: scheduler state must have lr_lambdas and no keys")
    with pytest.raises(CheckpointError, match=refused):
        rank_state.restore(path, state, fresh)
    assert isinstance(fresh.optimizer, torch.optim.AdamW) and fresh.last_epoch == 0
    assert torch.equal(torch.get_rng_state(), rng)


def test_an_rng_state_the_rng_refuses_is_named(tmp_path):
    path, *_ = saved(tmp_path)
    state = rank_state.read(path)
    state["python_rng"][0] = 99  # random.setstate knows versions 2 and 3 only
    with pytest.raises(CheckpointError, match="^" + re.escape(f"{path}: rank state not restorable")):
        rank_state.restore(path, state, scheduler(0))
