"""The replay queue service around the policy: admission waits on a condition and wakes on a version
advance; groups arrive over real (HMAC-signed) zmq; batches come out B at a time; every admitted prompt is
accounted for (arrived, abandoned by its producer, expired, released with its actor); checkpoint state gives
untrained prompts back. Runs in-process on one asyncio loop (the Ray actor is this class behind ray.remote)."""

import asyncio

import numpy as np
import pytest

from async_dapo.config import load_config
from async_dapo.replay.queue import ReplayQueue
from async_dapo.stream.transport import GroupSender
from async_dapo.stream.wire import Group, Sample


def _group(ticket, accs, version=0):
    group_id, epoch, index = ticket[0], ticket[1], ticket[2]
    samples = tuple(
        Sample(response_ids=np.array([5, 6], np.int32), logprobs=np.array([-0.5, -0.1], np.float32),
               versions=np.array([version, version], np.int32), reward=1.0 if a else -1.0,
               score=1.0 if a else -1.0, acc=a, truncated=False, finish_reason="stop", gen_seconds=0.1)
        for a in accs
    )
    return Group(group_id=group_id, prompt_index=index, epoch=epoch, engine_rank=0,
                 prompt_ids=np.array([1, 2, 3], np.int32), ground_truth="7", data_source="t",
                 samples=samples, created_at=1.0, admitted_version=version)


def _cfg(*extra):
    return load_config(None, ["algorithm.train_batch_groups=2", "learner.mini_batch_groups=2",
                              "replay.max_staleness=0", "rollout.n=2", "replay.capacity_groups=8", *extra])


@pytest.fixture
def cfg():
    return _cfg()


async def _connected(svc):
    return GroupSender(await svc.address(), secret=await svc.producer_secret())


class _ObservedCondition(asyncio.Condition):
    """The service's condition plus a signal for tests: ``parked`` is set whenever a caller begins to wait
    on it. A test that needs "this admit call is now blocked on the condition" waits for that signal (with a
    deadline) instead of sleeping and hoping the call got there in time."""

    def __init__(self) -> None:
        super().__init__()
        self.parked = asyncio.Event()

    async def wait(self):
        self.parked.set()
        return await super().wait()


async def _observed(svc) -> _ObservedCondition:
    await svc.address()  # creates the service's condition (and starts its receiver) on this loop
    # The one private hook: the service offers no public "someone is waiting" signal. Were the attribute
    # renamed, nothing would ever park here and _start_parked fails loudly.
    svc._changed = cond = _ObservedCondition()
    return cond


async def _start_parked(cond: _ObservedCondition, coro, timeout=5.0) -> asyncio.Future:
    """Start ``coro`` and return once it waits on the service's condition (it must still be pending)."""
    cond.parked.clear()
    task = asyncio.ensure_future(coro)
    try:
        await asyncio.wait_for(cond.parked.wait(), timeout)
    except asyncio.TimeoutError:
        task.cancel()
        raise AssertionError(f"the call never waited on the service's condition in {timeout} s "
                             f"(done: {task.done()})") from None
    assert not task.done()
    return task


