"""A real multi-node Ray cluster on one machine (tests/raycluster.py: Ray's own multi-node start, each raylet
on its own loopback address): a head on 127.0.0.2 with no CPUs (the driver, the job supervisor and the replay
queue, which is pinned to the driver's node, run there, as on a cluster whose head only drives) and two
worker nodes, 127.0.0.3 and 127.0.0.4, with 1 CPU each, so the rollout engine (placement.engine_cpus 1) and
the learner (placement.learner_cpus 1) land on different workers and neither on the queue's node: the group
stream (engine -> queue), the weight push (learner -> engine), the learner's calls from the driver and the
run directory (metrics from the driver, checkpoint shards from the learner) all cross nodes. With only two
nodes one of the two roles shares the queue's node; in the runs measured it was the engine, so the group
stream, what transport.bind_host is for, never left its node.

1. A run submitted with tools/cluster/submit.sh (the real `ray job submit`, followed to its end) succeeds,
   as Ray's job client confirms in token mode, and trains every step once, with engine, learner and queue
   each on its own node and every TCP connection of the cluster on loopback addresses.
2. tools/study/ablate.py --quick, as the README runs it against a head (token auth on, RAY_AUTH_MODE unset),
   submits its two runs to the same cluster as jobs; both succeed and are summarised (runs, curves, PNG,
   table); run again, it finds both finished and submits nothing.

The multi-node settings are the ones a real cluster needs: placement.nnodes 3 (the nodes the run spans,
the queue's included), transport.bind_host node (the queue binds only the address Ray knows for its node
and advertises it: on these nodes, which share one kernel, a queue advertising another node's loopback
address could not be reached, so a wrong address fails the run instead of connecting anyway) and an absolute logging.run_dir on storage every node sees. Not under
pytest's tmp_path: that is in /tmp, which config.rule_multi_node_run_dir_shared refuses (node-local on a real
cluster), so the runs go to a fresh directory under the repository's runs/ (git-ignored, so the job's
working-dir upload leaves it behind) or, for a clone that itself lives under /tmp, under
~/.cache/async_dapo_tests; removed at the end.
"""

import csv
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from async_dapo.config import NODE_LOCAL_DIRS, load_config
from tests.conftest import CPU_CONFIG, REPO
from tests.raycluster import RAY, LocalCluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 4
# bind_host=node: the queue listens on its own node's address only, so on these nodes (one kernel) a queue
# advertising any other loopback address could not be reached: the test would fail instead of connecting.
MULTI_NODE = ["placement.nnodes=3", "transport.bind_host=node"]
SMALL = ["logging.val_every_steps=0", "checkpoint.export_hf=false", "algorithm.train_batch_groups=16",
         "learner.mini_batch_groups=16", "rollout.max_inflight_prompts=32"]


@pytest.fixture(scope="module")
def cluster():
    t0 = time.monotonic()
    c = LocalCluster(ips=("127.0.0.2", "127.0.0.3", "127.0.0.4"), cpus=(0, 1, 1)).start()
    print(f"{len(c.ips)} Ray nodes up in {time.monotonic() - t0:.0f} s: {c.gcs_address}, {c.dashboard_url}")
    try:
        yield c
    finally:
        killed = c.stop()  # by PID, whatever the tests did; never `ray stop` (it ends every Ray instance here)
        if killed:
            print(f"needed SIGKILL: {killed}")


