"""The run directory on disk (async_dapo.checkpoint.run_dir) and the phase clock: no Ray, the file logic only."""

from async_dapo.checkpoint.run_dir import archive_previous_run


def test_fresh_run_moves_an_earlier_run_aside_and_keeps_it(tmp_path):
    run = tmp_path / "run"
    assert archive_previous_run(run) is None  # nothing there yet
    run.mkdir()
    (run / "config.yaml").write_text("only a config: no run yet")
    assert archive_previous_run(run) is None and (run / "config.yaml").exists()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert archive_previous_run(run) == tmp_path / "run.1"
    assert not run.exists() and (tmp_path / "run.1" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    (run / "checkpoints").mkdir(parents=True)
    assert archive_previous_run(run) == tmp_path / "run.2"  # run.1 is taken
    assert (tmp_path / "run.2" / "checkpoints").is_dir() and (tmp_path / "run.1").is_dir()


def test_write_atomic_replaces_whole_files_and_leaves_no_temp(tmp_path):
    from async_dapo.metrics import write_atomic

    target = tmp_path / "ckpt" / "meta.json"
    write_atomic(target, '{"step": 2}')
    write_atomic(target, '{"step": 4}')
    assert target.read_text() == '{"step": 4}'
    assert sorted(p.name for p in target.parent.iterdir()) == ["meta.json"]


def test_write_atomic_from_two_writers_at_once_never_tears_or_fails(tmp_path):
    """Each writer has its own temporary file: with one shared name, one writer's rename took the other's
    half-written file, and the other's rename then found nothing (FileNotFoundError)."""
    import threading

    from async_dapo.metrics import write_atomic

    target, errors = tmp_path / "latest.json", []
    texts = {w: f'{{"writer": {w}, "pad": "{str(w) * 5000}"}}' for w in range(3)}

    def write(w):
        try:
            for _ in range(150):
                write_atomic(target, texts[w])
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in texts]
    for t in threads:
        t.start()
    reads = set()
    while any(t.is_alive() for t in threads):
        if target.exists():
            reads.add(target.read_text())
    for t in threads:
        t.join(30)
    assert errors == [] and reads <= set(texts.values()) and target.read_text() in texts.values()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.json"]


def test_resume_never_picks_a_checkpoint_without_its_metadata(tmp_path):
    import json

    import pytest

    from async_dapo.checkpoint.run_dir import resume_target

    root = tmp_path / "run" / "checkpoints"
    for step, meta in ((2, True), (4, True), (6, False)):  # step 6: the run died while writing it
        ckpt = root / f"step_{step}"
        ckpt.mkdir(parents=True)
        (ckpt / "replay.json").write_text("{}")
        if meta:
            (ckpt / "meta.json").write_text(json.dumps({"step": step, "version": step}))
    (root / "step_8").mkdir()
    (root / "step_8" / "meta.json").write_text('{"step": 8')  # torn metadata (pre-atomic writer)
    (root / "latest.json").write_text(json.dumps({"step": 8, "version": 8}))  # points at the torn one
    assert resume_target(tmp_path / "run") == root / "step_4"
    with pytest.raises(FileNotFoundError, match="incomplete checkpoint"):
        resume_target(root / "step_6")
    assert resume_target(root / "step_2") == root / "step_2"


