"""rollout.partial_rollout: a sample an abort-mode update cut short is continued from prompt + its tokens on the
new weights, with its tokens' log-probs and versions kept, instead of drawn again from scratch; what is not
kept is counted as aborted. A stand-in tokenizer manager plays the engine (tests/integration runs the real one)."""

import asyncio

import numpy as np
import pytest

from async_dapo.config import load_config
from async_dapo.data.reward import RewardResult
from async_dapo.rollout.actor import EngineSession

PROMPT = [1, 2, 3]


class ScriptTM:
    """Answers each request with the next scripted (finish, ids, logprobs, update): ``update`` True means an
    abort-mode update to the next version happened while the request ran (the session's counters move as
    EngineSession.update moves them). Records each request's input ids and max_new_tokens."""

    def __init__(self, session_ref, script):
        self.ref, self.script, self.requests = session_ref, list(script), []

    def generate_request(self, obj, request):
        finish, ids, logprobs, update = self.script.pop(0)
        self.requests.append((list(obj.input_ids), obj.sampling_params["max_new_tokens"]))
        s = self.ref[0]

        async def gen():
            if update:
                s.updates_started += 1
                s.version += 1
            meta = {"finish_reason": {"type": finish}, "output_token_logprobs": list(zip(logprobs, ids))}
            yield {"output_ids": list(ids), "meta_info": meta}

        return gen()

    def abort_request(self, rid="", abort_all=False):
        pass


def _session(script, *overrides, partial=True):
    sets = ["rollout.update_mode=abort", f"rollout.partial_rollout={str(partial).lower()}",
            "rollout.max_response_length=8", "rollout.max_abort_retries=2", *overrides]
    cfg = load_config(None, sets)
    ref = [None]
    s = EngineSession(cfg, 0, 0, None, [], ScriptTM(ref, script))
    ref[0] = s
    return s


def _run(s, n=None):
    params = {"max_new_tokens": s.cfg.rollout.max_response_length}
    return asyncio.run(s.sample_n(PROMPT, params, n) if n else s.sample_once(PROMPT, params))


def test_an_aborted_sample_continues_from_its_tokens_with_their_logprobs_and_versions():
    s = _session([("abort", [11, 12], [-0.1, -0.2], True), ("stop", [13], [-0.3], False)])
    out = _run(s)
    assert s.tm.requests == [(PROMPT, 8), (PROMPT + [11, 12], 6)]  # the budget less the kept tokens
    assert out["output_ids"] == [11, 12, 13]
    assert [lp for lp, *_ in out["meta_info"]["output_token_logprobs"]] == [-0.1, -0.2, -0.3]
    assert out["_versions"].tolist() == [0, 0, 1] and out["_start_version"] == 1
    assert (s.stats.continued_tokens, s.stats.aborted_tokens, s.stats.resampled) == (2, 0, 1)
    sample = s._sample(out, RewardResult(score=1.0, acc=True, pred="x"))
    assert sample.response_ids.tolist() == [11, 12, 13] and sample.versions.tolist() == [0, 0, 1]
    assert sample.logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3]) and sample.finish_reason == "stop"


def test_two_aborts_in_a_row_extend_one_prefix():
    s = _session([("abort", [11], [-0.1], True), ("abort", [12, 13], [-0.2, -0.3], True),
                  ("length", [14, 15, 16, 17, 18], [-0.4] * 5, False)], "replay.max_staleness=2")
    out = _run(s)
    assert [r[1] for r in s.tm.requests] == [8, 7, 5]
    assert s.tm.requests[2][0] == PROMPT + [11, 12, 13]
    assert out["output_ids"] == [11, 12, 13, 14, 15, 16, 17, 18]
    assert out["_versions"].tolist() == [0, 1, 1, 2, 2, 2, 2, 2]
    assert (s.stats.continued_tokens, s.stats.aborted_tokens) == (3, 0)


def test_without_partial_rollout_the_aborted_tokens_are_thrown_away():
    s = _session([("abort", [11, 12], [-0.1, -0.2], True), ("stop", [13], [-0.3], False)], partial=False)
    out = _run(s)
    assert s.tm.requests == [(PROMPT, 8), (PROMPT, 8)] and out["output_ids"] == [13] and "_versions" not in out
    assert (s.stats.continued_tokens, s.stats.aborted_tokens) == (0, 2)


