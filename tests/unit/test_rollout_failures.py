"""The rollout actor's failure handling around one engine request, with a stand-in tokenizer manager (the
engine itself is exercised in tests/integration): a request the engine aborts on its own is retried
rollout.max_abort_retries times then fails the group as "aborted"; a request with no answer fails it as
"timeout" and is aborted in the engine; aborts caused by our own weight update never count; an exception
in the reward function fails the group as "score_error"; prompts follow data.truncation."""

import asyncio

import pytest

from async_dapo.config import load_config
from async_dapo.data import synthetic_rows
from async_dapo.rollout import GroupFailed, _Session, failure_reason
from async_dapo.wire import OversizedMessage


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

    def abort_request(self, rid):
        self.aborted.append(rid)


def _session(script, *overrides):
    cfg = load_config(None, ["rollout.max_abort_retries=2", "rollout.request_timeout_s=0.3", *overrides])
    return _Session(cfg, 0, 0, None, [], FakeTM(script))


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


def test_reward_exception_fails_the_group_as_score_error(tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def score(ds, sol, gt, extra):\n    raise KeyError('boom')\n")
    s = _session(["ok"], f"reward.function={bad}:score")
    row = synthetic_rows("train", 1, levels=[1], heldout_fraction=0.1, seed=0)[0]

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "Answer: 1"

    s.tokenizer = Tok()
    out = {"output_ids": [5], "_start_version": 0, "_seconds": 0.1,
           "meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [(-0.1, 5)]}}
    with pytest.raises(GroupFailed) as err:
        s._score(row, out)
    assert err.value.reason == "score_error" and "boom" in str(err.value)


def test_a_users_reward_function_scores_the_samples(tmp_path):
    """reward.function as a verl user writes it: compute_score(data_source, solution_str, ground_truth,
    extra_info) returning verl's dict; the sample carries its score and acc (+ the overlong penalty)."""
    user = tmp_path / "my_reward.py"
    user.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                    "    ok = solution_str.strip().endswith(ground_truth) and extra_info['split'] == 'train'\n"
                    "    return {'score': 0.5 if ok else -0.5, 'acc': ok, 'pred': solution_str[-1:]}\n")
    s = _session(["ok"], f"reward.function={user}:compute_score", "reward.overlong_buffer_enable=false")
    row = synthetic_rows("train", 1, levels=[1], heldout_fraction=0.1, seed=0)[0]

    class Tok:
        def __init__(self, text):
            self.text = text

        def decode(self, ids, skip_special_tokens=True):
            return self.text

    out = {"output_ids": [5], "_start_version": 0, "_seconds": 0.1,
           "meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [(-0.1, 5)]}}
    s.tokenizer = Tok(f"so it is {row.ground_truth}")
    right = s._score(row, out)
    s.tokenizer = Tok("no idea")
    wrong = s._score(row, out)
    assert (right.score, right.reward, right.acc) == (0.5, 0.5, True)
    assert (wrong.score, wrong.reward, wrong.acc) == (-0.5, -0.5, False)


def test_prompt_truncation_follows_the_config():
    long = list(range(100))
    s = _session(["ok"], "data.max_prompt_length=64", "rollout.engine.context_length=512")
    with pytest.raises(GroupFailed) as err:
        s._fit(long, 3)
    assert err.value.reason == "prompt_too_long"
    s = _session(["ok"], "data.max_prompt_length=64", "data.truncation=left", "rollout.engine.context_length=512")
    assert s._fit(long, 3) == list(range(36, 100))  # verl's left truncation keeps the last tokens
    assert s._fit(long[:10], 3) == long[:10]


@pytest.mark.parametrize("exc, reason", [
    (GroupFailed("timeout", "x"), "timeout"), (OversizedMessage("big"), "oversized"),
    (TimeoutError("hwm"), "send_timeout"), (RuntimeError("engine"), "engine_error"),
])
def test_failure_reasons(exc, reason):
    assert failure_reason(exc) == reason

