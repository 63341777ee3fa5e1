"""RUN_DIR/scale.json, the run's control file (async_dapo.checkpoint.run_dir): read without ever blocking or raising
anything but ScaleRefused, told apart by content and number (not mtime), numbered and written by concurrent
`async-dapo scale` calls without a shared number or a torn file. Real files, FIFOs and devices; no Ray."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from async_dapo import cli
from async_dapo.checkpoint.run_dir import (SCALE_MAX_BYTES, RunDir, ScaleRefused, ScaleRequest, ScaleWatch,
                                    read_scale_request, write_scale_request)

REPO = Path(__file__).resolve().parents[2]


def _read_within(path: Path, seconds: float = 1.0):
    """read_scale_request(path) in a thread: its result or exception, failing (not hanging) if it blocks. A
    reader blocked opening a FIFO is let go by opening the FIFO's other end."""
    out: list = []

    def read():
        try:
            out.append(read_scale_request(path))
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # a blocked reader of a FIFO returns
        t.join(seconds)
        pytest.fail(f"read_scale_request({path}) blocked for more than {seconds} s")
    return out[0]


def _refused(path: Path) -> str:
    result = _read_within(path)
    assert isinstance(result, ScaleRefused), result
    assert str(result).startswith(f"{path}: "), result  # the message names the path
    return str(result)


def test_a_fifo_is_refused_at_once_and_so_is_a_symlink_to_one(tmp_path):
    scale = RunDir(tmp_path).scale
    os.mkfifo(scale)
    assert _refused(scale) == f"{scale}: not a regular file but a FIFO"
    scale.unlink()
    os.mkfifo(tmp_path / "pipe")
    scale.symlink_to(tmp_path / "pipe")
    assert "a symbolic link" in _refused(scale)


def test_symlinks_are_refused_even_to_a_valid_request_or_a_device(tmp_path):
    scale = RunDir(tmp_path).scale
    (tmp_path / "elsewhere.json").write_text('{"engines": 2}')
    scale.symlink_to(tmp_path / "elsewhere.json")
    assert _refused(scale) == (f"{scale}: a symbolic link (a request must be a regular file, as "
                               "`async-dapo scale` writes it)")
    scale.unlink()
    scale.symlink_to("/dev/zero")
    assert "a symbolic link" in _refused(scale)
    scale.unlink()
    scale.symlink_to(tmp_path / "nowhere")  # dangling: still a link, not "no request"
    assert "a symbolic link" in _refused(scale)


def test_a_device_or_a_directory_is_not_a_request(tmp_path):
    assert _refused(Path("/dev/zero")) == "/dev/zero: not a regular file but a character device"
    scale = RunDir(tmp_path).scale
    scale.mkdir()
    assert _refused(scale) == f"{scale}: not a regular file but a directory"


def test_a_request_larger_than_the_limit_is_refused_and_one_at_it_is_read(tmp_path):
    scale = RunDir(tmp_path).scale
    text = '{"seq": 7, "engines": 2}'
    scale.write_text(text + " " * (SCALE_MAX_BYTES - len(text)))
    assert _read_within(scale) == ScaleRequest(scale.read_text(), 7)
    scale.write_text(text + " " * (SCALE_MAX_BYTES + 1 - len(text)))
    assert _refused(scale) == f"{scale}: {SCALE_MAX_BYTES + 1} bytes, more than a request's {SCALE_MAX_BYTES}"


def test_unreadable_or_undecodable_is_refused_and_absent_is_no_request(tmp_path):
    run = RunDir(tmp_path)
    assert _read_within(run.scale) is None
    run.scale.write_bytes(b'{"engines": 2, "note": "\xff"}')
    assert "can't decode byte 0xff" in _refused(run.scale)
    if os.geteuid() != 0:  # root reads a file whatever its mode
        run.scale.write_text('{"engines": 2}')
        run.scale.chmod(0)
        assert _refused(run.scale) == f"{run.scale}: Permission denied (EACCES)"
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("a run directory that is a file")
    assert _refused(RunDir(not_a_dir).scale) == f"{not_a_dir / 'scale.json'}: Not a directory (ENOTDIR)"


