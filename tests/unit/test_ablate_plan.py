"""tools/study/ablate.py's grids: every cell is a valid config that says what its name says, the DAPO rows are
cumulative, and cluster submission runs each unfinished run once, at most --max-jobs at a time (the Ray job
client is replaced by a recorder here; tests/integration/test_tools.py runs the real local path)."""

import json
import os
import subprocess
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from async_dapo.config import dump_config, load_config, parse_override

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "study"))
import ablate  # noqa: E402

CONFIG = REPO / "configs" / "tiny_cpu.yaml"


def _cfg(sets):
    return load_config(CONFIG, [*ablate.VAL, *sets])


def _assert_applied(cfg, overrides):
    """Each override's value (the last one per key wins, as in load_config) is what the loaded config holds:
    a cell whose override were lost (shadowed by a later one, or reset by a validator) would fail here."""
    want = dict(parse_override(text) for text in overrides)
    dumped = cfg.model_dump(mode="json")
    for key, value in want.items():
        got = dumped
        for part in key.split("."):
            got = got[part]
        if isinstance(got, float) and not isinstance(value, bool):
            value = float(value)  # "0.2" arrives as a float, "1" for a float field as an int
        assert got == value, (key, got, value)


@pytest.mark.parametrize("study", sorted(ablate.STUDIES))
@pytest.mark.parametrize("preset", ["quick", "full", "grid"])
def test_every_cell_of_every_preset_loads(study, preset):
    cells, presets = ablate.STUDIES[study]
    p = presets[preset]
    assert p.cells  # a preset without cells would pass the loop below vacuously
    for name in p.cells:
        overrides = [*ablate.VAL, *p.extra, *cells(64)[name]]
        _assert_applied(_cfg([*p.extra, *cells(64)[name]]), overrides)  # ConfigError names a bad field


def test_staleness_cells_set_eta_correction_and_the_admission_window():
    cells = ablate.staleness_cells([0, 4], batch=64)
    assert list(cells) == ["eta0/none", "eta0/naive", "eta0/decoupled", "eta4/none", "eta4/naive", "eta4/decoupled"]
    cfg = _cfg(cells["eta4/naive"])
    assert (cfg.replay.max_staleness, cfg.algorithm.correction.mode) == (4, "naive")
    assert cfg.rollout.max_inflight_prompts == 5 * 64 and cfg.replay.capacity_groups == 320
    assert _cfg(cells["eta0/none"]).rollout.max_inflight_prompts == 64


def test_full_presets_cover_what_the_issue_asks():
    cells, presets = ablate.STUDIES["staleness"]
    full = presets["full"]
    assert {c.split("/")[0] for c in full.cells} == {"eta0", "eta1", "eta4"} and len(full.cells) == 9
    assert len(full.seeds) >= 3 and len(presets["grid"].cells) == 15
    assert len(ablate.STUDIES["dapo"][1]["full"].cells) == 6 and len(ablate.STUDIES["dapo"][1]["full"].seeds) >= 3


def test_dapo_rows_are_cumulative_from_naive_grpo_to_dapo():
    rows = {name: _cfg([*ablate.DAPO_TASK, *sets]) for name, sets in ablate.dapo_cells().items()}
    names = list(rows)
    assert names == ["naive GRPO", "+ overlong filtering", "+ clip-higher", "+ soft overlong punishment",
                     "+ token-level loss", "+ dynamic sampling (DAPO)"]

    def flags(c):
        a = c.algorithm
        return {"clip_high": a.clip_high, "agg": a.loss_agg_mode, "filter": a.overlong_filtering,
                "soft": c.reward.overlong_buffer_enable, "ds": a.dynamic_sampling.enable}

    got = [flags(rows[n]) for n in names]
    assert got[0] == {"clip_high": 0.2, "agg": "seq-mean-token-mean", "filter": False, "soft": False, "ds": False}
    assert got[-1] == {"clip_high": 0.28, "agg": "token-mean", "filter": True, "soft": True, "ds": True}
    changed = [[k for k in got[i] if got[i][k] != got[i - 1][k]] for i in range(1, len(got))]
    assert changed == [["filter"], ["clip_high"], ["soft"], ["agg"], ["ds"]]  # one technique per row
    for c in rows.values():  # the task that makes length matter, and the symmetric low clip, in every row
        assert (c.rollout.max_response_length, c.reward.overlong_buffer_length) == (15, 5)
        assert c.data.synthetic.response_style == "steps" and c.algorithm.clip_low == 0.2