def test_rewind_keeps_exactly_the_rows_up_to_the_checkpoint(tmp_path):
    import json

    from async_dapo.metrics import rewind_jsonl

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "x": s} for s in (0, 1, 2, 3, 4, 5)] + [{"step": 4, "val/avg_at_k": 0.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert rewind_jsonl(path, 3) == 3  # steps 4, 5 and the step-4 validation row
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]
    assert rewind_jsonl(tmp_path / "absent.jsonl", 3) == 0


def test_resuming_an_earlier_checkpoint_discards_the_later_branch_and_prune_counts_complete_only(tmp_path):
    import json

    from async_dapo.checkpoint.run_dir import discard_later, prune, resume_target

    root = tmp_path / "run" / "checkpoints"
    for step in (2, 4, 6):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "replay.json").write_text("{}")
        (root / f"step_{step}" / "meta.json").write_text(json.dumps({"step": step, "version": step}))
    (root / "step_8").mkdir()  # incomplete: no metadata
    moved = discard_later(root, 2)  # --resume run/checkpoints/step_2
    assert sorted(p.name for p in moved) == ["step_4", "step_6", "step_8"]
    assert resume_target(tmp_path / "run") == root / "step_2"  # never the abandoned branch
    for step in (4, 6):
        (root / f"step_{step}").mkdir()
        (root / f"step_{step}" / "replay.json").write_text("{}")
        (root / f"step_{step}" / "meta.json").write_text(json.dumps({"step": step, "version": step}))
    (root / "step_7").mkdir()  # incomplete, newer than 6: must not push a complete one out
    prune(root, 2)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_") and "." not in p.name) == [
        "step_4", "step_6", "step_7"]


def test_phase_clock_nests_without_double_counting(monkeypatch):
    from async_dapo import metrics

    ticks = iter([0.0, 1.0, 3.0, 6.0, 10.0, 15.0, 21.0])  # start, enter a, enter b, leave b, leave a, ...
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(ticks))
    clock = metrics.PhaseClock()  # t = 0
    with clock.phase("a"):  # t = 1
        with clock.phase("b"):  # t = 3: a gets 2 s
            pass  # leave b at t = 6: b gets 3 s
        # leave a at t = 10: a gets 4 s more
    got = clock.metrics()  # t = 15
    assert got == {"time/a_s": 6.0, "time/b_s": 3.0, "time/other_s": 6.0, "time/total_s": 15.0}


def test_one_resume_rule_names_the_run_directory_and_the_checkpoint(tmp_path):
    import json

    from async_dapo.checkpoint.run_dir import owning_run, resume_target
    from async_dapo.cli import train_run_dir
    from async_dapo.config import load_config

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_3"
    ckpt.mkdir(parents=True)
    (ckpt / "replay.json").write_text("{}")
    (ckpt / "meta.json").write_text(json.dumps({"step": 3, "version": 3}))
    assert owning_run(run) == run and owning_run(ckpt) == run
    assert resume_target(run) == ckpt and resume_target(ckpt) == ckpt
    # The CLI's run_dir for --resume is the same rule's answer, for either form of the argument.
    for arg in (run, ckpt):
        assert train_run_dir(load_config(None), arg).logging.run_dir == run


def test_a_checkpoint_is_complete_only_once_committed_and_latest_follows_it(tmp_path):
    import json

    from async_dapo.checkpoint.run_dir import RunDir, begin, commit, complete, latest_complete, read_meta, read_replay_state

    run = RunDir(tmp_path / "run")
    for step in (2, 4, 6):
        ckpt = run.step_dir(step)
        ckpt.mkdir(parents=True)
        begin(ckpt)
        assert not complete(ckpt)  # shards may be on disk; without the metadata it is not a checkpoint
        commit(run, ckpt, step, step + 10, {"cursor": step}, keep_last=2)
        assert complete(ckpt) and read_meta(ckpt) == (step, step + 10)
    assert [p.name for p in sorted(run.checkpoints.glob("step_*"))] == ["step_4", "step_6"]  # pruned to 2
    assert json.loads((run.checkpoints / "latest.json").read_text()) == {"step": 6, "version": 16}
    assert read_replay_state(run.step_dir(6), 1024, 4) == {"cursor": 6, "partials": []}
    begin(run.step_dir(6))  # re-saving step 6: incomplete again until committed
    assert latest_complete(run.checkpoints) == run.step_dir(4)