def test_a_request_is_new_by_content_not_mtime_and_each_problem_is_refused_once(tmp_path):
    run = RunDir(tmp_path)
    watch = ScaleWatch(run.scale)
    assert watch.poll() is None
    first = write_scale_request(run, {"engines": 2})
    assert watch.poll() == first and first.seq == 1 and json.loads(first.text) == {"seq": 1, "engines": 2}
    assert watch.poll() is None  # handed out once
    stamp = run.scale.stat().st_mtime_ns
    second = write_scale_request(run, {"engines": 2})  # the same count asked again: a new request
    os.utime(run.scale, ns=(stamp, stamp))  # a coarse clock (NFS) gives both the same mtime
    assert run.scale.stat().st_mtime_ns == stamp
    assert watch.poll() == second and second.seq == 2
    run.scale.unlink()
    os.mkfifo(run.scale)
    with pytest.raises(ScaleRefused, match="a FIFO"):
        watch.poll()
    assert watch.poll() is None  # the same problem is not refused (logged) again at every poll
    run.scale.unlink()
    third = write_scale_request(run, {"engines": 1})
    assert watch.poll() == third and third.seq == 3  # the number goes on: the lock file keeps it


def test_the_writer_replaces_what_it_cannot_read_and_names_what_it_cannot_replace(tmp_path):
    run = RunDir(tmp_path)
    run.scale.write_text("garbage")
    assert write_scale_request(run, {"engines": 1}).seq == 1
    run.scale.write_text('{"seq": 41, "engines": 2}')  # a request numbered elsewhere: the next one is later
    assert write_scale_request(run, {"engines": 1}).seq == 42
    run.scale.unlink()
    run.scale.mkdir()
    with pytest.raises(OSError, match=rf"^{run.scale}: cannot be replaced: Is a directory \(EISDIR\)$"):
        write_scale_request(run, {"engines": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".scale.lock", "scale.json"]  # no temporary left


def test_a_writer_waits_a_bounded_time_for_the_lock(tmp_path):
    import fcntl
    import time

    run = RunDir(tmp_path)
    holder = os.open(run.scale_lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"^{run.scale_lock}: still locked after 0.3 s by another "):
            write_scale_request(run, {"engines": 1}, lock_timeout_s=0.3)
        assert 0.3 <= time.monotonic() - t0 < 2
    finally:
        os.close(holder)
    assert write_scale_request(run, {"engines": 1}).seq == 1 and not run.scale.with_name(".scale.json.tmp").exists()


_WRITER = """
import sys
from pathlib import Path
from async_dapo.checkpoint.run_dir import RunDir, write_scale_request
run = RunDir(Path(sys.argv[1]))
for i in range(int(sys.argv[2])):
    print(write_scale_request(run, {"engines": 1 + i % 2, "writer": sys.argv[3]}).seq, flush=True)
"""


def test_concurrent_writers_take_distinct_numbers_and_never_tear_the_file(tmp_path):
    run, writers, rounds = RunDir(tmp_path), 3, 40
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(rounds), str(w)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(writers)]
    seen = set()
    while any(p.poll() is None for p in procs):  # the run's side: every read is a whole request
        request = read_scale_request(run.scale)
        if request is not None:
            assert json.loads(request.text)["seq"] == request.seq
            seen.add(request.seq)
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * writers, [err for _, err in outs]
    seqs = [int(line) for out, _ in outs for line in out.split()]
    assert sorted(seqs) == list(range(1, writers * rounds + 1))  # none taken twice, none skipped
    assert read_scale_request(run.scale).seq == writers * rounds  # the last number is the one in the file
    assert sorted(p.name for p in tmp_path.iterdir()) == [".scale.lock", "scale.json"]  # no temporaries left
    assert len(seen) > 1


