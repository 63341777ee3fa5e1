"""Several engines through the real stack (SGLang CPU engines, Ray, zmq, FSDP2/gloo), asserting what a user
of a fleet relies on (docs/reliability.md, docs/results/fleet_and_control_plane.md), in one run at the
config's default timeouts (one stack start for every fleet change):

* 1 -> 2 engines with ``async-dapo scale``: the added engine serves live weights;
* the added engine SIGKILLed: the other keeps generating and the learner keeps training while the replacement
  starts in the background (the learner's longest wait for data during the replacement asserted against the
  replacement's own duration, measured in the same run);
* the replacement hung inside a push, then its own replacement hung before it joined: each is named and
  replaced, and the learner's longest step stays within placement.health_check_timeout_s + its median step;
* 2 -> 1: the removed engine's prompts are released, and every admitted prompt is accounted for; the progress
  the leaving engines had reported (``rollout.partial_every_s``) goes with their prompts to the engine that
  takes them next.

On this 2-core machine 2 engines take ``placement.engine_cpus=0.5`` each.
"""

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import CPU_CONFIG, REPO
from tests.integration.test_faults_e2e import SMALL, _actors, _assert_prompts_trained_once, _cmd, _end, _rows, \
    _start, _train_rows, _wait

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TWO_ENGINES = ["--set", "placement.num_engines=2", "--set", "placement.engine_cpus=0.5"]
DROPS = ("dropped_all_correct", "dropped_all_wrong", "dropped_uniform", "dropped_stale", "dropped_capacity")


def _events(run_dir: Path, event: str | None = None) -> list[dict]:
    return [e for e in _rows(run_dir, "fleet.jsonl") if event is None or e["event"] == event]


def _prompt_ledger(run_dir: Path) -> dict[str, float]:
    """Where the admitted prompts went, each count from its own source (none derived from another): admitted
    (the queue's admission counter), trained (prompts.jsonl, written by the driver from the batches it
    trained), dropped (the policy's counters by reason), returned to the cursor (the queue's per-reason
    counter), open (the queue's ticket table itself) and queued (the queue's length), all at the last
    step; plus what fleet.jsonl says the removed engines released, by reason, before that step."""
    last = _train_rows(run_dir)[-1]
    by_reason = {k.removeprefix("replay/abandoned/"): v for k, v in last.items() if k.startswith("replay/abandoned/")}
    released: dict[str, float] = {}
    for e in _events(run_dir, "removed"):
        if e["time"] <= last["time"]:
            released[e["reason"]] = released.get(e["reason"], 0) + e["released_prompts"]
    return {"admitted": last["replay/admitted"],
            "trained": sum(len(r["prompts"]) for r in _rows(run_dir, "prompts.jsonl")),
            "handed_out": last["replay/handed_out"],
            "dropped": sum(last[f"replay/{d}"] for d in DROPS),
            "returned": sum(by_reason.values()), "abandoned": last["replay/abandoned"],
            "open": last["replay/open_tickets"], "running": last["replay/running"], "queued": last["replay/depth"],
            **{f"returned/{k}": v for k, v in by_reason.items()}, **{f"released/{k}": v for k, v in released.items()}}


def _assert_every_prompt_accounted(run_dir: Path, steps: int, batch: int) -> None:
    """Every admitted prompt ended exactly once: trained, dropped (by reason), given back to the cursor (by
    reason), or is still open or queued. A ticket the queue lost without counting it (admitted, never trained,
    dropped nor returned) breaks the sum; an engine's released prompts not counted under their reason, or
    counted without being released, break the per-reason match with fleet.jsonl."""
    n = _prompt_ledger(run_dir)
    print(f"\nprompt ledger: {n}")
    assert n["trained"] == n["handed_out"] == steps * batch, n  # the learner trained exactly steps x B
    assert n["returned"] == n["abandoned"], n  # per-reason counts add up to the total
    for reason in ("actor_failed", "scaled_down"):  # only removals give these back
        assert n.get(f"returned/{reason}", 0) == n.get(f"released/{reason}", 0), (reason, n)
    assert n["open"] == n["running"], n  # the ticket table agrees with the counters' in-flight figure
    assert n["admitted"] == n["trained"] + n["dropped"] + n["returned"] + n["open"] + n["queued"], n