def test_a_multi_node_study_gives_every_run_its_own_absolute_run_dir():
    """`--set placement.nnodes=2` (a multi-node cluster) needs an absolute run_dir in every config ablate
    loads, and a `--set logging.run_dir=...` must not put every run into one directory."""
    sets = ["placement.nnodes=2", "transport.bind_host=0.0.0.0", "logging.run_dir=/shared/one_dir"]
    args = types.SimpleNamespace(study="staleness", preset="quick", seeds=None, out=Path("/shared/ablate"),
                                 overrides=sets, address=None)
    cells, presets = ablate.STUDIES["staleness"]
    jobs = ablate.plan(args, presets["quick"], cells(64), Path("/shared/ablate/staleness/model"))
    dirs = [load_config(CONFIG, job.sets).logging.run_dir for job in jobs]  # the multi-node rules pass
    assert dirs == [job.run_dir for job in jobs] and len(set(dirs)) == len(jobs) == 2
    assert all(d.is_relative_to("/shared/ablate/staleness/quick") for d in dirs)
    base = load_config(CONFIG, [*ablate.VAL, *sets[:2], ablate.study_run_dir(args)])  # main's and the bootstrap's
    assert base.placement.nnodes == 2 and base.logging.run_dir == Path("/shared/ablate/staleness")


class _Client:
    """Records submissions; every job succeeds at the first status check after its submission. ``listed``:
    jobs the head already knows (an earlier invocation's)."""

    def __init__(self, address, listed=()):
        self.address, self.submitted, self.max_running, self.running = address, [], 0, set()
        self.listed = [types.SimpleNamespace(submission_id=sid, status=st) for sid, st in listed]
        self.running.update(sid for sid, st in listed if st == "RUNNING")

    def list_jobs(self):
        return self.listed

    def submit_job(self, entrypoint, submission_id, runtime_env):
        self.submitted.append((submission_id, entrypoint, runtime_env))
        self.running.add(submission_id)
        self.max_running = max(self.max_running, len(self.running))
        return submission_id

    def get_job_status(self, sid):
        self.running.discard(sid)
        return "SUCCEEDED"


def _cluster(tmp_path, monkeypatch, client):
    fake = types.SimpleNamespace(JobSubmissionClient=lambda address: client,
                                 JobStatus=types.SimpleNamespace(SUCCEEDED="SUCCEEDED", FAILED="FAILED", STOPPED="STOPPED"))
    monkeypatch.setitem(sys.modules, "ray.job_submission", fake)
    monkeypatch.setattr(ablate.time, "sleep", lambda s: None)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # set explicitly: run_cluster leaves it as it is
    args = types.SimpleNamespace(study="staleness", preset="full", seeds=None, out=tmp_path, overrides=[],
                                 address="http://head:8265", max_jobs=2, run_timeout=60, config=str(CONFIG))
    cells, presets = ablate.STUDIES["staleness"]
    return args, ablate.plan(args, presets["full"], cells(64), tmp_path / "model")


def test_cluster_submission_runs_each_unfinished_run_once_within_max_jobs(tmp_path, monkeypatch):
    client = _Client("http://head:8265")
    args, jobs = _cluster(tmp_path, monkeypatch, client)
    done = jobs[0].run_dir  # finished earlier with this config: its metrics reach the last step, then the end
    done.mkdir(parents=True)
    (done / "metrics.jsonl").write_text(json.dumps({"step": 80, "perf/time_per_step": 1.0}) + "\n"
                                        + json.dumps({"step": 80, "time/total_s": 1.0}) + "\n")
    dump_config(load_config(CONFIG, jobs[0].sets), done / "config.yaml")  # as its job wrote it:
    assert load_config(done / "config.yaml").placement.ray_address == "auto"  # the cluster's, as the job ran
    ablate.run_cluster(args, jobs)
    assert len(client.submitted) == len(jobs) - 1 == 26 and client.max_running <= 2
    entries = [e for _, e, _ in client.submitted]
    assert all(e.startswith(f"async-dapo train --config {CONFIG}") for e in entries)
    assert all("placement.ray_address=auto" in e for e in entries)
    assert str(done) not in " ".join(entries)
    assert [sid for sid, _, _ in client.submitted][:2] == ["ablate-staleness-full-eta0_none-s1",
                                                          "ablate-staleness-full-eta0_none-s2"]
    assert all(env == {"working_dir": str(ablate.REPO)} for _, _, env in client.submitted)


