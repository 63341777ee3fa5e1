"""The rollout actor's failure handling around one engine request, with a stand-in tokenizer manager (the
engine itself is exercised in tests/integration): a request the engine aborts on its own is retried
rollout.max_abort_retries times then fails the group as "aborted"; a request with no answer fails it as
"timeout" and is aborted in the engine; aborts caused by our own weight update never count; an exception
in the reward function fails the group as "score_error"; prompts follow data.truncation."""

import asyncio
import threading
import time

import pytest

from async_dapo.config import load_config
from async_dapo.data.rows import synthetic_rows
from async_dapo.rollout.actor import EngineSession, GroupFailed, RolloutWorker, failure_reason, fit_prompt, gather_all
from async_dapo.data.scoring import ScoringFailed
from async_dapo.stream.wire import OversizedMessage


class FakeTM:
    """Answers generate_request with scripted results: 'abort', 'ok' or 'hang'."""

    def __init__(self, script):
        self.script, self.calls, self.aborted, self.batches, self.rids = list(script), 0, [], 0, []
        self.last_receive_tstamp = 0.0  # no output ever reaches this tokenizer manager by itself

    def generate_request(self, obj, request):
        # A batch (n completions of one prompt, as the rollout sends a group) takes one script entry each.
        batch = isinstance(obj.rid, list)
        self.rids.append(obj.rid)
        kinds = [self._next() for _ in (obj.rid if batch else [obj.rid])]
        self.batches += batch

        async def gen():
            if "hang" in kinds:
                await asyncio.sleep(3600)
            outs = [{"output_ids": [5], "meta_info": {"finish_reason": {"type": "abort" if k == "abort" else "stop"},
                                                      "output_token_logprobs": [(-0.1, 5)]}} for k in kinds]
            yield outs if batch else outs[0]

        return gen()

    def _next(self):
        kind = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        return kind

    def abort_request(self, rid="", abort_all=False):
        self.aborted.append("<all>" if abort_all else rid)


def _session(script, *overrides):
    cfg = load_config(None, ["rollout.max_abort_retries=2", "rollout.request_timeout_s=0.3", *overrides])
    return EngineSession(cfg, 0, 0, None, [], FakeTM(script))


def test_foreign_aborts_are_retried_then_fail_the_group():
    s = _session(["abort", "abort", "ok"])
    out = asyncio.run(s.sample_once([1, 2], {}))
    assert out["output_ids"] == [5] and s.tm.calls == 3 and s.stats.resampled == 2
    s = _session(["abort"])
    with pytest.raises(GroupFailed) as err:
        asyncio.run(s.sample_once([1, 2], {}))
    assert err.value.reason == "aborted" and s.tm.calls == 3  # 1 try + max_abort_retries (2)


def test_a_group_is_one_batch_and_only_its_aborted_samples_are_redrawn():
    # 4 samples in one batch request; samples 2 and 4 aborted by the engine -> each redrawn alone.
    s = _session(["ok", "abort", "ok", "abort", "ok", "ok"])
    outs = asyncio.run(s.sample_n([1, 2], {}, 4))
    assert s.tm.batches == 1 and s.tm.calls == 6 and s.stats.resampled == 2
    assert [o["output_ids"] for o in outs] == [[5]] * 4 and all("_start_version" in o for o in outs)
    # A foreign abort in the batch is the first try: max_abort_retries (2) more, then the group fails.
    s = _session(["abort"])
    with pytest.raises(GroupFailed) as err:
        asyncio.run(s.sample_n([1], {}, 2))
    assert err.value.reason == "aborted"
    assert s.tm.calls == 2 + 2 * 2  # the batch of 2, then 2 retries for each of its 2 samples


def test_a_hung_batch_times_out_and_aborts_every_sample():
    s = _session(["hang"])
    with pytest.raises(GroupFailed) as err:
        asyncio.run(s.sample_n([1], {}, 3))
    assert err.value.reason == "timeout" and len(s.tm.aborted) == 3 and len(set(s.tm.aborted)) == 3


class _EosTok:
    eos_token_id = 2


