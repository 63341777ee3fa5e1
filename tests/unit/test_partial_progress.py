"""Progress reports of the groups in flight (rollout.partial_every_s): what the rollout actor reads from its
engine's request records and reports; what the replay queue keeps, carries to the next admission of a prompt
whose engine left (once per leave, never trained twice) or counts as wasted; and how the engine that takes
the prompt continues each sample from the carried tokens. Stand-ins play the engine's tokenizer manager
(tests/integration runs the real one); the queue runs over real, signed zmq."""

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest

from async_dapo.config import load_config
from async_dapo.replay.partials import Claim, PartialStore
from async_dapo.replay.queue import ReplayQueue
from async_dapo.rollout.actor import EngineSession, GroupFailed, Prefix, _progress_of, _Slot
from async_dapo.stream.transport import GroupSender
from async_dapo.stream.wire import Group, Partial, Progress, Sample

PROMPT = [1, 2, 3]


def _progress(ids, versions, finish="", seconds=1.0):
    return Progress(np.asarray(ids, np.int32), np.asarray([-0.5] * len(ids), np.float32),
                    np.asarray(versions, np.int32), finish, seconds)


def _partial(group_id="0-4-0", epoch=0, index=4, engine_rank=0, samples=None, sent_at=1.0):
    samples = samples or (_progress([7, 8, 9], [0, 0, 1], "stop"), _progress([5, 6], [0, 1]))
    return Partial(group_id=group_id, prompt_index=index, epoch=epoch, engine_rank=engine_rank,
                   samples=tuple(samples), sent_at=sent_at)


# ------------------------------------------------------------------------------- the queue's store
def test_the_store_keeps_the_newest_report_of_an_outstanding_ticket_only():
    store, claim = PartialStore(carry=True), Claim("0-4-0", 0, 4, 0)
    assert store.report(_partial(sent_at=2.0), claim)
    assert not store.report(_partial(sent_at=1.0), claim)  # older than the one kept
    assert not store.report(_partial(), None)  # no such ticket (released, arrived, another run)
    assert not store.report(_partial(engine_rank=1), claim)  # another engine's report about this ticket
    assert not store.report(_partial(index=5), claim)
    assert store.latest["0-4-0"].sent_at == 2.0
    assert store.stats()["partials_received"] == 1 and store.stats()["partials_unexpected"] == 3
    assert store.stats()["partials_out_of_order"] == 1 and store.stats()["partials_held"] == 1


@pytest.mark.parametrize("reason, carried", [("actor_failed", True), ("scaled_down", True), ("expired", False),
                                             ("engine_error", False), ("score_error", False)])
def test_only_a_leave_carries_the_report_to_the_next_admission_once(reason, carried):
    store, claim = PartialStore(carry=True), Claim("0-4-0", 0, 4, 0)
    store.report(_partial(), claim)
    store.release(claim, reason)
    assert store.latest == {}
    got = store.take(0, 4)
    assert (got == _partial()) if carried else got is None
    assert store.take(0, 4) is None  # handed out once
    stats = store.stats()
    assert (stats["partials_carried"], stats["partials_handed_out"], stats["partial_tokens_handed_out"]) == (
        (1, 1, 5) if carried else (0, 0, 0))
    assert stats["wasted_tokens/engine_loss"] == stats["wasted_tokens/scale_down"] == 0


def test_with_carrying_off_a_leave_counts_the_reported_tokens_as_wasted_by_its_reason():
    store = PartialStore(carry=False)
    for gid, index, reason in (("0-4-0", 4, "actor_failed"), ("0-5-1", 5, "scaled_down")):
        claim = Claim(gid, 0, index, 0)
        store.report(_partial(group_id=gid, index=index), claim)
        store.release(claim, reason)
    assert store.take(0, 4) is None and store.take(0, 5) is None
    stats = store.stats()
    assert (stats["wasted_tokens/engine_loss"], stats["wasted_tokens/scale_down"]) == (5, 5)
    assert stats["partials_carried"] == 0


