"""The orchestrator's validation beside training: a validation still running never holds the
loop, a finished one is logged at the step it started, a failed or late one is skipped with a warning and
the run goes on. Ray's wait and the engines are stand-ins here; tests/integration/test_train_e2e.py runs
the real thing."""

import logging
import time

import pytest

from async_dapo.config import load_config
from async_dapo.data.rows import Message, PromptRow, RewardSpec
from async_dapo.orchestrator import Run
from async_dapo.waits import ActorDied


def _row(truth: str, q: str) -> PromptRow:
    return PromptRow(data_source="t", prompt=[Message(role="user", content=q)], ability="math",
                     reward_model=RewardSpec(ground_truth=truth), extra_info={})


class Writer:
    def __init__(self):
        self.rows = []

    def write(self, step, metrics):
        self.rows.append((step, metrics))


class Placed:
    def __init__(self, answer):
        self.answer = answer

    def get(self, refs, what, timeout_s=None):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def _run(monkeypatch, ready: bool, answer, started_s_ago: float = 0.0) -> Run:
    import ray

    run = Run(load_config(None, ["logging.val_timeout_s=60"]), None)
    run.metrics, run.placed = Writer(), Placed(answer)
    run._val_rows = [_row("1", "a"), _row("2", "b"), _row("3", "c")]
    run._val = {"step": 40, "parts": [[0, 2], [1]], "refs": ["r0", "r1"], "t0": time.perf_counter() - started_s_ago}
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (refs, []) if ready else ([], refs))
    return run


SHARES = [{"scores": [(1.0, 1.0, 1.0), (0.0, 0.0, 0.0)], "gen_tokens": 5, "version_min": 40, "version_max": 42},
          {"scores": [(0.5, 1.0, 0.0)], "gen_tokens": 2, "version_min": 41, "version_max": 41}]


def test_a_running_validation_does_not_hold_the_loop(monkeypatch):
    run = _run(monkeypatch, ready=False, answer=SHARES)
    run._collect_validation(block=False)
    assert run._val is not None and run.metrics.rows == []


def test_a_finished_validation_is_logged_at_the_step_it_started_with_its_versions(monkeypatch):
    run = _run(monkeypatch, ready=True, answer=SHARES)
    run._collect_validation(block=False)
    ((step, m),) = run.metrics.rows
    assert step == 40 and run._val is None
    assert m["val/avg_at_k"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)  # rows a, b, c in their own order
    assert (m["val/version"], m["val/version_max"], m["val/gen_tokens"]) == (40.0, 42.0, 7.0)


@pytest.mark.parametrize(("ready", "answer", "ago", "why"), [
    (True, ActorDied("validation: actor died (killed)"), 0.0, "actor died"),
    (False, SHARES, 61.0, "logging.val_timeout_s"),  # not done 60 s after its start: given up
])
def test_a_failed_or_late_validation_is_skipped_and_the_run_goes_on(monkeypatch, caplog, ready, answer, ago, why):
    run = _run(monkeypatch, ready=ready, answer=answer, started_s_ago=ago)
    with caplog.at_level(logging.WARNING, logger="async_dapo"):
        run._collect_validation(block=False)
    assert run.metrics.rows == [] and run._val is None
    assert "validation at step 40 skipped" in caplog.text and why in caplog.text


def test_a_validation_due_while_the_last_one_runs_is_skipped_and_counted(monkeypatch, caplog):
    """The decided behaviour: at the next val_every_steps a still-running validation is left alone, the
    new one is not started (counted in val/skipped, one warning), and the learner does not wait."""
    run = _run(monkeypatch, ready=False, answer=SHARES)
    run.cfg = load_config(None, ["logging.val_timeout_s=60", "learner.total_steps=200"])
    started = []
    monkeypatch.setattr(run, "_start_validation", lambda step: started.append(step))
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="async_dapo"):
        run.validate(80)
    assert time.perf_counter() - t0 < 1.0  # no wait for the running one
    assert started == [] and run._val["step"] == 40 and run._val_skipped == 1
    assert "validation at step 80 skipped: the one started at step 40 is still running" in caplog.text


def test_at_the_last_step_the_running_validation_is_awaited_then_the_final_one_starts(monkeypatch):
    import ray

    run = _run(monkeypatch, ready=False, answer=SHARES)
    run.cfg = load_config(None, ["logging.val_timeout_s=60", "learner.total_steps=200"])
    waited = []

    def wait(refs, num_returns, timeout):
        waited.append(timeout)
        return (refs, []) if timeout > 0 else ([], refs)  # answers once someone is willing to wait

    monkeypatch.setattr(ray, "wait", wait)
    started = []
    monkeypatch.setattr(run, "_start_validation", lambda step: started.append(step))
    run.validate(200)
    assert waited and waited[0] > 0 and started == [200] and run._val_skipped == 0
    assert [step for step, _ in run.metrics.rows] == [40]  # the previous one was logged at its own step