def test_heartbeat_passes_for_a_healthy_engine_and_fails_for_a_silent_one():
    s = _session(["ok"])
    s.tokenizer = _EosTok()
    asyncio.run(s.probe(2.0))  # one single request with its own probe id, answered: alive
    assert s.tm.calls == 1 and s.tm.batches == 0 and s.tm.rids[0].startswith("probe-")
    s = _session(["hang"])
    s.tokenizer = _EosTok()
    with pytest.raises(RuntimeError, match="hung"):
        asyncio.run(s.probe(0.2))
    assert s.tm.aborted == s.tm.rids and s.tm.aborted[0].startswith("probe-")  # not left in the engine


def test_aborts_by_our_own_update_are_not_counted():
    s = _session(["abort"] * 5 + ["ok"])
    real = s.tm.generate_request

    def during_update(obj, request):
        s.updates_started += 1  # each abort happens while a weight update starts
        return real(obj, request)

    s.tm.generate_request = during_update
    assert asyncio.run(s.sample_once([1], {}))["output_ids"] == [5] and s.tm.calls == 6


def test_unanswered_request_times_out_and_is_aborted():
    s = _session(["hang"])
    with pytest.raises(GroupFailed) as err:
        asyncio.run(s.sample_once([1], {}))
    assert err.value.reason == "timeout" and len(s.tm.aborted) == 1


