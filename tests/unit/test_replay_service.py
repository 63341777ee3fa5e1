"""The replay queue service around the policy: admission waits on a condition and wakes on a version
advance; groups arrive over real zmq; batches come out B at a time; checkpoint state gives untrained
prompts back. Runs in-process on one asyncio loop (the Ray actor is this class behind ray.remote)."""

import asyncio

import numpy as np
import pytest

from async_dapo.config import load_config
from async_dapo.replay_service import ReplayService
from async_dapo.transport import GroupSender
from async_dapo.wire import Group, Sample


def _group(epoch, index, accs, version=0):
    samples = tuple(
        Sample(response_ids=np.array([5, 6], np.int32), logprobs=np.array([-0.5, -0.1], np.float32),
               versions=np.array([version, version], np.int32), reward=1.0 if a else -1.0,
               score=1.0 if a else -1.0, acc=a, truncated=False, finish_reason="stop", gen_seconds=0.1)
        for a in accs
    )
    return Group(group_id=f"{epoch}-{index}", prompt_index=index, epoch=epoch, engine_rank=0,
                 prompt_ids=np.array([1, 2, 3], np.int32), ground_truth="7", data_source="t",
                 samples=samples, created_at=1.0, admitted_version=version)


@pytest.fixture
def cfg():
    return load_config(None, ["algorithm.train_batch_groups=2", "learner.mini_batch_groups=2",
                              "replay.max_staleness=0", "rollout.n=2", "replay.capacity_groups=8"])


def test_admission_blocks_until_version_advances_and_batches_flow(cfg):
    async def scenario():
        svc = ReplayService(cfg)
        sender = GroupSender(await svc.address())
        try:
            tickets = await svc.admit(0, 10)
            assert len(tickets) == 2  # eta=0, v=0, B=2: (0 + 0 + 1) * 2 prompts
            blocked = asyncio.ensure_future(svc.admit(0, 10))
            await asyncio.sleep(0.2)
            assert not blocked.done()  # waits on the condition, nothing admitted
            (e0, i0, _), (e1, i1, _) = tickets
            sender.send(_group(e0, i0, [True, True]))  # all correct: dropped, frees a slot
            third = await asyncio.wait_for(blocked, 5)
            assert len(third) == 1
            sender.send(_group(e1, i1, [True, False]))
            sender.send(_group(third[0][0], third[0][1], [False, True]))
            batch = await asyncio.wait_for(svc.get_batch(), 5)
            assert [g.prompt_index for g in batch] == [i1, third[0][1]]
            again = asyncio.ensure_future(svc.admit(0, 10))
            await asyncio.sleep(0.2)
            assert not again.done()
            await svc.set_version(1)  # the learner pushed version 1: admission widens by B
            assert len(await asyncio.wait_for(again, 5)) == 2
            stats = await svc.stats()
            assert stats["dropped_all_correct"] == 1 and stats["accepted"] == 2
            assert stats["handed_out"] == 2 and stats["running"] == 2
            # Foreign garbage on the socket is counted, never fatal.
            sender.send_bytes(b"\x00not msgpack")
            await asyncio.sleep(0.3)
            assert (await svc.stats())["rejected_malformed"] == 1
        finally:
            sender.close()
            await svc.close()

    asyncio.run(scenario())


def test_checkpoint_gives_untrained_prompts_back(cfg):
    async def scenario():
        svc = ReplayService(cfg)
        try:
            tickets = await svc.admit(0, 10)
            state = await svc.state_dict()
            assert sorted(tuple(t) for t in state["cursor"]["pending"]) == sorted((e, i) for e, i, _ in tickets)
            fresh = ReplayService(cfg)
            await fresh.load_state_dict(state)
            assert [(e, i) for e, i, _ in await fresh.admit(0, 2)] == sorted((e, i) for e, i, _ in tickets)
            await fresh.close()
        finally:
            await svc.close()

    asyncio.run(scenario())
