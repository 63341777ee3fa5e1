"""Run-directory handling of the orchestrator (no Ray: the file logic only)."""

from async_dapo.orchestrator import archive_previous_run


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
    from async_dapo.orchestrator import write_atomic

    target = tmp_path / "ckpt" / "meta.json"
    write_atomic(target, '{"step": 2}')
    write_atomic(target, '{"step": 4}')
    assert target.read_text() == '{"step": 4}'
    assert sorted(p.name for p in target.parent.iterdir()) == ["meta.json"]


def test_resume_never_picks_a_checkpoint_without_its_metadata(tmp_path):
    import json

    import pytest

    from async_dapo.orchestrator import _checkpoint_to_resume

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
    assert _checkpoint_to_resume(tmp_path / "run") == root / "step_4"
    with pytest.raises(FileNotFoundError, match="incomplete checkpoint"):
        _checkpoint_to_resume(root / "step_6")
    assert _checkpoint_to_resume(root / "step_2") == root / "step_2"


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

    from async_dapo.orchestrator import _checkpoint_to_resume, _prune, discard_later_checkpoints

    root = tmp_path / "run" / "checkpoints"
    for step in (2, 4, 6):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "replay.json").write_text("{}")
        (root / f"step_{step}" / "meta.json").write_text(json.dumps({"step": step, "version": step}))
    (root / "step_8").mkdir()  # incomplete: no metadata
    moved = discard_later_checkpoints(root, 2)  # --resume run/checkpoints/step_2
    assert sorted(p.name for p in moved) == ["step_4", "step_6", "step_8"]
    assert _checkpoint_to_resume(tmp_path / "run") == root / "step_2"  # never the abandoned branch
    for step in (4, 6):
        (root / f"step_{step}").mkdir()
        (root / f"step_{step}" / "replay.json").write_text("{}")
        (root / f"step_{step}" / "meta.json").write_text(json.dumps({"step": step, "version": step}))
    (root / "step_7").mkdir()  # incomplete, newer than 6: must not push a complete one out
    _prune(root, 2)
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