def _reply(ids=(5,)):
    return {"output_ids": list(ids), "_start_version": 0, "_seconds": 0.1,
            "meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [(-0.1, i) for i in ids]}}


def _row():
    return synthetic_rows("train", 1, levels=[1], heldout_fraction=0.1, seed=0)[0]


def _closing(s):
    """Run the scenario, then stop the session's reward workers (real processes)."""
    class Ctx:
        def __enter__(self):
            return s

        def __exit__(self, *exc):
            if s._scorer is not None:
                s._scorer.close()
    return Ctx()


def test_reward_exception_fails_the_group_as_score_error(tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def score(ds, sol, gt, extra):\n    raise KeyError('boom')\n")
    with _closing(_session(["ok"], f"reward.function={bad}:score")) as s:
        with pytest.raises(ScoringFailed) as err:
            asyncio.run(s._score_texts(_row(), ["Answer: 1"]))
    assert err.value.reason == "score_error" and "boom" in str(err.value)
    assert failure_reason(err.value) == "score_error"


def test_a_users_reward_function_scores_the_samples(tmp_path):
    """reward.function as a verl user writes it: compute_score(data_source, solution_str, ground_truth,
    extra_info) returning verl's dict; the sample carries its score and acc (+ the overlong penalty)."""
    user = tmp_path / "my_reward.py"
    user.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                    "    ok = solution_str.strip().endswith(ground_truth) and extra_info['split'] == 'train'\n"
                    "    return {'score': 0.5 if ok else -0.5, 'acc': ok, 'pred': solution_str[-1:]}\n")
    row = _row()
    with _closing(_session(["ok"], f"reward.function={user}:compute_score", "reward.overlong_buffer_enable=false")) as s:
        results = asyncio.run(s._score_texts(row, [f"so it is {row.ground_truth}", "no idea"]))
        right, wrong = (s._sample(_reply(), r) for r in results)
    assert (right.score, right.reward, right.acc) == (0.5, 0.5, True)
    assert (wrong.score, wrong.reward, wrong.acc) == (-0.5, -0.5, False)


HANGS = {
    "sleep": "import time\ndef score(ds, sol, gt, extra):\n    time.sleep(600)\n",
    # catastrophic backtracking: holds the GIL for the whole match, so no thread could have saved the loop
    "regex": "import re\ndef score(ds, sol, gt, extra):\n    re.match(r'(a+)+$', 'a' * 64 + 'b')\n    return 1.0\n",
}


@pytest.mark.parametrize("kind", sorted(HANGS))
def test_a_hanging_reward_costs_one_group_and_never_blocks_the_engine_loop(tmp_path, kind):
    """reward.timeout_s: the scorer runs in a worker process; the event loop keeps serving meanwhile (a
    ticker coroutine advances), the group fails as score_timeout after the bound, and the next group is
    scored by a fresh worker."""
    hang = tmp_path / "hang.py"
    hang.write_text(HANGS[kind])
    ok = tmp_path / "ok.py"
    ok.write_text("def score(ds, sol, gt, extra):\n    return 1.0\n")

    async def scenario(s):
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        task = asyncio.ensure_future(ticker())
        t0 = time.monotonic()
        with pytest.raises(ScoringFailed) as err:
            await s._score_texts(_row(), ["Answer: 1"] * 4)
        waited = time.monotonic() - t0
        task.cancel()
        return err.value, waited, ticks

    with _closing(_session(["ok"], f"reward.function={hang}:score", "reward.timeout_s=1.5")) as s:
        err, waited, ticks = asyncio.run(scenario(s))
    assert err.reason == "score_timeout" and "reward.timeout_s" in str(err)
    assert 1.5 <= waited < 15  # the bound, plus a worker's start on a loaded box
    assert ticks >= 10  # the loop ran all along (20 ticks per second while the scorer hung)


def test_a_killed_scorer_is_replaced_and_scores_the_next_group(tmp_path):
    flaky = tmp_path / "flaky.py"
    flaky.write_text("import time\ndef score(ds, sol, gt, extra):\n"
                     "    if sol == 'hang':\n        time.sleep(600)\n    return 1.0 if sol == 'Answer: 1' else -1.0\n")
    with _closing(_session(["ok"], f"reward.function={flaky}:score", "reward.timeout_s=1")) as s:
        with pytest.raises(ScoringFailed):
            asyncio.run(s._score_texts(_row(), ["hang"]))
        results = asyncio.run(s._score_texts(_row(), ["Answer: 1", "Answer: 2"]))
    assert [r.score for r in results] == [1.0, -1.0]


class PausingTM(FakeTM):
    """A tokenizer manager whose pause (or whose drain: a request that never leaves) fails."""

    def __init__(self, fail_pause):
        super().__init__(["ok"])
        self.fail_pause, self.continued = fail_pause, 0
        self.rid_to_state = {} if fail_pause else {"stuck": object()}

    async def pause_generation(self, obj):
        if self.fail_pause:
            raise RuntimeError("pause refused")

    async def continue_generation(self, obj):
        self.continued += 1


@pytest.mark.parametrize("mode", ["inflight", "abort", "drain"])
def test_a_failed_pause_or_drain_does_not_wedge_the_engine(mode):
    """update(): the events cleared for the update are set again on every path, so a failed drain or pause
    costs that update, not the engine (before, sampling and admission stayed closed until the heartbeat
    killed the engine)."""
    s = _session(["ok"], "rollout.drain_timeout_s=0.2")
    s.tm = PausingTM(fail_pause=mode != "drain")
    with pytest.raises((RuntimeError, TimeoutError), match="pause refused|drain"):
        asyncio.run(s.update([], "g", 1, mode))
    assert s.weights_ready.is_set() and s.admitting.is_set() and s.update_started_at is None
    assert s.version == 0 and s.tm.continued == (0 if mode == "drain" else 1)
    # and the engine samples again at once
    assert asyncio.run(asyncio.wait_for(s.sample_once([1], {}), 5))["output_ids"] == [5]


def test_an_abort_update_aborts_every_request_and_its_wait_is_bounded():
    """update(abort): every running request is aborted at once, and the wait for them to leave the engine
    is bounded by rollout.drain_timeout_s; the update fails naming it and the engine samples again."""
    s = _session(["ok"], "rollout.drain_timeout_s=0.2")
    s.tm = PausingTM(fail_pause=False)  # a request that never leaves the table
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"abort: 1 requests still running after 0 s \(rollout.drain_timeout_s\)"):
        asyncio.run(s.update([], "g", 1, "abort"))
    assert 0.2 <= time.monotonic() - t0 < 2 and s.tm.aborted == ["<all>"]
    assert s.weights_ready.is_set() and s.admitting.is_set() and s.version == 0 and s.tm.continued == 1