def test_rewinding_to_a_step_trims_both_logs_and_sets_later_checkpoints_aside(tmp_path):
    import json

    from async_dapo.checkpoint.run_dir import RunDir, commit, last_checkpoint, rewind_to

    run = RunDir(tmp_path / "run")
    for name in ("metrics.jsonl", "prompts.jsonl"):
        (run.path / name).parent.mkdir(parents=True, exist_ok=True)
        (run.path / name).write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)))
    for step in (2, 4):
        run.step_dir(step).mkdir(parents=True)
        commit(run, run.step_dir(step), step, step, {}, keep_last=5)
    moved = rewind_to(run, 2)
    assert [p.name.split(".")[0] for p in moved] == ["step_4"]
    for name in ("metrics.jsonl", "prompts.jsonl"):
        assert [json.loads(x)["step"] for x in (run.path / name).read_text().splitlines()] == [1, 2]
    assert last_checkpoint(run.path) == f"{run.step_dir(2)} (continue with --resume {run.path})"
    assert last_checkpoint(tmp_path / "empty") == "none"


def test_recorded_batches_round_trip_through_the_wire_encoding(tmp_path):
    import numpy as np

    from async_dapo.checkpoint.run_dir import RunDir
    from async_dapo.stream.wire import Group, Sample, read_groups, write_groups

    sample = Sample(response_ids=np.array([3, 4], dtype=np.int32), logprobs=np.array([-0.5, -0.25], dtype=np.float32),
                    versions=np.array([1, 2], dtype=np.int32), reward=1.0, score=1.0, acc=True, truncated=False,
                    finish_reason="stop", gen_seconds=0.1)
    group = Group(group_id="g", prompt_index=5, epoch=0, engine_rank=0, prompt_ids=np.array([1, 2], dtype=np.int32),
                  ground_truth="7", data_source="s", samples=(sample,), created_at=1.0, admitted_version=1)
    run = RunDir(tmp_path / "run")
    assert run.batch(3) == run.path / "batches" / "step_3.bin"
    assert run.batch(3, tmp_path / "rec") == tmp_path / "rec" / "step_3.bin"
    write_groups([group, group], run.batch(3))
    assert read_groups(run.batch(3)) == [group, group]


def test_a_checkpoints_json_files_are_read_only_as_small_regular_files(tmp_path):
    """meta.json, replay.json and a rank's state may come from someone else's directory: a FIFO is refused at
    once (it used to wait for a writer forever), a symbolic link is not followed, and size is bounded."""
    import os
    import threading

    import pytest

    from async_dapo.checkpoint import run_dir as checkpoints
    from async_dapo.checkpoint.rank_state import CheckpointError, read

    ckpt = tmp_path / "checkpoints" / "step_2"
    ckpt.mkdir(parents=True)
    (tmp_path / "elsewhere.json").write_text('{"step": 2, "version": 2}')
    cases = [("meta.json", lambda p: os.mkfifo(p), "not a regular file but a FIFO"),
             ("meta.json", lambda p: p.symlink_to(tmp_path / "elsewhere.json"), "a symbolic link"),
             ("replay.json", lambda p: p.symlink_to("/dev/zero"), "a symbolic link"),
             ("meta.json", lambda p: p.write_text(" " * 5000), "more than 4096 bytes")]
    for name, make, why in cases:
        make(ckpt / name)
        got: list = []
        reader = checkpoints.read_meta if name == "meta.json" else (
            lambda c: checkpoints.read_replay_state(c, 1024, 4))
        t = threading.Thread(target=lambda: got.append(_error_of(lambda: reader(ckpt))), daemon=True)
        t.start()
        t.join(2)
        if t.is_alive():
            os.close(os.open(ckpt / name, os.O_WRONLY | os.O_NONBLOCK))  # let a reader stuck on the FIFO go
            pytest.fail(f"reading {name} ({why}) blocked")
        assert got == [f"{ckpt / name}: {why}"] or got[0].startswith(f"{ckpt / name}: {why}"), got
        assert not checkpoints.complete(ckpt)
        (ckpt / name).unlink()
    os.mkfifo(tmp_path / "extra_rank0.json")
    with pytest.raises(CheckpointError, match="extra_rank0.json: not a regular file but a FIFO"):
        read(tmp_path / "extra_rank0.json")


def _error_of(fn) -> str:
    try:
        fn()
    except OSError as exc:
        return str(exc)
    return "no error"