def test_a_prefix_older_than_the_staleness_bound_is_dropped_and_counted():
    # η = 1: tokens of version 0 continued at version 2 would make the group stale at the queue
    s = _session([("abort", [11], [-0.1], True), ("abort", [12], [-0.2], True), ("stop", [13], [-0.3], False)],
                 "replay.max_staleness=1")
    out = _run(s)
    assert s.tm.requests[2] == (PROMPT, 8) and out["output_ids"] == [13]
    assert (s.stats.continued_tokens, s.stats.aborted_tokens) == (0, 2)


def test_a_prefix_at_the_budget_is_complete_without_a_request():
    s = _session([("abort", list(range(10, 18)), [-0.5] * 8, True)])
    out = _run(s)
    assert len(s.tm.requests) == 1 and out["output_ids"] == list(range(10, 18))
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["_versions"].tolist() == [0] * 8
    assert s.stats.continued_tokens == 8


def test_a_foreign_abort_keeps_the_prefix_and_wastes_only_its_own_tokens():
    s = _session([("abort", [11, 12], [-0.1, -0.2], True), ("abort", [99], [-0.9], False),
                  ("stop", [13], [-0.3], False)])
    out = _run(s)
    assert s.tm.requests[1][0] == s.tm.requests[2][0] == PROMPT + [11, 12]
    assert out["output_ids"] == [11, 12, 13] and (s.stats.continued_tokens, s.stats.aborted_tokens) == (2, 1)


def test_a_group_failed_by_the_engines_aborts_counts_its_prefix_as_aborted():
    from async_dapo.rollout.actor import GroupFailed

    s = _session([("abort", [11, 12], [-0.1, -0.2], True)] + [("abort", [99], [-0.9], False)] * 3)
    with pytest.raises(GroupFailed, match="aborted the request 3 times"):
        _run(s)
    assert (s.stats.continued_tokens, s.stats.aborted_tokens) == (0, 3 + 2)  # 3 foreign tokens, then the prefix


def test_in_a_group_only_the_aborted_samples_are_continued():
    # a batch of 2: the first finished before the update, the second was cut short by it
    s = _session([("stop", [21], [-0.1], False), ("abort", [31, 32], [-0.2, -0.3], True),
                  ("stop", [33], [-0.4], False)])
    real = s.tm.generate_request

    def batch_then_single(obj, request):
        if isinstance(obj.rid, list):  # one request, two completions: answer both from the script
            first, second = (real(type(obj)(input_ids=obj.input_ids[0], sampling_params=obj.sampling_params), None)
                             for _ in range(2))

            async def gen():
                yield [await first.__anext__(), await second.__anext__()]

            return gen()
        return real(obj, request)

    s.tm.generate_request = batch_then_single
    outs = _run(s, n=2)
    assert [o["output_ids"] for o in outs] == [[21], [31, 32, 33]]
    assert outs[1]["_versions"].tolist() == [0, 0, 1] and s.stats.continued_tokens == 2


def test_the_rule_keeps_partial_rollout_to_abort_mode():
    with pytest.raises(Exception, match="rollout.partial_rollout applies to rollout.update_mode abort only"):
        load_config(None, ["rollout.partial_rollout=true"])
    assert np.isfinite(load_config(None, ["rollout.partial_rollout=true", "rollout.update_mode=abort"])
                       .rollout.max_response_length)


def test_the_end_of_run_table_sums_the_tokens_never_trained_and_the_continued_ones(tmp_path):
    from async_dapo.orchestrator import Run

    run = Run(load_config("configs/tiny_cpu.yaml", [f"logging.run_dir={tmp_path}"]), None)
    assert run._waste_line() == ""  # no step logged
    run.last_metrics = {"rollout/wasted_tokens/filtered": 120.0, "rollout/wasted_tokens/stale": 30.0,
                        "rollout/wasted_tokens/abort": 7.0, "rollout/continued_tokens": 55.0, "train/version": 3.0}
    line = run._waste_line()
    assert "tokens not trained" in line and "157 (filtered 120, stale 30, abort 7)" in line
    assert line.endswith("continued after an abort: 55; continued on another engine: 0")
    run.last_metrics["rollout/carried_tokens"] = 40.0
    assert run._waste_line().endswith("continued on another engine: 40")