def test_a_report_ends_with_its_ticket():
    store, claim = PartialStore(carry=True), Claim("0-4-0", 0, 4, 0)
    store.report(_partial(), claim)
    store.end("0-4-0")  # its group arrived
    store.release(claim, "actor_failed")  # (a release after that finds nothing to carry)
    assert store.take(0, 4) is None and store.stats()["partials_held"] == 0


# ------------------------------------------------------------------------------- the queue service
def _cfg(*extra):
    return load_config(None, ["algorithm.train_batch_groups=2", "learner.mini_batch_groups=2",
                              "replay.max_staleness=1", "rollout.n=2", "replay.capacity_groups=8", *extra])


def _group(ticket, engine_rank):
    samples = tuple(Sample(response_ids=np.array([5, 6], np.int32), logprobs=np.array([-0.5, -0.1], np.float32),
                           versions=np.array([0, 0], np.int32), reward=r, score=r, acc=r > 0, truncated=False,
                           finish_reason="stop", gen_seconds=0.1) for r in (1.0, -1.0))
    return Group(group_id=ticket[0], prompt_index=ticket[2], epoch=ticket[1], engine_rank=engine_rank,
                 prompt_ids=np.array([1, 2, 3], np.int32), ground_truth="7", data_source="t", samples=samples,
                 created_at=1.0, admitted_version=0)


