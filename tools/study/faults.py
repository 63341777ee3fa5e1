"""What a fault costs in generated tokens, with the work in flight thrown away and with it carried: on the
long-tail workload (configs/longtail_cpu.yaml) with 2 engines and progress reports on, each fault is run twice,
with ``replay.carry_partials`` false ("before": the reports are kept only to count what the fault throws
away) and true ("after": carried to the engine that takes each prompt next, or kept with the checkpoint):

* ``kill``: SIGKILL of engine 1 while it generates (the supervisor replaces it);
* ``scale``: ``async-dapo scale RUN_DIR --engines 1`` while both generate (the request that command writes,
  written here: the command's own start took up to 20 s on a loaded 2-core machine, past the run's end);
* ``restart``: SIGTERM to the run while it generates, then ``--resume`` (a checkpoint every step, so the run
  ends at its newest checkpoint's step and keeps what was in flight with it).

Each run trains ``--steps`` steps, the fault coming ``--delay`` seconds after step ``--fault-step`` was
logged. Reported per run: the tokens the fault threw away (``rollout/wasted_tokens/engine_loss``,
``scale_down``, ``restart``: what the reports held, i.e. every token in flight up to one cadence), the tokens
handed to another engine (``replay/partial_tokens_handed_out``) and continued or taken
(``rollout/carried_tokens``), those too old to continue (``carried_stale``), and one cadence's worth (the
leaving engine's tokens/s at the step before the fault x ``rollout.partial_every_s``: what an engine makes
after its last report, the bound on what is still lost). Then every trained sample of the steps after the
fault is checked against a transformers recompute of its whole sequence at each version it records (the
checkpoints give each version's weights; version 0 is model.path): the worst token's |difference| and the
worst sample's mean, against the bounds of the in-flight update test (1e-2 per token, 1e-4 per sample's
mean).

``--faults overhead`` measures what the reports themselves cost: one run without them and one with, no
fault, steps/s over the steps after ``--warmup`` (same invocation, one after the other).

    python tools/study/faults.py [--faults kill scale restart overhead] [--out runs/faults] [--cadence 0.5]

Outputs in OUT: faults.md / faults.csv / faults.jsonl, overhead.md / overhead.csv, and each run's directory
(a fault run finished there already is measured again, not run again).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: common.py
from common import (  # noqa: E402
    REPO, cli_command, finished, load_config, parser, records, save_results, step_records,
)

CONFIG = REPO / "configs" / "longtail_cpu.yaml"
TOL, MEAN_TOL = 1e-2, 1e-4  # tests/integration/test_rollout.py: engine against transformers, fp32
WASTE = {"kill": "engine_loss", "scale": "scale_down", "restart": "restart"}
FAULT_COLUMNS = ["fault", "arm", "steps", "wasted", "handed_out", "carried", "carried_stale", "one_cadence",
                 "checked_samples", "multi_version", "worst_token", "worst_mean", "over_bounds"]


def _sets(args, run_dir: Path, carry: bool | None, steps: int) -> list[str]:
    """The runs' settings; ``carry`` None: progress reports off."""
    # Each engine holds at most half of the admission window ((eta + 1) x B = 48): otherwise the engine that
    # asks first takes it all, and the other one has next to nothing in flight to lose.
    sets = [f"logging.run_dir={run_dir}", "placement.num_engines=2", "placement.engine_cpus=0.5",
            "rollout.max_inflight_prompts=24",
            f"learner.total_steps={steps}", "logging.val_every_steps=0", "logging.plan_profile=null"]
    if carry is None:
        return sets + ["rollout.partial_every_s=0"]
    return sets + [f"rollout.partial_every_s={args.cadence}", f"rollout.partial_every_tokens={args.every_tokens}",
                   f"replay.carry_partials={str(carry).lower()}"]


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while not any(r["step"] >= step for r in step_records(records(run_dir))):
        if proc.poll() is not None:
            raise SystemExit(f"{run_dir}: the run ended (rc {proc.returncode}) before step {step}")
        if time.time() > deadline:
            _end(proc)
            raise SystemExit(f"{run_dir}: no step {step} in {timeout_s:.0f} s")
        time.sleep(0.2)