def _assert_shares_match_what_each_engine_sent(rows: list[dict], batch: int) -> dict[int, float]:
    """Each engine's trained groups (its batch shares x B) against the groups its own process counted as sent:
    none is credited with more than it sent, each one's share of the trained groups is its share of the sent
    ones (the engines are identical: their drop rates differ by chance only), and every group they counted
    as sent reached the queue. The engines' counters in a row were asked at the previous step's end, so they
    are compared with the groups trained up to that step, and with the queue's count a step later."""
    i = max(k for k, m in enumerate(rows) if all(f"rollout/{r}/groups_sent" in m for r in (0, 1)))
    sent = {r: rows[i][f"rollout/{r}/groups_sent"] for r in (0, 1)}
    trained = {r: round(sum(m.get(f"rollout/{r}/batch_share", 0.0) * batch for m in rows[:i])) for r in (0, 1)}
    print(f"\nthrough step {i}: groups sent per engine {sent}, trained {trained}")
    assert sum(trained.values()) == i * batch, trained
    for r in (0, 1):
        assert trained[r] <= sent[r], (r, trained, sent)
        assert abs(trained[r] / (i * batch) - sent[r] / sum(sent.values())) < 0.15, (r, trained, sent)
    assert sum(sent.values()) <= rows[i]["replay/received"] + rows[i]["replay/rejected_unexpected"], (sent, rows[i])
    return trained


def _idle(m: dict) -> float:
    """What the learner lost in one step: waiting for data plus waiting for the previous push."""
    return m["perf/wait_data_s"] + m["perf/weight_push_stall_s"]


def _covered(rows: list[dict], t_fault: float, failed: dict, joined: dict) -> tuple[list, list, float]:
    """The steps whose stall belongs to the detection (from the fault to the first step after the engine was
    taken out), the steps trained while the replacement started (after that, until it joined), and the
    median step before the fault."""
    before = [m for m in rows if m["time"] < t_fault]
    first = next(i for i, m in enumerate(rows) if m["time"] > failed["time"])
    detecting = [m for m in rows[:first + 1] if m["time"] > t_fault]
    during = [m for m in rows[first + 1:] if m["time"] <= joined["time"]]
    return detecting, during, statistics.median(m["perf/time_per_step"] for m in before)


def _assert_survivor_covered(during: list[dict], recovery_s: float) -> None:
    """The learner kept training on engine 0's groups while the replacement started: many steps, none
    stalled near the replacement's time."""
    longest = max(_idle(m) for m in during)
    survivor_share = statistics.fmean(m.get("rollout/0/batch_share", 0.0) for m in during)
    print(f"{len(during)} steps trained while the replacement started ({recovery_s:.1f} s), the learner idle "
          f"{sum(_idle(m) for m in during):.1f} s of them (longest {longest:.2f} s); the survivor made "
          f"{survivor_share:.0%} of their groups")
    assert len(during) >= 5, (during, recovery_s)
    assert longest < 0.25 * recovery_s, (longest, recovery_s)
    assert survivor_share > 0.9  # engine 0 went on generating (the first step may hold groups of engine 1)


def _sigstop(pid: int) -> list[int]:
    """Stop the SGLang processes of the rollout actor ``pid`` (its scheduler and detokenizer: alive, silent)."""
    children = [c.pid for c in psutil.Process(pid).children(recursive=True)]
    for child in children:
        os.kill(child, signal.SIGSTOP)
    return children


def _first_event(run_dir: Path, event: str, proc, timeout: float, after: float = 0.0) -> dict:
    """The first ``event`` in fleet.jsonl after ``after``, looked for every 10 ms (a fault must land before
    what comes next)."""
    deadline = time.time() + timeout
    while not (found := [e for e in _events(run_dir, event) if e["time"] > after]):
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {event}"
        assert time.time() < deadline, f"timed out waiting for {event}"
        time.sleep(0.01)
    return found[0]


CAP = 5000  # learner.total_steps: far beyond what the test needs; it ends its run with `async-dapo stop`
DEFAULT_HC = 30.0  # placement.health_check_timeout_s's default: the run leaves every timeout at its default
DEFAULT_HC_INTERVAL = 10.0  # placement.health_check_interval_s's default