async def _until(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not await pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("carry", [True, False])
def test_a_leaving_engines_report_goes_with_its_prompt_to_the_next_engine_once(carry):
    """Engine 0 reports progress on its two prompts over the signed stream, then dies: its prompts go back to
    the cursor and engine 1's next admission gets them with the reports (carrying on), or the reported tokens
    are counted as lost to the engine's death (carrying off). Engine 0's late group for a released ticket is
    rejected; the prompt is trained once, by engine 1's group."""

    async def run():
        svc = ReplayQueue(_cfg(f"replay.carry_partials={str(carry).lower()}"))
        tx = GroupSender(await svc.address(), secret=await svc.producer_secret())
        try:
            first = await svc.admit(0, 2)
            assert [t[4] for t in first] == [None, None]  # nothing carried yet
            for t in first:
                tx.send(_partial(group_id=t[0], epoch=t[1], index=t[2]), timeout_ms=2000)
            await _until(lambda: _stat(svc, "partials_received", 2))
            assert await svc.release_engine(0, "actor_failed") == 2
            again = await svc.admit(1, 2)
            assert [(t[1], t[2]) for t in again] == [(t[1], t[2]) for t in first]  # re-issued first
            carried = [t[4] for t in again]
            if carry:
                assert carried == [_partial(group_id=t[0], epoch=t[1], index=t[2]) for t in first]
            else:
                assert carried == [None, None]
            tx.send(_group(first[0], 0), timeout_ms=2000)  # the dead engine's group, late: not trained
            for t in again:
                tx.send(_group(t, 1), timeout_ms=2000)
            await _until(lambda: _stat(svc, "received", 2))
            stats = await svc.stats()
            assert stats["rejected_unexpected"] == 1 and stats["abandoned/actor_failed"] == 2
            assert stats["partials_handed_out"] == (2 if carry else 0)
            assert stats["partial_tokens_handed_out"] == (10 if carry else 0)
            assert stats["wasted_tokens/engine_loss"] == (0 if carry else 10)
            assert stats["partials_held"] == stats["partials_waiting"] == 0
            batch = (await svc.get_batch(0, 1.0))["batch"]
            assert sorted(g.group_id for g in batch) == sorted(t[0] for t in again)
        finally:
            tx.close()
            await svc.close()

    asyncio.run(run())


async def _stat(svc, key, value):
    return (await svc.stats())[key] >= value


@pytest.mark.parametrize("carry", [True, False])
def test_a_checkpoint_keeps_the_work_not_trained_yet_and_a_resume_hands_it_out_once(tmp_path, carry):
    """At the checkpoint the queue holds one outstanding ticket's latest report (prompt a, engine 1, 3 tokens),
    one released prompt's carried report waiting for its next admission (c: engine 0 died, 5 tokens), one
    queued group (e) and a batch handed to the learner whose step did not finish (b, d; 4 tokens each group).
    Through the checkpoint's files, a new queue (the resumed run) hands each out once with the next admission
    of its prompt, the groups as reports whose samples have all finished; with carrying off the 3 + 3 x 4
    tokens are counted as lost to the restart (c's 5 were counted as lost to the death)."""
    from async_dapo.checkpoint.run_dir import read_replay_state, write_replay_state
    from async_dapo.replay.partials import finished_report

    async def run():
        cfg = _cfg(f"replay.carry_partials={str(carry).lower()}", "replay.max_staleness=2")
        svc = ReplayQueue(cfg)
        tx = GroupSender(await svc.address(), secret=await svc.producer_secret())
        try:
            a, b, c, d, e = await svc.admit(0, 5)
            for t in (a, c):
                tx.send(_partial(group_id=t[0], epoch=t[1], index=t[2]), timeout_ms=2000)
            for t in (b, d):
                tx.send(_group(t, 0), timeout_ms=2000)
            await _until(lambda: _stat(svc, "received", 2))
            batch = (await svc.get_batch(0, 5.0))["batch"]  # b and d: the learner's step will not finish
            tx.send(_group(e, 0), timeout_ms=2000)  # e's group arrives and waits for the next batch
            await _until(lambda: _stat(svc, "received", 3))
            await _until(lambda: _stat(svc, "partials_received", 2))
            await svc.release_engine(0, "actor_failed")  # a and c go back with their reports
            (a2,) = await svc.admit(1, 1)  # a again (re-issued first): its carried report is handed out
            tx.send(_partial(group_id=a2[0], epoch=a2[1], index=a2[2], engine_rank=1,
                             samples=(_progress([4], [0]), _progress([3, 2], [0, 0]))), timeout_ms=2000)
            await _until(lambda: _stat(svc, "partials_received", 3))
            state = await svc.state_dict(batch)
        finally:
            tx.close()
            await svc.close()
        write_replay_state(tmp_path, state)
        restored = read_replay_state(tmp_path, cfg.transport.max_message_bytes, 24)
        resumed = ReplayQueue(cfg)
        try:
            await resumed.load_state_dict(restored)
            tickets = await resumed.admit(0, 6)
            stats = await resumed.stats()
        finally:
            await resumed.close()
        return (a, b, c, d, e), tickets, stats

    (a, b, c, d, e), tickets, stats = asyncio.run(run())
    assert [(t[1], t[2]) for t in tickets[:5]] == sorted((t[1], t[2]) for t in (a, b, c, d, e))  # given back
    assert tickets[5][4] is None  # a fresh prompt carries nothing
    carried = {t[2]: t[4] for t in tickets[:5]}
    if carry:
        assert carried[a[2]].engine_rank == 1 and [p.response_ids.tolist() for p in carried[a[2]].samples] == [
            [4], [3, 2]]
        assert carried[c[2]] == _partial(group_id=c[0], epoch=c[1], index=c[2])
        for t in (b, d, e):
            assert carried[t[2]] == finished_report(_group(t, 0))
            assert [(p.finish_reason, p.response_ids.tolist(), p.versions.tolist()) for p in carried[t[2]].samples
                    ] == [("stop", [5, 6], [0, 0])] * 2
        assert (stats["partials_restored"], stats["partials_handed_out"], stats["partial_tokens_handed_out"]) == (
            5, 5, 3 + 5 + 3 * 4)
        assert stats["wasted_tokens/restart"] == 0
    else:
        assert set(carried.values()) == {None}
        assert (stats["partials_restored"], stats["wasted_tokens/restart"]) == (4, 3 + 3 * 4)


def test_a_checkpoint_keeps_at_most_its_limit_of_reports_queued_groups_first():
    store = PartialStore(carry=True)
    for n, sent_at in enumerate((1.0, 3.0, 2.0)):
        claim = Claim(f"0-{n}-{n}", 0, n, 0)
        store.report(_partial(group_id=claim.group_id, index=n, sent_at=sent_at), claim)
    queued = (_group(("0-9-9", 0, 9), 0),)
    assert [p.prompt_index for p in store.saved(queued, 10)] == [9, 1, 2, 0]  # the newest reports first
    assert [p.prompt_index for p in store.saved(queued, 2)] == [9, 1]


def test_a_checkpoints_reports_file_is_read_within_bounds_and_each_fault_is_named(tmp_path):
    import msgpack

    from async_dapo.checkpoint.run_dir import read_partials
    from async_dapo.stream.wire import encode_group, encode_partial

    path = tmp_path / "partials.bin"
    assert read_partials(path, 4096, 4) == []  # a checkpoint from before reports were kept
    good = encode_partial(_partial())
    path.write_bytes(msgpack.packb([good, good]))
    assert read_partials(path, 4096, 4) == [_partial(), _partial()]
    # the run's own bounds (3 x 128 reports of up to 64 MiB: a 24 GiB bound) read a small file as it is
    assert read_partials(path, 64 << 20, 3 * 128) == [_partial(), _partial()]
    cases = [([good, b"junk"], 4096, 4, "report 1: "),
             ([encode_group(_group(("0-1-0", 0, 1), 0))], 4096, 4, "report 0: a group, not a report"),
             ([good, good], 4096, 1, "not an array of at most 1 reports"),  # more reports than the limit
             ([good], 64, 40, "exceeds max_bin_len(64)"),  # one larger than transport.max_message_bytes
             ({"a": 1}, 4096, 4, "not an array")]
    for entries, max_bytes, limit, why in cases:
        path.write_bytes(msgpack.packb(entries))
        with pytest.raises(OSError) as err:
            read_partials(path, max_bytes, limit)
        assert str(err.value).startswith(f"{path}: ") and why in str(err.value), (why, str(err.value))


# ------------------------------------------------------------------------------- the rollout actor
class ScriptTM:
    """Answers each request with the next scripted (finish, ids, logprobs); records the input ids and
    max_new_tokens of each request."""

    def __init__(self, script):
        self.script, self.requests, self.rid_to_state = list(script), [], {}

    def generate_request(self, obj, request):
        finish, ids, logprobs = self.script.pop(0)
        self.requests.append((list(obj.input_ids), obj.sampling_params["max_new_tokens"]))

        async def gen():
            yield {"output_ids": list(ids), "meta_info": {"finish_reason": {"type": finish},
                                                          "output_token_logprobs": list(zip(logprobs, ids))}}

        return gen()

    def abort_request(self, rid="", abort_all=False):
        pass


def _session(script, *overrides, version=0):
    cfg = load_config(None, ["rollout.max_response_length=8", "replay.max_staleness=1",
                             "rollout.partial_every_s=0.05", *overrides])
    return EngineSession(cfg, 1, version, None, [], ScriptTM(script))


def test_a_carried_sample_is_continued_from_its_tokens_and_a_finished_one_taken_as_it_is():
    s = _session([("stop", [13, 14], [-0.3, -0.4])], version=1)
    params = {"max_new_tokens": 8}
    finished = s._carry_on(PROMPT, params, _progress([7, 8, 9], [0, 0, 1], "stop", 2.0), _Slot())
    running = s._carry_on(PROMPT, params, _progress([5, 6], [0, 1], "", 1.5), _Slot())
    done, cont = asyncio.run(_both(finished, running))
    assert done["output_ids"] == [7, 8, 9] and done["_versions"].tolist() == [0, 0, 1]
    assert done["meta_info"]["finish_reason"]["type"] == "stop"
    assert s.tm.requests == [(PROMPT + [5, 6], 6)]  # one request: the unfinished one, from its tokens
    assert cont["output_ids"] == [5, 6, 13, 14] and cont["_versions"].tolist() == [0, 1, 1, 1]
    assert [lp for lp, *_ in cont["meta_info"]["output_token_logprobs"]] == [-0.5, -0.5, -0.3, -0.4]
    assert cont["_seconds"] >= 1.5
    assert (s.stats.carried_tokens, s.stats.continued_tokens, s.stats.carried_stale_tokens) == (5, 0, 0)


async def _both(a, b):
    return await a, await b


@pytest.mark.parametrize("finish", ["", "stop"])
def test_carried_tokens_past_the_staleness_bound_are_dropped_and_counted(finish):
    """Unfinished or finished: a carried sample whose oldest token is more than η versions old would make its
    group stale at the queue, so it is drawn afresh."""
    s = _session([("stop", [13], [-0.3])], version=2)  # η = 1: a version-0 token continued at 2 is stale
    out = asyncio.run(s._carry_on(PROMPT, {"max_new_tokens": 8}, _progress([5, 6], [0, 1], finish), _Slot()))
    assert s.tm.requests == [(PROMPT, 8)] and out["output_ids"] == [13]
    assert (s.stats.carried_tokens, s.stats.carried_stale_tokens, s.stats.aborted_tokens) == (0, 2, 0)


@pytest.mark.parametrize("kept", [False, True])
def test_tokens_an_abort_throws_away_leave_the_reports_at_once(kept):
    """An aborted request's tokens that are not kept are counted as aborted; a report sent before the sample is
    drawn again (or, here, after the group failed) must not carry them to another engine too. Not kept: every
    token without rollout.partial_rollout. Kept (partial_rollout): an abort the engine made on its own keeps
    the prefix the request continued ([5, 6]) and only that: the request's own token (7) is aborted."""
    slot = _Slot()
    prefix = Prefix([5, 6], [-0.1, -0.2], np.array([0, 0], np.int32), 1.0) if kept else None

    class ReadMidway(ScriptTM):
        def generate_request(self, obj, request):
            outputs = super().generate_request(obj, request)

            async def gen():  # a report read the request's first token
                slot.known = ([5, 6, 7], [-0.1, -0.2, -0.3], np.zeros(3, np.int32), "", 0.0) if kept else \
                    ([5], [-0.1], np.zeros(1, np.int32), "", 0.0)
                async for out in outputs:
                    yield out

            return gen()

    s = _session([], "rollout.max_abort_retries=0", "rollout.update_mode=abort",
                 f"rollout.partial_rollout={str(kept).lower()}")
    s.tm = ReadMidway([("abort", [7], [-0.3])] if kept else [("abort", [5, 6], [-0.1, -0.2])])
    with pytest.raises(GroupFailed):
        asyncio.run(s.sample_once(PROMPT, {"max_new_tokens": 8}, prefix=prefix, slot=slot))
    assert s.stats.aborted_tokens == (1 + 2 if kept else 2)  # (kept: the prefix is lost with the failed group)
    assert _progress_of(slot, (0, 0))[0] == ([5, 6] if kept else [])


def test_a_carried_report_of_another_group_size_is_drawn_afresh_and_counted():
    class BatchTM(ScriptTM):  # a batch of n completions, not streamed, answered as one list
        def generate_request(self, obj, request):
            self.requests.append(len(obj.input_ids))

            async def gen():
                yield [{"output_ids": [13], "meta_info": {"finish_reason": {"type": "stop"},
                                                          "output_token_logprobs": [(-0.3, 13)]}}] * 3

            return gen()

    s = _session([], "rollout.n=3", "rollout.partial_every_s=0")
    s.tm = BatchTM([])
    s.rows = [SimpleNamespace(prompt=None, data_source="t", ground_truth="7", extra_info={})]
    s._prompt_ids[0] = PROMPT

    async def no_scores(row, texts):
        return [SimpleNamespace(score=1.0, acc=True)] * len(texts)

    s._score_texts, s.tokenizer = no_scores, SimpleNamespace(decode=lambda ids, **kw: "x")
    group = asyncio.run(s.sample_group("0-0-1", 0, 0, 0, _partial()))  # 2 samples, 3 + 2 tokens
    assert [g.response_ids.tolist() for g in group.samples] == [[13]] * 3 and s.tm.requests == [3]
    assert (s.stats.carried_stale_tokens, s.stats.carried_tokens) == (5, 0)


def _chunk(ids, logprobs, finish=None, spans=None):
    """A streamed output as the engine's tokenizer manager yields it (unfinished: the ids are its own list)."""
    meta = {"finish_reason": {"type": finish} if finish else None,
            "output_token_logprobs": [(lp, i, None) for lp, i in zip(logprobs, ids)]}
    if spans is not None:
        meta["weight_versions"] = spans
    return {"output_ids": list(ids), "meta_info": meta}


def test_a_report_reads_each_sample_from_its_latest_streamed_output():
    prefix = Prefix([5, 6], [-0.1, -0.2], np.array([0, 0], np.int32), 1.0)
    running, carried_on, finished, fresh = _Slot(), _Slot(), _Slot(), _Slot()
    running.begin("a", (0, 2), None)
    carried_on.begin("b", (0, 1), prefix)
    finished.done = {"output_ids": [9], "meta_info": {"finish_reason": {"type": "length"},
                                                      "output_token_logprobs": [(-0.9, 9, None)]},
                     "_start_version": 3, "_seconds": 0.5}
    fresh.begin("c", (0, 2), None)  # nothing streamed yet: nothing to report
    # "a": the engine's list already holds a third token this chunk's log-probs do not cover yet
    running.latest = _chunk([1, 2], [-1.0, -2.0])
    running.latest["output_ids"].append(3)
    carried_on.latest = _chunk([7, 8], [-0.7, -0.8])
    ids, lps, versions, finish, _ = _progress_of(running, (0, 2))
    assert (ids, lps, versions.tolist(), finish) == ([1, 2], [-1.0, -2.0], [2, 2], "")
    ids, lps, versions, finish, seconds = _progress_of(carried_on, (0, 1))
    assert (ids, lps, versions.tolist(), finish, seconds) == ([5, 6, 7, 8], [-0.1, -0.2, -0.7, -0.8], [0, 0, 1, 1],
                                                             "", 1.0)
    ids, lps, versions, finish, seconds = _progress_of(finished, (0, 3))
    assert (ids, lps, versions.tolist(), finish, seconds) == ([9], [-0.9], [3], "length", 0.5)
    assert _progress_of(fresh, (0, 2))[0] == []
    # an update started since "b" began (or is running): where its weights changed is unknown until it
    # finishes, so the report holds what was known exactly before, however far the engine got since
    carried_on.latest = _chunk([7, 8, 9, 10], [-0.7, -0.8, -0.9, -1.0])
    for now in ((1, 1), (1, 2), None):
        ids, lps, versions, finish, _ = _progress_of(carried_on, now)
        assert (ids, lps, versions.tolist(), finish) == ([5, 6, 7, 8], [-0.1, -0.2, -0.7, -0.8], [0, 0, 1, 1], "")
    # finished, it carries its versions: all of it is reported, exactly
    carried_on.latest = _chunk([7, 8, 9, 10], [-0.7, -0.8, -0.9, -1.0], finish="stop",
                               spans=[{"version": "1", "start": 0, "end": 3}, {"version": "2", "start": 3, "end": 4}])
    assert _progress_of(carried_on, (1, 2))[0] == [5, 6, 7, 8, 9, 10]
    assert _progress_of(carried_on, (1, 2))[2].tolist() == [0, 0, 1, 1, 1, 2]
    # a sample that finished inside a batch still waiting for its others is reported whole, as finished
    running.latest = _chunk([1, 2, 3], [-1.0, -2.0, -3.0], finish="stop")
    assert _progress_of(running, (0, 2))[:2] == ([1, 2, 3], [-1.0, -2.0, -3.0])
    assert _progress_of(running, (0, 2))[3] == "stop"
    # an aborted request's tokens are not reported: abort has its own rules (rollout.partial_rollout)
    fresh.latest = _chunk([7, 8], [-0.7, -0.8], finish="abort")
    assert _progress_of(fresh, (0, 2))[0] == []


class StreamTM(ScriptTM):
    """A streamed batch request: yields each scripted chunk (index, ids, logprobs, finish) in turn, waiting
    for the test's go between them; records whether the request asked to be streamed, and how often."""

    def __init__(self, chunks):
        super().__init__([])
        self.chunks, self.asked, self.go = list(chunks), [], asyncio.Event()

    def generate_request(self, obj, request):
        self.asked.append((obj.stream, obj.sampling_params.get("stream_interval")))

        async def gen():
            for i, ids, logprobs, finish in self.chunks:
                await asyncio.wait_for(self.go.wait(), 10)  # a test that never says go fails, not hangs
                self.go.clear()
                yield {**_chunk(ids, logprobs, finish), "index": i}

        return gen()


def test_a_tracked_request_is_streamed_and_reported_only_when_its_tokens_moved():
    chunks = [(0, [1, 2], [-1.0, -2.0], None), (1, [4], [-4.0], None),
              (0, [1, 2, 3], [-1.0, -2.0, -3.0], "stop"), (1, [4, 5], [-4.0, -5.0], "length")]
    s = _session([], "rollout.partial_every_tokens=4")
    s.tm = StreamTM(chunks)
    sent = []
    s.sender = SimpleNamespace(send=lambda partial, timeout_ms: sent.append((partial, timeout_ms)))
    from async_dapo.rollout.actor import _Track

    track = s.tracks["0-4-0"] = _Track(0, 4, [_Slot(), _Slot()])

    async def run():
        reporter = asyncio.ensure_future(s._report_progress())
        group = asyncio.ensure_future(s.sample_n(PROMPT, {"max_new_tokens": 8}, 2, track.slots))
        for _ in chunks:  # one chunk per cadence and a quiet cadence after each: the quiet one reports nothing
            s.tm.go.set()
            await asyncio.sleep(0.12)
        outs = await group
        reporter.cancel()
        return outs

    outs = asyncio.run(run())
    s._send_pool.shutdown(wait=True)
    assert s.tm.asked == [(True, 4)]  # streamed, every 4 tokens
    assert [o["output_ids"] for o in outs] == [[1, 2, 3], [4, 5]]
    assert [p.num_tokens for p, _ in sent] == [2, 3, 4, 5] and {ms for _, ms in sent} == {50}
    first, last = sent[0][0], sent[-1][0]
    assert (first.group_id, first.epoch, first.prompt_index, first.engine_rank) == ("0-4-0", 0, 4, 1)
    assert first.samples[0].response_ids.tolist() == [1, 2] and first.samples[1].num_tokens == 0
    assert [p.finish_reason for p in last.samples] == ["stop", "length"]
    assert s.stats.partials_sent == 4 and s.stats.partials_unsent == 0


def test_without_progress_reports_requests_are_not_streamed():
    s = _session([], "rollout.partial_every_s=0")
    s.tm = StreamTM([(0, [13], [-0.3], "stop")])
    s.tm.go.set()
    out = asyncio.run(s.sample_once(PROMPT, {"max_new_tokens": 8}, slot=_Slot()))
    assert out["output_ids"] == [13] and s.tm.asked == [(False, None)]


class UpdatingTM(ScriptTM):
    """Records what an update does to the engine: aborts, pauses, continues (loads are stubbed)."""

    def __init__(self):
        super().__init__([])
        self.calls = []

    def abort_request(self, rid="", abort_all=False):
        self.calls.append("abort_all" if abort_all else f"abort {rid}")

    async def pause_generation(self, obj):
        self.calls.append(f"pause {obj.mode}")

    async def continue_generation(self, obj):
        self.calls.append("continue")


@pytest.mark.parametrize("every, calls, keep", [(0.0, ["pause retract", "continue"], False),
                                                (0.5, ["abort_all", "pause retract", "continue"], True)])
def test_with_reports_an_inflight_update_aborts_running_requests_and_keeps_their_tokens(monkeypatch, every, calls,
                                                                                       keep):
    """SGLang tells an unfinished request's versions only when it finishes, so with progress reports no
    request may run across a load: an in-flight update aborts them (keeping their tokens, continued after the
    load as with partial_rollout) where it would retract them otherwise."""
    from async_dapo.weights import sync as weight_sync

    async def load(tm, buckets, group_name, version):
        tm.calls.append(f"load {version}")

    monkeypatch.setattr(weight_sync, "load", load)
    s = _session([], f"rollout.partial_every_s={every}")
    s.tm = UpdatingTM()
    asyncio.run(s.update([], "g", 1, "inflight"))
    assert s.tm.calls == calls[:-1] + ["load 1", "continue"] and s.version == 1
    assert s.keep_aborted is keep
