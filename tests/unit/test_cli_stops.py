"""The command line's stops, without a cluster: bad data in every truncation mode is rejected before Ray or
an engine starts (exit 2, one line naming the file and row), and any exception that escapes the driver (a
Ray error, a bug) ends in one line ``run failed: <what> (traceback in <log>); last checkpoint: <path>`` and
exit 1, with the traceback in the run's log file and not on the terminal."""

import json

import pytest

from async_dapo import cli


def _good_row(i):
    return {"data_source": "t", "prompt": [{"role": "user", "content": f"What is {i}+1?"}],
            "reward_model": {"ground_truth": str(i + 1)}}


def _argv(tmp_path, *sets):
    argv = ["train", "--config", "configs/tiny_cpu.yaml", "--set", "model.bootstrap=null",
            "--set", f"model.path={tmp_path / 'no_model'}", "--set", f"logging.run_dir={tmp_path / 'run'}"]
    for s in sets:
        argv += ["--set", s]
    return argv


@pytest.fixture
def bad_train(tmp_path):
    rows = [_good_row(i) for i in range(5)]
    rows[3]["prompt"] = "not a list"
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("truncation", ["error", "left"])
def test_a_bad_row_stops_before_anything_is_placed_in_every_mode(tmp_path, bad_train, capsys, truncation):
    import ray

    rc = cli.main(_argv(tmp_path, f"data.train={bad_train}", f"data.truncation={truncation}"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith(f"error: {bad_train}: row 3: prompt:") and "valid list" in err[0]
    assert not ray.is_initialized()  # nothing was started


def test_an_empty_val_file_with_left_truncation_stops_before_placement(tmp_path, capsys):
    empty = tmp_path / "val.jsonl"
    empty.write_text("")
    rc = cli.main(_argv(tmp_path, f"data.val={empty}", "data.truncation=left"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"error: {empty}: no rows"]


def _ray_errors():
    from ray.exceptions import OutOfMemoryError, RaySystemError

    return [OutOfMemoryError("Task was killed due to the node running low on memory.\nMemory on the node ..."),
            RaySystemError("System error: GCS unreachable"), ZeroDivisionError("division by zero")]


@pytest.mark.parametrize("exc", _ray_errors(), ids=lambda e: type(e).__name__)
def test_any_driver_exception_is_one_line_with_the_traceback_in_the_run_log(tmp_path, capsys, monkeypatch, exc):
    import async_dapo.orchestrator as orchestrator

    def boom(cfg, resume, clock):
        raise exc

    monkeypatch.setattr(orchestrator, "train", boom)
    ckpt = tmp_path / "run" / "checkpoints" / "step_40"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text('{"step": 40, "version": 40}')
    (ckpt / "replay.json").write_text("{}")
    rc = cli.main(["train", "--config", "configs/tiny_cpu.yaml", "--resume", str(tmp_path / "run"),
                   "--set", "model.bootstrap=null"])
    err = capsys.readouterr().err.strip().splitlines()
    log = (tmp_path / "run" / "train.log").read_text()
    first = str(exc).splitlines()[0]
    assert rc == 1 and len(err) == 1, err
    assert err[0] == (f"run failed: {type(exc).__name__}: {first} (traceback in {tmp_path / 'run' / 'train.log'}); "
                      f"last checkpoint: {ckpt} (continue with --resume {tmp_path / 'run'})")
    assert "Traceback (most recent call last)" in log and "in boom" in log and "Traceback" not in err[0]


def test_scale_reads_a_run_whose_planner_profile_path_is_relative_to_another_directory(tmp_path, monkeypatch):
    """`async-dapo scale` needs only the run's placement: a run started elsewhere, whose config.yaml names its
    planner profile relative to that directory, is still scaled."""
    from async_dapo.config import dump_config, load_config

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config("configs/tiny_cpu.yaml", [f"logging.run_dir={run}", "placement.max_engines=2"])
    dump_config(cfg, run / "config.yaml")
    monkeypatch.chdir(tmp_path)  # configs/profiles/cpu_tiny.yaml does not exist from here
    assert cli.main(["scale", str(run), "--engines", "2"]) == 0
    assert json.loads((run / "scale.json").read_text())["engines"] == 2


def test_a_start_past_its_deadline_fails_even_where_the_interrupted_code_catches_exceptions():
    """eval's engine start: SGLang reads its pipes under ``except Exception``; the deadline's signal must not
    be swallowed there (seen once: the start then ran on and the run went on past its bound)."""
    import time

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^engine start \(x\): not ready in 0 s$"):
        with cli._deadline(0.2, "engine start (x)"):
            try:
                time.sleep(5)
            except Exception:  # what SGLang's pipe reads do with an OSError (TimeoutError is one)
                time.sleep(5)
    assert time.monotonic() - t0 < 1.0  # the signal's exception went through, at the bound


def test_a_swallowed_deadline_still_fails_when_the_block_ends():
    with pytest.raises(TimeoutError, match="not ready"):
        with cli._deadline(0.1, "engine start (x)"):
            try:
                import time

                time.sleep(1)
            except BaseException:  # even a bare except: the block's end reports the expired bound
                pass
    with cli._deadline(5, "engine start (x)"):  # within its bound: nothing raised
        pass