def _run_dir(tmp_path: Path) -> Path:
    from async_dapo.config import dump_config, load_config

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config("configs/tiny_cpu.yaml", [f"logging.run_dir={run}", "placement.max_engines=3",
                                                "logging.plan_profile=null"])
    dump_config(cfg, run / "config.yaml")
    return run


def test_two_concurrent_scale_commands_write_distinct_numbered_requests(tmp_path):
    run = _run_dir(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-m", "async_dapo.cli", "scale", str(run), "--engines", str(n)],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (2, 3)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    lines = sorted(line.split(" async_dapo ")[1].split(":")[0] for _, err in outs for line in err.splitlines()
                   if " async_dapo request #" in line)
    assert lines in (["request #1 written (engines=2)", "request #2 written (engines=3)"],
                     ["request #1 written (engines=3)", "request #2 written (engines=2)"]), lines
    final = json.loads((run / "scale.json").read_text())
    assert final["seq"] == 2 and f"request #2 written (engines={final['engines']})" in lines


class _FakeRun(threading.Thread):
    """The run's side of a request, as the supervisor answers it: polls scale.json, records ``scale`` (or
    ``scale_refused`` for more than ``room`` engines) with the request's number in fleet.jsonl."""

    def __init__(self, run: Path, room: int = 3, delay: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.dir, self.room, self.delay, self.stop = RunDir(run), room, delay, threading.Event()

    def run(self) -> None:  # noqa: D102 - threading.Thread's
        watch = ScaleWatch(self.dir.scale)
        while not self.stop.wait(self.delay or 0.05):
            try:
                request = watch.poll()
            except ScaleRefused as exc:
                self._event("scale_refused", seq=None, reason=str(exc))
                continue
            if request is not None:
                engines = json.loads(request.text)["engines"]
                if engines > self.room:
                    self._event("scale_refused", seq=request.seq, engines=engines, reason="cannot be held")
                else:
                    self._event("scale", seq=request.seq, engines=engines)

    def _event(self, event: str, **fields) -> None:
        with self.dir.fleet.open("a") as f:
            f.write(json.dumps({"time": 0, "event": event, **fields}) + "\n")


def test_scale_waits_for_the_run_to_apply_or_refuse_its_request(tmp_path, capsys):
    run = _run_dir(tmp_path)
    (run / "fleet.jsonl").write_text('{"event": "scale", "seq": 9, "engines": 1}\n')  # before: not an answer
    fake = _FakeRun(run, room=2)
    fake.start()
    try:
        assert cli.main(["scale", str(run), "--engines", "2", "--wait-s", "20"]) == 0
        assert "request #1 applied by the run: scaling to 2 engine(s) (" in capsys.readouterr().err
        assert cli.main(["scale", str(run), "--engines", "3", "--wait-s", "20"]) == 1
        assert capsys.readouterr().err.splitlines()[-1] == "error: scale request #2 refused by the run: cannot be held"
    finally:
        fake.stop.set()
        fake.join(5)
    assert cli.main(["scale", str(run), "--engines", "1", "--wait-s", "0.3"]) == 1  # no run reads it
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        "error: scale request #3 written, but the run did not answer it in 0.3 s (is it running?")


def test_a_request_superseded_before_the_run_read_it_says_so(tmp_path, capsys):
    run = _run_dir(tmp_path)
    first = threading.Thread(target=lambda: out.append(cli.main(["scale", str(run), "--engines", "2",
                                                                 "--wait-s", "20"])))
    out: list[int] = []
    first.start()
    while not (run / "scale.json").exists():
        threading.Event().wait(0.01)
    assert cli.main(["scale", str(run), "--engines", "1"]) == 0  # #2, written before any run read #1
    fake = _FakeRun(run)
    fake.start()
    try:
        first.join(20)
    finally:
        fake.stop.set()
        fake.join(5)
    err = capsys.readouterr().err.splitlines()
    assert out == [1] and ("error: scale request #1 superseded by request #2 before the run read it "
                           "(the run follows #2)") in err