async def _until(pred, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not await pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def test_admission_blocks_until_version_advances_and_batches_flow(cfg):
    async def scenario():
        svc = ReplayQueue(cfg)
        sender = await _connected(svc)
        cond = await _observed(svc)
        try:
            tickets = await svc.admit(0, 10)
            assert len(tickets) == 2  # eta=0, v=0, B=2: (0 + 0 + 1) * 2 prompts
            assert await svc.admit(0, 10, wait_s=0.2) == []  # bounded wait, nothing admitted
            assert (await svc.stats())["capacity_to_admit"] == 0
            blocked = await _start_parked(cond, svc.admit(0, 10))  # waits on the condition
            sender.send(_group(tickets[0], [True, True]))  # all correct: dropped, frees a slot
            third = await asyncio.wait_for(blocked, 5)
            assert len(third) == 1
            sender.send(_group(tickets[1], [True, False]))
            sender.send(_group(third[0], [False, True]))
            got = await asyncio.wait_for(svc.get_batch(wait_s=5), 6)
            assert [g.prompt_index for g in got["batch"]] == [tickets[1][2], third[0][2]]
            assert (await svc.stats())["capacity_to_admit"] == 0  # 2 running + 0 queued = (0 + 0 + 1) * 2
            again = await _start_parked(cond, svc.admit(0, 10))
            await svc.set_version(1)  # the learner pushed version 1: admission widens by B
            assert len(await asyncio.wait_for(again, 5)) == 2
            stats = await svc.stats()
            assert stats["dropped_all_correct"] == 1 and stats["accepted"] == 2
            assert stats["handed_out"] == 2 and stats["running"] == 2
            # Foreign garbage on the socket is counted, never fatal.
            sender.send_bytes(b"\x00not msgpack")
            await _until(lambda: _stat(svc, "rejected_malformed", 1))
        finally:
            sender.close()
            await svc.close()

    asyncio.run(scenario())


async def _stat(svc, key, value):
    return (await svc.stats()).get(key) == value


def test_all_correct_group_retires_its_prompt_and_a_fully_retired_cursor_stops_the_run():
    async def scenario():
        svc = ReplayQueue(_cfg("algorithm.dynamic_sampling.retire_solved_after=1", "data.synthetic.levels=[1]"))
        sender = await _connected(svc)
        try:
            solved, mixed = await svc.admit(0, 10)
            sender.send(_group(solved, [True, True]))
            sender.send(_group(mixed, [True, False]))
            await _until(lambda: _stat(svc, "retired_prompts", 1))
            stats = await svc.stats()
            assert (stats["dropped_all_correct"], stats["accepted"]) == (1, 1)
            key = svc.cursor.keys[solved[2]]
            same = [i for i, k in enumerate(svc.cursor.keys) if k == key]
            assert svc.cursor.keys[mixed[2]] != key and len(same) > 1  # the synthetic task repeats problems
            cur = svc.cursor
            rows = [i for _, i in cur.take(len(cur.keys))]  # more than the rest of the epoch
            assert not set(rows) & set(same)  # no row of the solved prompt comes out again
            skipped = (await svc.stats())["skipped_retired"]
            assert skipped >= len(same) - 1  # the rest of epoch 0's rows of it, at least
            assert skipped == cur.epoch * len(cur.keys) + cur.position - 2 - len(rows)  # each row passed: counted
            cur.retired = set(cur.keys)  # every prompt solved (the unit's way to get there)
            assert await svc.admit(0, 10, wait_s=0.1) == []  # a slot is free, but no prompt is left
            got = await svc.get_batch(wait_s=0.2)
            assert got["batch"] is None and got["problem"].startswith("every training prompt is retired")
            assert "retire_solved_after = 1" in got["problem"]
        finally:
            sender.close()
            await svc.close()

    asyncio.run(scenario())


def test_unsigned_group_is_rejected_and_not_counted_as_arrival(cfg):
    async def scenario():
        svc = ReplayQueue(cfg)
        foreign = GroupSender(await svc.address())  # no secret: a well-formed group from outside the run
        try:
            tickets = await svc.admit(0, 10)
            foreign.send(_group(tickets[0], [True, False]))
            async def refused():  # at the CURVE handshake: it never holds a slot (a NULL sender retries: >=)
                return (await svc.stats())["rejected_handshake"] >= 1

            await _until(refused)
            stats = await svc.stats()
            assert stats["received"] == 0 and stats["running"] == 2 and stats["rejected_auth"] == 0
        finally:
            foreign.close()
            await svc.close()

    asyncio.run(scenario())


def test_abandoned_group_frees_its_slot_and_returns_its_prompt_at_eta_0(cfg):
    async def scenario():
        svc = ReplayQueue(cfg)
        sender = await _connected(svc)
        try:
            a, b = await svc.admit(0, 10)
            assert await svc.abandon(a[0], "score_error") is True
            assert await svc.abandon(a[0], "score_error") is False  # once only
            (c,) = await asyncio.wait_for(svc.admit(0, 10), 5)  # the slot came back ...
            assert (c[1], c[2]) == (a[1], a[2]) and c[0] != a[0]  # ... with the same prompt, a new ticket
            sender.send(_group(b, [True, False]))
            sender.send(_group(c, [False, True]))
            got = await svc.get_batch(wait_s=5)
            assert sorted(g.prompt_index for g in got["batch"]) == sorted([a[2], b[2]])
            stats = await svc.stats()
            assert stats["abandoned/score_error"] == 1 and stats["abandoned"] == 1 and stats["running"] == 0
            # A late group for the abandoned ticket is dropped and counted: never trained twice.
            sender.send(_group(a, [True, False]))
            await _until(lambda: _stat(svc, "rejected_unexpected", 1))
            assert (await svc.stats())["received"] == 2
        finally:
            sender.close()
            await svc.close()

    asyncio.run(scenario())


def test_tickets_expire_after_their_ttl(cfg):
    async def scenario():
        svc = ReplayQueue(_cfg("replay.ticket_ttl_s=1.5", "rollout.request_timeout_s=1"))
        try:
            first = await svc.admit(0, 10)
            assert len(first) == 2 and await svc.admit(0, 10, wait_s=0.1) == []
            again = await asyncio.wait_for(svc.admit(0, 10, wait_s=10), 11)  # the receive loop expires them
            assert sorted((t[1], t[2]) for t in again) == sorted((t[1], t[2]) for t in first)
            assert (await svc.stats())["abandoned/expired"] == 2
        finally:
            await svc.close()

    asyncio.run(scenario())


def test_producers_parked_together_split_the_room_a_version_opens(cfg):
    async def scenario():
        svc = ReplayQueue(_cfg("algorithm.train_batch_groups=4", "learner.mini_batch_groups=4"))
        cond = await _observed(svc)
        try:
            assert len(await svc.admit(0, 10)) == 4  # η 0, B 4: the window is full
            first = await _start_parked(cond, svc.admit(0, 10))
            second = await _start_parked(cond, svc.admit(1, 10))
            await svc.set_version(1)  # four more slots: two each, not four to the first to have parked
            got = await asyncio.wait_for(asyncio.gather(first, second), 5)
            assert [len(t) for t in got] == [2, 2]
            lone = await _start_parked(cond, svc.admit(1, 10))
            await svc.set_version(2)  # a producer that waits alone takes all it asks for
            assert len(await asyncio.wait_for(lone, 5)) == 4
            assert (await svc.stats())["running"] == 12
        finally:
            await svc.close()

    asyncio.run(scenario())


def test_release_engine_returns_only_that_engines_prompts(cfg):
    async def scenario():
        svc = ReplayQueue(_cfg("algorithm.train_batch_groups=4", "learner.mini_batch_groups=4",
                                 "replay.capacity_groups=8"))
        try:
            mine = await svc.admit(1, 3)
            other = await svc.admit(0, 10)
            assert len(mine) == 3 and len(other) == 1
            assert await svc.release_engine(1, "actor_failed") == 3
            stats = await svc.stats()
            assert stats["abandoned/actor_failed"] == 3 and stats["running"] == 1
            state = await svc.state_dict()  # a checkpoint now gives back the survivor's prompt too
            assert sorted(tuple(t) for t in state["cursor"]["pending"]) == sorted((t[1], t[2]) for t in mine + other)
        finally:
            await svc.close()

    asyncio.run(scenario())


def test_get_batch_reports_when_dynamic_sampling_cannot_fill_a_batch():
    async def scenario():
        svc = ReplayQueue(_cfg("replay.capacity_groups=8", "algorithm.dynamic_sampling.max_gen_rounds=2"))
        sender = await _connected(svc)
        try:
            empty = await svc.get_batch(wait_s=0.1)
            assert empty["batch"] is None and empty["problem"] is None
            for accs in ([True, True], [True, True], [True, True], [False, False]):  # 2 rounds of B = 2
                (t,) = await svc.admit(0, 1)
                sender.send(_group(t, accs))
            await _until(lambda: _stat(svc, "received", 4))
            got = await svc.get_batch(wait_s=0.1)
            assert got["batch"] is None
            assert got["problem"] == ("2 groups needed, 0 mixed in 2 rounds (4 groups): 75% all-correct, "
                                      "25% all-wrong, 0% stale (algorithm.dynamic_sampling.max_gen_rounds = 2)")
        finally:
            sender.close()
            await svc.close()

    asyncio.run(scenario())


def test_checkpoint_gives_untrained_prompts_back(cfg):
    async def scenario():
        svc = ReplayQueue(cfg)
        try:
            tickets = await svc.admit(0, 10)
            state = await svc.state_dict()
            expected = sorted((t[1], t[2]) for t in tickets)
            assert sorted(tuple(t) for t in state["cursor"]["pending"]) == expected
            fresh = ReplayQueue(cfg)
            await fresh.load_state_dict(state)
            assert [(t[1], t[2]) for t in await fresh.admit(0, 2)] == expected
            await fresh.close()
        finally:
            await svc.close()

    asyncio.run(scenario())


def test_resume_restores_the_uninterrupted_admission_window_without_a_burst():
    """AReaL #1345: a resumed queue must not admit more than the uninterrupted run could at that version.
    Uninterrupted at version v: limit (eta + v + 1) * B with v * B handed out; resumed at v: limit
    (eta + 1) * B with none handed out — the same window, (eta + 1) * B = 4 prompts, counted from the
    batches trained so far, and the prompts that were queued or running come back through the cursor."""
    async def scenario():
        cfg = _cfg("replay.max_staleness=1", "replay.capacity_groups=8")
        run = ReplayQueue(cfg)
        sender = await _connected(run)
        try:
            for version in (1, 2, 3):  # three steps: fill, train one batch, push the next version
                for t in await run.admit(0, 2):
                    sender.send(_group(t, [True, False], version - 1))
                await _until(lambda: _stat(run, "running", 0))
                assert (await run.get_batch(wait_s=5))["batch"] is not None
                await run.set_version(version)
            running = await run.admit(0, 3)  # some prompts in flight at the checkpoint
            before = await run.stats()
            state = await run.state_dict()
            resumed = ReplayQueue(cfg, initial_version=3)
            await resumed.load_state_dict(state)
            after = await resumed.stats()
            assert before["admission_limit"] - before["handed_out"] == after["admission_limit"] == 4
            assert after["capacity_to_admit"] == 4 and before["running"] + before["depth"] + before[
                "capacity_to_admit"] == 4
            again = await resumed.admit(0, 10)
            assert len(again) == 4 and await resumed.admit(0, 10, wait_s=0.1) == []  # no burst
            assert sorted((t[1], t[2]) for t in again[:3]) == sorted((t[1], t[2]) for t in running)
            await resumed.close()
        finally:
            sender.close()
            await run.close()

    asyncio.run(scenario())


def test_a_released_producer_cannot_admit_again(cfg):
    """A dead rollout actor's admit call may still be waiting in the queue when the supervisor releases
    its prompts; when it wakes it must not take tickets that nobody will ever produce."""
    async def scenario():
        svc = ReplayQueue(cfg)
        cond = await _observed(svc)
        try:
            await svc.register_producer(0, "old")
            first = await svc.admit(0, 10, 5.0, "old")
            assert len(first) == 2 and (await svc.stats())["capacity_to_admit"] == 0
            # Parked before the release: the path under test is a waiter woken by it, not a late call.
            waiting = await _start_parked(cond, svc.admit(0, 10, 5.0, "old"))  # blocked: window full
            assert await svc.release_engine(0, "actor_failed") == 2  # frees the window, wakes the waiter
            assert await asyncio.wait_for(waiting, 5) == []
            await svc.register_producer(0, "new")
            again = await svc.admit(0, 10, 5.0, "new")
            assert sorted((t[1], t[2]) for t in again) == sorted((t[1], t[2]) for t in first)
            assert (await svc.stats())["running"] == 2
        finally:
            await svc.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("order", ["replay.batch_order=admission", "rollout.update_mode=abort"])  # auto: abort
def test_admission_order_waits_for_the_earliest_admitted_group_then_forces_after_order_wait_s(order):
    async def scenario():
        svc = ReplayQueue(_cfg("replay.max_staleness=2", order, "replay.order_wait_s=1.5"))
        sender = await _connected(svc)
        try:
            tickets = await svc.admit(0, 3)  # admitted in this order
            assert len(tickets) == 3
            sender.send(_group(tickets[1], [True, False]))
            sender.send(_group(tickets[2], [False, True]))
            await _until(lambda: _stat(svc, "accepted", 2))
            # B = 2 groups are queued but ticket 0, admitted before both, is still generating: no batch
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            assert (await svc.get_batch(wait_s=0.5))["batch"] is None
            sender.send(_group(tickets[0], [True, False]))
            got = await asyncio.wait_for(svc.get_batch(wait_s=5), 6)
            assert [g.group_id for g in got["batch"]] == [tickets[0][0], tickets[1][0]]  # admission order
            assert loop.time() - t0 < 1.5 and (await svc.stats())["forced_batches"] == 0
            # now ticket 3 runs long: ticket 2 and the later ticket 4 are queued; the batch waits order_wait_s
            later = await svc.admit(0, 2)
            sender.send(_group(later[1], [True, False]))
            await _until(lambda: _stat(svc, "accepted", 4))
            t0 = loop.time()
            got = await asyncio.wait_for(svc.get_batch(wait_s=5), 6)
            waited = loop.time() - t0
            assert [g.group_id for g in got["batch"]] == [tickets[2][0], later[1][0]]
            assert 1.0 <= waited < 4.0, waited  # order_wait_s = 1.5 (the receive loop wakes every second)
            stats = await svc.stats()
            assert stats["forced_batches"] == 1 and stats["open_tickets"] == 1  # later[0] still running
        finally:
            sender.close()
            await svc.close()

    asyncio.run(scenario())
