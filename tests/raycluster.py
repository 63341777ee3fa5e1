"""A real multi-node Ray cluster on one machine, for tests: Ray's own multi-node start, one ``ray start
--block`` per node, each raylet on its own loopback address (Linux routes all of 127.0.0.0/8 to ``lo``, so
127.0.0.2 and 127.0.0.3 need no setup), so actors that do not fit on one node land on different raylets exactly as on a
real cluster.

Owned and ended by process id: every ``ray start`` runs in its own session as a child of this process, and
``stop()`` ends what it started (the ``ray start`` processes and every process below them, recorded before
the first signal) and never calls ``ray stop``, which would end every Ray instance on the machine. Should
this process die without ``stop()``, each ``ray start`` gets SIGTERM (parent-death signal) and ends its node.

Kept apart from other Ray instances on the machine: every port is chosen free (the defaults -- GCS 6379,
dashboard 8265, client server 10001, dashboard agent 52365, worker ports 10002-19999 -- are what another
instance uses), the nodes get their own ``--temp-dir``, so ``ray start`` writes its address file
(``ray_current_cluster``) there and not into /tmp/ray, where a plain ``ray.init()`` looks for the cluster to
join (``joined_by_plain_init`` checks it), and no ``RAY_ADDRESS`` is exported.

Why 127.0.0.2 and 127.0.0.3, not 127.0.0.1: Ray 2.60 rewrites the address 127.0.0.1 (and localhost) in
``--node-ip-address`` and in a worker's ``--address`` to the machine's external address (measured: the worker
node then dials the GCS at the external IP), unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which in turn makes
``ray start --address`` refuse to start. Other loopback addresses are taken as given, so all traffic between
the nodes stays on ``lo``.
Token authentication: ``ray start`` enables it when ``~/.ray/auth_token`` exists; clients of the cluster
(the ray CLI, the job client) then need ``RAY_AUTH_MODE=token`` before ``ray`` is imported: ``env`` has it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")
STARTED = "Ray runtime started."


def _free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _end_with_parent() -> None:
    """In the child, before exec: SIGTERM when this (the test) process dies, even by SIGKILL, so a killed
    test session leaves no node behind (``ray start --block`` ends its node's processes on SIGTERM)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def client_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment for processes that use the cluster by explicit address: this venv first on PATH, no
    RAY_ADDRESS (nothing joins by default), RAY_AUTH_MODE=token when Ray keeps a token (as ray start uses it)."""
    env = {**(os.environ if base is None else base), "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    if "RAY_AUTH_MODE" not in env and (Path.home() / ".ray" / "auth_token").exists():
        env["RAY_AUTH_MODE"] = "token"
    return env


@dataclass
class LocalCluster:
    """``ray start`` nodes on loopback addresses: the head on ``ips[0]`` (GCS, dashboard, job API), one
    worker node per further address, ``cpus`` CPUs each (or per node, in order). ``start()`` returns once every
    node is alive."""

    ips: tuple[str, ...] = ("127.0.0.2", "127.0.0.3")
    cpus: int | tuple[int, ...] = 1
    start_timeout_s: float = 240
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rmn", dir="/tmp")))  # short: sockets
    procs: list[subprocess.Popen] = field(default_factory=list)
    gcs_port: int = 0
    dashboard_port: int = 0

    @property
    def gcs_address(self) -> str:
        return f"{self.ips[0]}:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def env(self) -> dict[str, str]:
        return client_env()

    def log(self, i: int) -> Path:
        return self.root / f"node{i}.log"

    def start(self) -> LocalCluster:
        self.gcs_port, self.dashboard_port = _free_port(self.ips[0]), _free_port()
        try:
            for i, ip in enumerate(self.ips):
                self._start_node(i, ip)
            self._wait_nodes()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, i: int, ip: str) -> None:
        cpus = self.cpus[i] if isinstance(self.cpus, tuple) else self.cpus
        common = ["--block", "--node-ip-address", ip, "--num-cpus", str(cpus), "--temp-dir",
                  str(self.root / f"n{i}"), "--disable-usage-stats", "--min-worker-port", "0",
                  "--max-worker-port", "0", "--dashboard-agent-listen-port", str(_free_port(ip))]
        env = client_env()
        env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # =0 would forbid the worker nodes
        if i == 0:
            cmd = [RAY, "start", "--head", "--port", str(self.gcs_port), "--include-dashboard", "true",
                   "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
                   "--ray-client-server-port", str(_free_port(ip)), *common]
        else:
            cmd = [RAY, "start", "--address", self.gcs_address, *common]
        with self.log(i).open("w") as log:
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True,
                                               preexec_fn=_end_with_parent))
        deadline = time.monotonic() + self.start_timeout_s
        while STARTED not in self.log(i).read_text():
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start on {ip} did not start:\n{self.log(i).read_text()[-3000:]}")
            time.sleep(0.5)

    def state(self, kind: str) -> list[dict]:
        """``ray list KIND`` (nodes, actors, jobs, ...) of this cluster, dead entries included, as dicts."""
        out = subprocess.run([RAY, "list", kind, "--address", self.dashboard_url, "--format", "json", "--detail",
                              "--limit", "10000"], env=self.env, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"ray list {kind}: {out.stdout[-2000:]}{out.stderr[-2000:]}")
        return json.loads(out.stdout)

    def alive_nodes(self) -> dict[str, str]:
        """node id -> node IP of the nodes alive now."""
        return {n["node_id"]: n["node_ip"] for n in self.state("nodes") if n["state"] == "ALIVE"}

    def _wait_nodes(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                ips = sorted(self.alive_nodes().values())
            except RuntimeError:  # the dashboard may answer a few seconds after the head started
                ips = []
            if ips == sorted(self.ips):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes alive: {ips}, expected {list(self.ips)}")
            time.sleep(1)

    def joined_by_plain_init(self, env: dict[str, str]) -> bool:
        """Would a plain ``ray.init()`` in a process with ``env`` join this cluster? (Ray's own address
        resolution, the function ray.init calls: RAY_ADDRESS, then /tmp/ray/ray_current_cluster.)"""
        probe = ("from ray._private.services import canonicalize_bootstrap_address as c; "
                 "print(c(None))")
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120,
                             check=True)
        return out.stdout.strip().splitlines()[-1].endswith(f":{self.gcs_port}")

    def connections(self) -> set[tuple[str, str]]:
        """(local, remote) IP pairs of the TCP connections that the cluster's processes hold right now."""
        import psutil

        pids = {p.pid for p in self._tree()}
        return {(c.laddr.ip, c.raddr.ip) for c in psutil.net_connections("tcp") if c.pid in pids and c.raddr}

    def _tree(self) -> list:
        import psutil

        procs = []
        for p in self.procs:
            try:
                root = psutil.Process(p.pid)
                procs += [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        return procs

    def stop(self, grace_s: float = 20) -> list[str]:
        """End every process this cluster started (by PID, the tree under each ``ray start`` recorded first):
        SIGTERM, then SIGKILL after ``grace_s``. Returns the command lines that needed SIGKILL."""
        import psutil

        procs = self._tree()
        for p in reversed(self.procs):  # worker nodes first: ray start --block ends its node on SIGTERM
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=grace_s / 2)
        for p in alive:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(alive, timeout=grace_s / 2)
        killed = []
        for p in alive:
            try:
                killed.append(" ".join(p.cmdline()[:2]))
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)
        return killed