def test_a_timed_out_call_is_cancelled_and_its_requests_aborted():
    """RolloutWorker._call: on expiry the coroutine is cancelled on the engine loop and the requests it
    started are aborted before the TimeoutError reaches the caller."""
    s = _session(["hang"], "rollout.request_timeout_s=600")
    worker = RolloutWorker.__new__(RolloutWorker)  # the facade without an engine: only its loop and session
    worker.loop, worker.session = asyncio.new_event_loop(), s
    thread = threading.Thread(target=worker.loop.run_forever, daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="generate: no result in 0 s"):
            worker._call(gather_all(s.sample_once(p, {}) for p in [[1], [2]]), 0.3, "generate")
        assert time.monotonic() - t0 < 5
        assert sorted(s.tm.aborted) == sorted(s.tm.rids)  # both requests, aborted by the time we returned
        pending = [t for t in asyncio.all_tasks(worker.loop) if not t.done()]
        assert pending == []  # nothing of the call is left running on the loop
    finally:
        worker.loop.call_soon_threadsafe(worker.loop.stop)
        thread.join(5)


def test_prompt_truncation_follows_the_config():
    long = list(range(100))
    s = _session(["ok"], "data.max_prompt_length=64", "rollout.engine.context_length=512")
    with pytest.raises(GroupFailed) as err:
        fit_prompt(s.cfg, long, 3)
    assert err.value.reason == "prompt_too_long"
    s = _session(["ok"], "data.max_prompt_length=64", "data.truncation=left", "rollout.engine.context_length=512")
    assert fit_prompt(s.cfg, long, 3) == list(range(36, 100))  # verl's left truncation keeps the last tokens
    assert fit_prompt(s.cfg, long[:10], 3) == long[:10]


@pytest.mark.parametrize("exc, reason", [
    (GroupFailed("timeout", "x"), "timeout"), (OversizedMessage("big"), "oversized"),
    (TimeoutError("hwm"), "send_timeout"), (RuntimeError("engine"), "engine_error"),
])
def test_failure_reasons(exc, reason):
    assert failure_reason(exc) == reason



class _Remote:
    def __init__(self, fn):
        self.remote = fn


class StuckQueue:
    """A replay queue whose calls never answer (its actor wedged) except those named in ``answers``."""

    def __init__(self, answers=()):
        self.calls = []
        for name in ("register_producer", "admit", "abandon"):
            setattr(self, name, _Remote(self._call(name, name in answers)))

    def _call(self, name, answer):
        async def call(*args):
            self.calls.append(name)
            if not answer:
                await asyncio.sleep(3600)
            return [] if name == "admit" else None
        return call


BOUNDED = ("placement.call_timeout_s=1", "weight_sync.timeout_s=0.3", "learner.collective_timeout_s=0.5")


@pytest.mark.parametrize("stuck, answers", [("register", ()), ("admit", ("register_producer",))])
def test_the_producers_queue_calls_are_bounded(stuck, answers):
    """register and admit: placement.call_timeout_s (+ the admit call's own wait); on expiry the producer
    ends with an error naming the call, and the heartbeat reports it ("producer ended")."""
    s = _session(["ok"], *BOUNDED)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"rollout actor 0: {stuck}: no answer from the replay queue"):
        asyncio.run(s.produce(StuckQueue(answers)))
    limit = 1 + (5 if stuck == "admit" else 0)
    assert limit <= time.monotonic() - t0 < limit + 5


def test_an_unanswered_abandon_is_logged_and_the_ticket_left_to_expire(caplog):
    s = _session(["hang"], *BOUNDED, "rollout.request_timeout_s=0.2")
    s.queue = StuckQueue(("register_producer", "admit"))
    with caplog.at_level("ERROR", logger="async_dapo.rollout.actor"):
        asyncio.run(s._emit("g-1", 0, 0, 0))
    assert s.queue.calls == ["abandon"] and s.stats.failed_groups == 1
    assert any("abandon g-1: no answer from the replay queue in 1 s" in r.getMessage() for r in caplog.records)
