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