def test_a_fleet_scales_and_each_engine_fault_costs_the_learner_one_detection(tiny_model, tmp_path):
    """One run at the config's default timeouts, 1 engine (placement.max_engines=2), every fleet change a user
    meets, one after another (one stack start for all of them):

    1. ``async-dapo scale --engines 3`` is refused naming placement.max_engines; ``--engines 2`` adds an engine
       that joins, loads the live weights and serves;
    2. once it has served 4 steps, its rollout actor is SIGKILLed: noticed by the next heartbeat; the
       replacement starts in the background and the learner trains on the survivor's groups until it serves
       (the learner's longest wait for data meanwhile asserted against the replacement's own duration);
    3. once the replacement's groups are trained, its SGLang processes are SIGSTOPped: the next push hangs on
       it, where a heartbeat cannot judge it (loading weights is silent). The push is watched: past its bound,
       engine 1 is named by its stopped processes and taken out; engine 0 keeps the weights and serves;
    4. the moment the next replacement's engine is up (fleet.jsonl's "up", before it joined the weight group)
       its processes are SIGSTOPped too: a second failure while the first replacement joins. Its first
       heartbeat names it, and it is replaced again without ever serving (the third and last restart the
       default placement.max_engine_restarts allows);
    5. once the second replacement's groups are trained, ``--engines 1`` removes it: its in-flight prompts are
       released with what it had reported of them (``rollout.partial_every_s``), and every admitted prompt is
       accounted for.

    The learner's longest step over the whole run is asserted against health_check_timeout_s + the run's
    median step."""
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    cmd = [sys.executable, "-m", "async_dapo.cli", "train", "--config", str(CPU_CONFIG),
           "--set", f"logging.run_dir={run_dir}", *SMALL, "--set", "placement.max_engines=2",
           "--set", "placement.engine_cpus=0.5", "--set", f"learner.total_steps={CAP}",
           "--set", "rollout.partial_every_s=0.2", "--set", "rollout.partial_every_tokens=2"]
    proc = _start(cmd, log)
    stopped: list[int] = []
    try:
        added = _scale_up(run_dir, proc)
        t_kill, replaced = _kill_engine_1(run_dir, proc, added)
        stopped += _sigstop(_actors(run_dir)["rollout"]["1"])  # its groups were trained: it is serving
        t_stop = time.time()
        up = _first_event(run_dir, "up", proc, 600, after=t_stop)
        stopped += _sigstop(up["pid"])  # before it joined: it must never serve
        t_stop2 = time.time()
        joined = _first_event(run_dir, "joined", proc, 600, after=up["time"])
        _wait_for_groups_of(run_dir, proc, joined)
        _scale(run_dir, 1)
        removed = _first_event(run_dir, "removed", proc, 200, after=joined["time"])
        removed_at = len(_train_rows(run_dir))
        _wait(lambda: len(_train_rows(run_dir)) >= removed_at + 3, proc, 200, "3 steps after the scale-down")
        steps = _stop_and_finish(run_dir, proc, log)
    finally:
        _end(proc)
    rows, text = _train_rows(run_dir), log.read_text()
    assert [m["train/version"] for m in rows] == [float(v) for v in range(1, steps + 1)]
    times = [m["perf/time_per_step"] for m in rows]
    median, longest = statistics.median(times), max(times)
    print(f"\nlearner's longest step {longest:.2f} s (step {times.index(longest) + 1} of {steps}), median "
          f"{median:.2f} s, bound {DEFAULT_HC:.0f} + {median:.2f} s")
    assert longest <= DEFAULT_HC + median, [round(t, 2) for t in times]
    _assert_scaled_up(rows, added)
    _assert_killed_engine_replaced(run_dir, rows, text, t_kill, replaced)
    _assert_hangs_replaced(run_dir, rows, (t_stop, t_stop2), up, joined)
    assert [e["rank"] for e in _events(run_dir, "joined")] == [1, 1, 1]  # added, and two replacements
    assert not [p for p in stopped if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert removed["rank"] == 1 and removed["reason"] == "scaled_down"
    assert "shutdown of removed engines" not in text  # its graceful shutdown answered before it was ended
    assert all(m["rollout/engines"] == 1.0 for m in rows[removed_at + 1:])
    last = rows[-1]
    assert last.get("replay/abandoned/scaled_down", 0.0) == removed["released_prompts"]
    assert last["rollout/engine_restarts"] == 3.0  # the kill's and both hangs' replacements: a scale is not one
    assert "1" not in _actors(run_dir)["rollout"]  # gone from the fleet, and its placement group with it
    print(f"removed at step {removed_at} of {steps} with {removed['released_prompts']} in-flight prompts released")
    _assert_every_prompt_accounted(run_dir, steps, 16)
    _assert_prompts_trained_once(run_dir)
    _assert_reports_carried(last)


def _scale_up(run_dir: Path, proc) -> dict:
    """Step 1: the refused request, then 1 -> 2 engines; returns the added engine's "joined" event once it
    has served 4 steps."""
    _wait(lambda: len(_train_rows(run_dir)) >= 3, proc, 600, "step 3")
    refused = subprocess.run([sys.executable, "-m", "async_dapo.cli", "scale", str(run_dir), "--engines", "3"],
                             cwd=REPO, timeout=60, capture_output=True, text=True)
    assert refused.returncode == 2 and "placement.max_engines (2)" in refused.stderr, refused.stderr
    _scale(run_dir, 2)
    added = _first_event(run_dir, "joined", proc, 600)
    joined_at = len(_train_rows(run_dir))
    _wait(lambda: len(_train_rows(run_dir)) >= joined_at + 4, proc, 400, "4 steps on two engines")
    return added


def _kill_engine_1(run_dir: Path, proc, added: dict) -> tuple[float, dict]:
    """Step 2: SIGKILL of engine 1's rollout actor; returns the kill's time and its replacement's "joined"
    event once the replacement's groups were trained."""
    os.kill(_actors(run_dir)["rollout"]["1"], signal.SIGKILL)
    t_kill = time.time()
    replaced = _first_event(run_dir, "joined", proc, 600, after=added["time"])
    _wait_for_groups_of(run_dir, proc, replaced)
    return t_kill, replaced


def _wait_for_groups_of(run_dir: Path, proc, joined: dict) -> None:
    _wait(lambda: any(m.get("rollout/1/batch_share", 0.0) > 0 for m in _train_rows(run_dir)
                      if m["time"] > joined["time"]), proc, 200, "a step with the joined engine's groups")


def _assert_hangs_replaced(run_dir: Path, rows: list[dict], stops: tuple[float, float], up: dict,
                           joined: dict) -> None:
    """Steps 3 and 4: the push hang is named by the push watch, the hang before joining by the joiner's first
    heartbeat; engine 0 covered both replacements; the second replacement serves."""
    t_stop, t_stop2 = stops
    events = _events(run_dir)
    first = next(e for e in events if e["event"] == "failed" and e["time"] > t_stop)
    second = next(e for e in events if e["event"] in ("failed", "start_failed") and e["time"] > up["time"])
    print(f"push hang: taken out {first['time'] - t_stop:.1f} s after the SIGSTOP ({first['reason']}); "
          f"hang before joining: {second['event']} {second['time'] - t_stop2:.1f} s after the SIGSTOP "
          f"({second['reason']}); second replacement serving {joined['time'] - second['time']:.1f} s later; "
          f"regroups (wait, form, push): {[(round(e['wait_push_s'], 2), round(e['group_s'], 2), round(e['push_s'], 2)) for e in events if e['event'] == 'regrouped' and e['time'] > t_stop]}")
    assert first["rank"] == 1 and "hung inside the push of weight version" in first["reason"], first
    assert second["rank"] == 1 and "hung" in second["reason"], second
    assert joined["rank"] == 1 and joined["time"] > second["time"], joined
    _, during, _ = _covered(rows, t_stop, first, joined)
    _assert_survivor_covered(during, joined["time"] - first["time"])
    assert any(m.get("rollout/1/batch_share", 0.0) > 0 for m in rows if m["time"] > joined["time"])  # it serves


def _stop_and_finish(run_dir: Path, proc, log: Path) -> int:
    """``async-dapo stop``: the run makes its current step the last, checkpoints it and exits 0 (the test
    ends the run once it has seen what it asserts, whatever the machine's speed). Returns the steps trained."""
    done = subprocess.run([sys.executable, "-m", "async_dapo.cli", "stop", str(run_dir)],
                          cwd=REPO, timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    steps = len(_train_rows(run_dir))
    assert steps < CAP, "the run reached learner.total_steps before it was asked to stop"
    assert "stop requested" in log.read_text() and (run_dir / "checkpoints" / f"step_{steps}" / "meta.json").exists()
    return steps


def _scale(run_dir: Path, engines: int) -> None:
    done = subprocess.run([sys.executable, "-m", "async_dapo.cli", "scale", str(run_dir), "--engines", str(engines)],
                          cwd=REPO, timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _assert_reports_carried(last: dict) -> None:
    """Progress reports flowed from the real engines over the signed stream to the queue, and what the leaving
    engines had reported was carried, never counted as wasted (carrying is on); each carried report is handed
    out at most once, with the next admission of its prompt. How many are carried is the workload's: the tiny
    default's 3-17-token answers finish within one report, so a leaving engine's in-flight prompts are mostly
    still queued in its engine, without a token (here 0 of 18 and of 16 released ones had one); the real-engine
    continuation from a report is test_rollout's, on 300-token samples."""
    carried, handed, waiting = (last[f"replay/partials_{k}"] for k in ("carried", "handed_out", "waiting"))
    print(f"progress reports: {last['replay/partials_received']:.0f} kept, {carried:.0f} carried by leaving engines, "
          f"{handed:.0f} handed to another engine ({last['replay/partial_tokens_handed_out']:.0f} tokens), "
          f"{last['rollout/carried_tokens']:.0f} tokens continued, {last['rollout/wasted_tokens/carried_stale']:.0f} "
          f"too old")
    assert last["replay/partials_received"] > 0
    assert handed + waiting == carried  # each carried report is either handed out (once) or still waiting
    assert last["rollout/wasted_tokens/engine_loss"] == last["rollout/wasted_tokens/scale_down"] == 0
    assert last["rollout/partials_unsent"] == 0


def _assert_scaled_up(rows: list[dict], added: dict) -> None:
    """The added engine joined on request and trained groups of its own while two engines served."""
    assert added["rank"] == 1 and added["why"] == "added", added
    two = [m for m in rows if m["rollout/engines"] == 2.0]
    print(f"\nadded engine serving {added['seconds']:.1f} s after the request; {len(two)} steps on 2 engines; "
          f"engine 1's share of those steps' groups "
          f"{statistics.fmean(m.get('rollout/1/batch_share', 0.0) for m in two):.2f}")
    assert len(two) >= 3 and any(m.get("rollout/1/batch_share", 0.0) > 0 for m in two)


def _assert_killed_engine_replaced(run_dir: Path, rows: list[dict], text: str, t_fault: float, joined: dict) -> None:
    """SIGKILL of engine 1: noticed by the next heartbeat (sent at the first supervisor poll past
    placement.health_check_interval_s, its answer collected at the next one; the loop polls at least every
    2 s), and no step stalled longer than that plus a median step (a push in flight when the engine died
    leaves the survivor paused in it until then); the survivor covered the replacement's start; one group
    rebuild and one push per change; the replacement's groups are trained and the dead engine's in-flight
    prompts went back to the cursor."""
    failed = _events(run_dir, "failed")[0]
    regroups = [e for e in _events(run_dir, "regrouped") if e["time"] > t_fault]
    assert failed["rank"] == joined["rank"] == 1 and joined["why"] == "replacement", (failed, joined)
    detect_s, recovery_s = failed["time"] - t_fault, joined["time"] - failed["time"]
    detecting, during, normal = _covered(rows, t_fault, failed, joined)
    detect_stall = max((_idle(m) for m in detecting), default=0.0)
    print(f"SIGKILL: noticed after {detect_s:.1f} s (longest step stall meanwhile {detect_stall:.1f} s); "
          f"replacement serving {recovery_s:.1f} s after that; median step before {normal:.2f} s; each regroup "
          f"(wait for the push in flight, form the group, push): "
          f"{[(round(r['wait_push_s'], 2), round(r['group_s'], 2), round(r['push_s'], 2)) for r in regroups]} s")
    _assert_survivor_covered(during, recovery_s)
    polls = 2 * 2.0  # the heartbeat sent at the first poll past the interval, collected at the next
    assert detect_s <= DEFAULT_HC_INTERVAL + polls and detect_stall <= DEFAULT_HC_INTERVAL + polls + normal, \
        (detect_s, detect_stall, normal)
    # The survivor's cost of each change is one group rebuild and one push, not a restart.
    assert len(regroups) >= 2 and all(r["seconds"] < 10 for r in regroups[:2]), regroups
    assert regroups[0]["engines"] == [0] and regroups[1]["engines"] == [0, 1] and regroups[1]["joined"] == [1]
    assert any(m.get("rollout/1/batch_share", 0.0) > 0 for m in rows if joined["time"] < m["time"])
    assert rows[-1]["replay/abandoned/actor_failed"] >= 1  # its in-flight prompts went back to the cursor
    assert "process died" in text