def _end(proc: subprocess.Popen) -> None:
    """Our run's process group, by its PID, if it is still there (a failed wait)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)


def _inject(fault: str, run_dir: Path, proc: subprocess.Popen) -> None:
    if fault == "kill":
        pid = json.loads((run_dir / "actors.json").read_text())["rollout"]["1"]
        os.kill(pid, signal.SIGKILL)
    elif fault == "scale":  # the request `async-dapo scale RUN_DIR --engines 1` writes, without the CLI's start
        from async_dapo.checkpoint.run_dir import RunDir, write_scale_request

        write_scale_request(RunDir(run_dir), {"engines": 1, "asked_at": time.time()})
    else:
        os.kill(proc.pid, signal.SIGTERM)


def run_fault(args, fault: str, carry: bool) -> dict:
    """One run with the fault injected (and, for a restart, the resumed run); its last metrics row, the
    step before the fault's, and the run directory."""
    run_dir = args.out / f"{fault}-{'after' if carry else 'before'}"
    sets = _sets(args, run_dir, carry, args.steps) + ["checkpoint.every_steps=1", "checkpoint.keep_last=1000",
                                                      "logging.record_batches=true"]
    if finished(run_dir, args.steps):  # made by an earlier invocation (--out): measured again, not run again
        rows = step_records(records(run_dir))
        return {"run_dir": run_dir, "last": rows[-1], "at_fault": rows[args.fault_step - 1]}
    proc = _start(cli_command("train", CONFIG, sets), run_dir.parent / f"{run_dir.name}.log")
    try:
        _wait_step(run_dir, proc, args.fault_step, args.timeout)
        time.sleep(args.delay)
        _inject(fault, run_dir, proc)
        rc = proc.wait(timeout=args.timeout)
    finally:
        _end(proc)
    before = step_records(records(run_dir))
    if fault == "restart":
        resumed = subprocess.run(cli_command("train", CONFIG, sets) + ["--resume", str(run_dir)], cwd=REPO,
                                 env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=args.timeout,
                                 stdout=(run_dir.parent / f"{run_dir.name}.resume.log").open("w"),
                                 stderr=subprocess.STDOUT)
        rc = resumed.returncode
    rows = step_records(records(run_dir))
    if rc != 0 or rows[-1]["step"] != args.steps:
        raise SystemExit(f"{run_dir}: ended with rc {rc} at step {rows[-1]['step']} (see its log)")
    at_fault = next(r for r in before if r["step"] == args.fault_step)
    return {"run_dir": run_dir, "last": rows[-1], "at_fault": at_fault}


def summarise(args, fault: str, carry: bool, got: dict) -> dict:
    last, at_fault = got["last"], got["at_fault"]
    rate = at_fault.get("rollout/1/gen_tokens_per_s", at_fault.get("perf/gen_tokens_per_s", 0.0))
    if fault == "restart":  # every engine stops: both engines' rates
        rate = sum(v for k, v in at_fault.items() if k.startswith("rollout/") and k.endswith("/gen_tokens_per_s"))
    check = check_logprobs(got["run_dir"], args.fault_step + 1, args.steps)
    return {"fault": fault, "arm": "after" if carry else "before", "steps": int(last["step"]),
            "wasted": int(last.get(f"rollout/wasted_tokens/{WASTE[fault]}", 0)),
            "handed_out": int(last.get("replay/partial_tokens_handed_out", 0)),
            "carried": int(last.get("rollout/carried_tokens", 0)),
            "carried_stale": int(last.get("rollout/wasted_tokens/carried_stale", 0)),
            "one_cadence": int(rate * args.cadence), **check}


def _weights(run_dir: Path, base: str, version: int):
    """The policy of ``version``: model.path for 0, else the run's checkpoint of that version."""
    import torch
    from torch.distributed.checkpoint import load as dcp_load
    from transformers import AutoModelForCausalLM

    from async_dapo.checkpoint.run_dir import read_meta, step_dirs
    from async_dapo.checkpoint.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if version == 0:
        return model
    ckpt = next(p for _, p in step_dirs(run_dir / "checkpoints") if read_meta(p)[1] == version)
    state = {"model": model.state_dict()}
    dcp_load(state, storage_reader=SafeFileSystemReader(ckpt, max_entries=100_000), planner=SafeLoadPlanner(ckpt))
    model.load_state_dict(state["model"])
    return model