@pytest.fixture(scope="module")
def shared_dir():
    # Not node-local by the multi-node rule: the repository's runs/, or, for a clone under /tmp (CI's may be),
    # a directory under the home directory (one machine: every node sees both).
    base = REPO / "runs"
    if any(base.resolve().is_relative_to(d) for d in NODE_LOCAL_DIRS):
        base = Path.home() / ".cache" / "async_dapo_tests"
    base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="pytest-multinode-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class Traffic:
    """The (local, remote) addresses of every TCP connection of the cluster's processes, sampled each second
    while the block runs (connections open and close within a run: a sample every second sees the long-lived
    ones: GCS, raylets, object transfer, the group stream, the weight group)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster, self.seen, self._stop = cluster, set(), threading.Event()

    def __enter__(self) -> "Traffic":
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.seen |= self.cluster.connections()
            except Exception:  # a process ended while it was being read: the next sample
                continue

    def off_loopback(self) -> set[tuple[str, str]]:
        def loopback(a: str) -> bool:
            ip = ipaddress.ip_address(a)
            return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback

        return {pair for pair in self.seen if not all(map(loopback, pair))}


def _job(cluster: LocalCluster, submission_id: str) -> dict:
    return next(j for j in cluster.state("jobs") if j.get("submission_id") == submission_id)


def _job_logs(cluster: LocalCluster, submission_id: str) -> str:
    out = subprocess.run([RAY, "job", "logs", "--address", cluster.dashboard_url, submission_id],
                         env=cluster.env, timeout=120, capture_output=True, text=True)
    return (out.stdout + out.stderr)[-4000:]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_plain_ray_init_elsewhere_does_not_join_this_cluster(cluster):
    assert not cluster.joined_by_plain_init(dict(os.environ))
    assert not cluster.joined_by_plain_init({k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})


def test_job_trains_with_engine_and_learner_on_different_nodes(cluster, shared_dir, tiny_model):
    """Submitted with tools/cluster/submit.sh (README's ``ray job submit`` wrapper: it follows the job and
    exits 0 only if it SUCCEEDED); Ray's own job client, in token mode as the head requires, agrees."""
    run_dir = shared_dir / "train"
    sets = [f"model.path={tiny_model}", "model.bootstrap=null", "placement.ray_address=auto", *MULTI_NODE,
            f"logging.run_dir={run_dir}", f"learner.total_steps={STEPS}", *SMALL]
    args = ["--config", str(CPU_CONFIG.relative_to(REPO))]
    for s in sets:
        args += ["--set", s]
    t0 = time.monotonic()
    with Traffic(cluster) as traffic:
        submit = subprocess.run([str(REPO / "tools" / "cluster" / "submit.sh"), "--address", cluster.dashboard_url,
                                 "--", *args], env=cluster.env, timeout=900, capture_output=True, text=True)
    log = run_dir / "train.log"
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:] + (
        log.read_text()[-4000:] if log.exists() else "")
    sid = re.search(r"raysubmit_\w+", submit.stdout + submit.stderr).group(0)
    job = _job(cluster, sid)
    print(f"job {sid}: {job['status']} in {time.monotonic() - t0:.0f} s; "
          f"{len(traffic.seen)} distinct TCP address pairs seen")
    assert job["status"] == "SUCCEEDED", _job_logs(cluster, sid)
    # A fresh interpreter: Ray reads RAY_AUTH_MODE at import (the head enables token auth, see submit.sh).
    probe = ("import sys; from ray.job_submission import JobSubmissionClient as C; "
             "print(C(sys.argv[1]).get_job_status(sys.argv[2]).value)")
    status = subprocess.run([sys.executable, "-c", probe, cluster.dashboard_url, sid],
                            env={**cluster.env, "RAY_AUTH_MODE": "token"}, timeout=120, capture_output=True, text=True)
    assert status.stdout.strip() == "SUCCEEDED", status.stdout + status.stderr[-2000:]

    steps = [r["step"] for r in _rows(run_dir) if "train/version" in r]
    assert steps == list(range(1, STEPS + 1))  # every step, once
    assert (run_dir / "checkpoints" / f"step_{STEPS}" / "meta.json").exists()  # written across nodes

    # Where each role ran: actors.json's PIDs, matched against Ray's record of this job's actors.
    roles = json.loads((run_dir / "actors.json").read_text())
    nodes = {n["node_id"]: n["node_ip"] for n in cluster.state("nodes")}
    actors = [a for a in cluster.state("actors") if a["job_id"] == job["job_id"]]
    ip_of = {a["pid"]: nodes[a["node_id"]] for a in actors if a.get("pid")}
    engine_ips = {ip_of[pid] for pid in roles["rollout"].values()}
    learner_ips = {ip_of[pid] for pid in roles["learner"].values()}
    queue_ip, driver_ip = ip_of[roles["replay"]], nodes[job["driver_node_id"]]
    print(f"engine on {engine_ips}, learner on {learner_ips}, queue on {queue_ip}, driver on {driver_ip}")
    assert queue_ip == driver_ip == cluster.ips[0]  # the queue is pinned to the driver's node, the head
    assert len(engine_ips) == len(learner_ips) == 1 and engine_ips | learner_ips == set(cluster.ips[1:])
    assert traffic.seen and not traffic.off_loopback(), traffic.off_loopback()  # every connection: on lo