def test_cluster_rerun_adopts_a_running_job_and_retries_a_failed_one(tmp_path, monkeypatch):
    client = _Client("http://head:8265", listed=[("ablate-staleness-full-eta0_none-s0", "RUNNING"),
                                                 ("ablate-staleness-full-eta0_none-s1", "FAILED")])
    args, jobs = _cluster(tmp_path, monkeypatch, client)
    ablate.run_cluster(args, jobs)
    ids = [sid for sid, _, _ in client.submitted]
    assert "ablate-staleness-full-eta0_none-s0" not in ids  # still running: followed, not submitted twice
    assert ids[0].startswith("ablate-staleness-full-eta0_none-s1-")  # ended unfinished: a new attempt
    assert len(ids) == len(jobs) - 1


def test_a_finished_run_with_another_config_is_not_reused(tmp_path, monkeypatch):
    args, jobs = _cluster(tmp_path, monkeypatch, _Client("x"))
    done = jobs[0].run_dir  # a run written before the verl renames (perf/step_s): still read as a step row
    done.mkdir(parents=True)
    (done / "metrics.jsonl").write_text(json.dumps({"step": 80, "perf/step_s": 1.0}) + "\n"
                                        + json.dumps({"step": 80, "time/total_s": 1.0}) + "\n")
    dump_config(load_config(CONFIG, [*jobs[0].sets, "learner.lr=1e-3"]), done / "config.yaml")
    with pytest.raises(SystemExit, match="another config"):
        jobs[0].done(args.config)
    (done / "metrics.jsonl").write_text(json.dumps({"step": 4, "perf/step_s": 1.0}) + "\n"
                                        + json.dumps({"step": 4, "time/total_s": 1.0}) + "\n")
    assert not jobs[0].done(args.config)  # ended (killed or failed) before its 80 steps: run it again


class _TokenHead(BaseHTTPRequestHandler):
    """The job API of a head with token authentication, as far as run_cluster uses it before submitting:
    without ``Authorization: Bearer <token>`` every request gets Ray's 401."""

    token = ""
    seen: list[str | None] = []

    def do_GET(self):
        self.seen.append(self.headers.get("Authorization"))
        if self.headers.get("Authorization") != f"Bearer {self.token}":
            self._answer(401, b"Unauthorized: Missing authentication token")
        elif self.path == "/api/version":
            self._answer(200, json.dumps({"version": "4", "ray_version": "2.60.0", "ray_commit": "x"}).encode())
        else:  # /api/jobs/: nothing submitted yet
            self._answer(200, b"[]")

    def _answer(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_cluster_client_sends_the_token_that_ray_start_head_keeps(tmp_path):
    """README's `ablate.py --address` after `ray start --head`: the head enables token auth and keeps the token
    in ~/.ray/auth_token, RAY_AUTH_MODE is unset. Ray reads the mode when it is imported, so run_cluster must
    set it before its first ray import (it used to set it after, and every request failed "Missing
    authentication token"). A fresh interpreter, so that no earlier import of ray decides; a stand-in head."""
    (tmp_path / ".ray").mkdir()
    _TokenHead.token, _TokenHead.seen = "0123456789abcdef0123456789abcdef", []
    (tmp_path / ".ray" / "auth_token").write_text(_TokenHead.token)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TokenHead)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    code = (f"import sys, types; sys.path.insert(0, {str(REPO / 'tools' / 'study')!r}); import ablate; "
            "ablate.run_cluster(types.SimpleNamespace(address=sys.argv[1], config='x', max_jobs=1, run_timeout=1), [])")
    try:
        proc = subprocess.run([sys.executable, "-c", code, f"http://127.0.0.1:{server.server_port}"], cwd=tmp_path,
                              env={**env, "HOME": str(tmp_path)}, capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _TokenHead.seen and set(_TokenHead.seen) == {f"Bearer {_TokenHead.token}"}