def check_logprobs(run_dir: Path, first: int, last: int) -> dict:
    """Every sample trained at steps ``first``..``last`` against a recompute of its whole sequence at each
    version it records."""
    import numpy as np
    import torch

    from async_dapo.learner.loss import token_logprobs
    from async_dapo.stream.wire import read_groups

    cfg = load_config(run_dir / "config.yaml")
    samples = [(g.prompt_ids, s) for step in range(first, last + 1)
               for g in read_groups(run_dir / "batches" / f"step_{step}.bin") for s in g.samples]
    diffs = [np.zeros(s.num_tokens) for _, s in samples]
    for version in sorted({int(v) for _, s in samples for v in np.unique(s.versions)}):
        model = _weights(run_dir, cfg.model.path, version)
        for (prompt, s), diff in zip(samples, diffs):
            at = s.versions == version
            if not at.any():
                continue
            x = torch.tensor(np.concatenate([prompt, s.response_ids]), dtype=torch.long)[None]
            with torch.no_grad():
                ref = token_logprobs(model(input_ids=x).logits[:, len(prompt) - 1: -1], x[:, len(prompt):],
                                     temperature=cfg.rollout.temperature)[0].numpy()
            diff[at] = np.abs(ref - s.logprobs)[at]
    worst_token = max((float(d.max()) for d in diffs if d.size), default=0.0)
    worst_mean = max((float(d.mean()) for d in diffs if d.size), default=0.0)
    return {"checked_samples": len(samples),
            "multi_version": sum(int(len(np.unique(s.versions)) > 1) for _, s in samples),
            "worst_token": worst_token, "worst_mean": worst_mean,
            "over_bounds": sum(int(d.size > 0 and (d.max() >= TOL or d.mean() >= MEAN_TOL)) for d in diffs)}


def overhead(args) -> list[dict]:
    """Steps/s without progress reports and with them, no fault, one run each."""
    rows = []
    arms = {"off": None, "on": True}
    for label, carry in ((a, arms[a]) for a in args.overhead_order):
        run_dir = args.out / f"overhead-{label}"
        sets = _sets(args, run_dir, carry, args.overhead_steps)
        proc = _start(cli_command("train", CONFIG, sets), args.out / f"overhead-{label}.log")
        try:
            rc = proc.wait(timeout=args.timeout)
        finally:
            _end(proc)
        steps = step_records(records(run_dir))
        if rc != 0 or len(steps) != args.overhead_steps:
            raise SystemExit(f"{run_dir}: ended with rc {rc} after {len(steps)} steps (see its log)")
        times = [r["perf/time_per_step"] for r in steps[args.warmup:]]
        rows.append({"reports": label, "cadence_s": 0.0 if carry is None else args.cadence,
                     "steps_per_s": 1.0 / statistics.fmean(times),
                     "gen_tokens_per_s": statistics.fmean(r["perf/gen_tokens_per_s"] for r in steps[args.warmup:]),
                     "partials_received": int(steps[-1].get("replay/partials_received", 0)),
                     "continued_tokens": int(steps[-1].get("rollout/continued_tokens", 0))})
    on, off = (next(r for r in rows if r["reports"] == a) for a in ("on", "off"))
    on["ratio"] = on["steps_per_s"] / off["steps_per_s"]
    return rows


def main() -> None:
    ap = parser(__file__, __doc__)
    ap.add_argument("--faults", nargs="+", default=["kill", "scale", "restart", "overhead"],
                    choices=["kill", "scale", "restart", "overhead"])
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "faults")
    ap.add_argument("--cadence", type=float, default=0.5, help="rollout.partial_every_s (seconds)")
    ap.add_argument("--every-tokens", type=int, default=8, help="rollout.partial_every_tokens")
    ap.add_argument("--steps", type=int, default=9, help="steps of each fault run")
    ap.add_argument("--fault-step", type=int, default=4, help="the fault comes after this step was logged")
    ap.add_argument("--delay", type=float, default=2.0, help="seconds after that step: mid-generation")
    ap.add_argument("--overhead-steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4, help="overhead: steps left out of steps/s")
    ap.add_argument("--overhead-order", nargs=2, default=["off", "on"], choices=["off", "on"],
                    help="overhead: which run goes first (a second invocation in the other order shows the drift)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = ap.parse_args()
    if sorted(args.overhead_order) != ["off", "on"]:
        ap.error("--overhead-order: each of off and on once")
    args.out = args.out.resolve()
    results = []
    for fault in [f for f in args.faults if f != "overhead"]:
        for carry in (False, True):
            results.append(summarise(args, fault, carry, run_fault(args, fault, carry)))
            print(json.dumps(results[-1]), flush=True)
    if results:
        print(save_results("faults", results, results, FAULT_COLUMNS, args.out))
    if "overhead" in args.faults:
        rows = overhead(args)
        print(save_results("overhead", rows, rows, ["reports", "cadence_s", "steps_per_s", "gen_tokens_per_s",
                                                   "partials_received", "continued_tokens", "ratio"], args.out))


if __name__ == "__main__":
    main()