def test_ablate_quick_runs_as_jobs_on_the_cluster(cluster, shared_dir):
    out = shared_dir / "ablate"
    env = {**cluster.env}
    env.pop("RAY_AUTH_MODE", None)  # as a user types the README's command: ablate must set token mode itself
    cmd = [sys.executable, "tools/study/ablate.py", "--study", "staleness", "--quick", "--address",
           cluster.dashboard_url, "--out", str(out), "--max-jobs", "1"]
    for s in MULTI_NODE:
        cmd += ["--set", s]
    t0 = time.monotonic()
    with Traffic(cluster) as traffic:
        proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=900, capture_output=True, text=True)
    print(f"ablate --quick on the cluster: exit {proc.returncode} in {time.monotonic() - t0:.0f} s\n"
          f"{proc.stdout[-2500:]}")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert not traffic.off_loopback(), traffic.off_loopback()

    jobs = {j["submission_id"]: j["status"] for j in cluster.state("jobs") if j.get("submission_id")}
    ours = {sid: st for sid, st in jobs.items() if sid.startswith("ablate-staleness-quick-")}
    assert ours == {"ablate-staleness-quick-eta0_none-s0": "SUCCEEDED",
                    "ablate-staleness-quick-eta1_decoupled-s0": "SUCCEEDED"}, jobs
    with (out / "staleness" / "runs.csv").open() as f:
        runs = list(csv.DictReader(f))
    assert [(r["cell"], r["seed"], r["steps"]) for r in runs] == [("eta0/none", "0", "4"),
                                                                   ("eta1/decoupled", "0", "4")]
    for r in runs:  # each cell's run wrote its own directory, with the multi-node settings
        cfg = load_config(out / "staleness" / "quick" / f"{r['cell'].replace('/', '_')}_s0" / "config.yaml")
        assert (cfg.placement.nnodes, cfg.transport.bind_host) == (3, "node")
    _assert_the_study_summarised(out / "staleness", runs, proc.stdout)
    # Resumable: a second invocation finds both runs finished (made with the very config a job ran, cluster
    # address included) and submits nothing.
    again = subprocess.run(cmd, cwd=REPO, env=env, timeout=600, capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout.count("finished earlier") == 2, again.stdout[-2000:]
    assert "submitted" not in again.stdout, again.stdout[-2000:]


def _assert_the_study_summarised(study: Path, runs: list[dict], out: str) -> None:
    """What ablate.py writes for a study: per-run figures (finite; positive where a rate, a time or a
    count), the curves at each validation, their PNG and the table."""
    import math

    for r in runs:
        assert float(r["distinct_val"]) >= 1000
        for col in ("avg_at_k_0", "avg_at_k_end", "samples", "wall_min"):
            assert math.isfinite(float(r[col])) and float(r[col]) > 0, (r["cell"], col, r[col])
        for col in ("gain_pt", "best_gain_pt", "truncated_first10", "staleness_mean"):
            assert math.isfinite(float(r[col])), (r["cell"], col, r[col])
        assert float(r["best_gain_pt"]) >= float(r["gain_pt"])
    assert float(runs[0]["staleness_mean"]) == 0.0  # eta 0: every sample from the current policy
    with (study / "curves.csv").open() as f:
        curves = list(csv.DictReader(f))
    assert sorted({int(c["step"]) for c in curves}) == [0, 2, 4]  # validation every 2 steps
    assert all(0 < float(c["avg_at_k"]) < 1 for c in curves)
    assert (study / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| eta0/none | 1 |" in (study / "table.md").read_text() and "eta1/decoupled" in out
