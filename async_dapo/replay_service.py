"""The replay queue as its own process: an asyncio Ray actor around :class:`~async_dapo.replay.ReplayPolicy`.

It owns three things and keeps them apart: the zmq receiver (transport), the policy (admission, staleness,
dynamic sampling), and the prompt cursor (which prompt comes next). Producers call ``admit`` over Ray and
wait on a condition — no busy loop — until the staleness bound lets them start more prompts; the learner
calls ``get_batch`` and waits the same way; ``set_version`` wakes both.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from async_dapo.config import Config
from async_dapo.data import PromptCursor, train_rows
from async_dapo.replay import ReplayPolicy
from async_dapo.transport import GroupReceiver
from async_dapo.wire import Group

log = logging.getLogger(__name__)


class _Version:
    """The queue's view of the learner version (the policy reads it through ``current``)."""

    def __init__(self, version: int) -> None:
        self.value = version

    def current(self) -> int:
        return self.value


class ReplayService:
    """Async actor body: ``admit`` / group arrival / ``get_batch`` / ``set_version``."""

    def __init__(self, cfg: Config, initial_version: int = 0) -> None:
        self.cfg = cfg
        self.version = _Version(initial_version)
        self.policy: ReplayPolicy[Group] = ReplayPolicy(
            batch_groups=cfg.algorithm.train_batch_groups, max_staleness=cfg.replay.max_staleness,
            capacity=cfg.replay.capacity_groups, dynamic_sampling=cfg.algorithm.dynamic_sampling.enable,
            versions=self.version,
        )
        self.cursor = PromptCursor(len(train_rows(cfg)), seed=cfg.data.shuffle_seed)
        t = cfg.transport
        self.receiver = GroupReceiver(t.bind_host, t.port, max_message_bytes=t.max_message_bytes)
        self._changed: asyncio.Condition | None = None
        self._receiving: asyncio.Task | None = None
        self.outstanding: dict[tuple[int, int], int] = {}  # ticket -> admitted version, until it arrives
        self.wait_seconds = {"admit": 0.0, "batch": 0.0}
        self.unexpected = 0  # valid groups for prompts this queue never admitted

    def _cond(self) -> asyncio.Condition:
        # Created lazily inside the actor's running event loop.
        if self._changed is None:
            self._changed = asyncio.Condition()
            self._receiving = asyncio.ensure_future(self._receive_forever())
        return self._changed

    async def _notify(self) -> None:
        async with self._cond():
            self._cond().notify_all()

    async def _receive_forever(self) -> None:
        while True:
            group = await self.receiver.arecv(timeout_ms=1000)
            if group is None:
                continue
            if self.outstanding.pop((group.epoch, group.prompt_index), None) is None:
                # Not a prompt this queue admitted (e.g. sent by a producer of a previous run):
                # counting it would break the admission arithmetic, so it is dropped and counted.
                self.unexpected += 1
                continue
            outcome = self.policy.on_group(group)
            if outcome != "accepted":
                log.debug("group %s: %s", group.group_id, outcome)
            await self._notify()

    # ------------------------------------------------------------------ API (Ray methods)
    async def address(self) -> str:
        """Where producers connect. A wildcard bind (multi-node) is advertised as this node's IP."""
        self._cond()
        if self.cfg.transport.bind_host in ("0.0.0.0", "::"):
            import ray

            return f"tcp://{ray.util.get_node_ip_address()}:{self.receiver.port}"
        return self.receiver.address

    async def admit(self, engine_rank: int, max_prompts: int) -> list[tuple[int, int, int]]:
        """Block until the admission rule allows at least one prompt; returns up to ``max_prompts``
        tickets (epoch, prompt index, version at admission)."""
        t0 = time.perf_counter()
        async with self._cond():
            await self._cond().wait_for(lambda: self.policy.capacity_to_admit() > 0)
            n = min(max_prompts, self.policy.capacity_to_admit())
            self.policy.admit(n)
        tickets = [(e, i, self.version.value) for e, i in self.cursor.take(n)]
        self.outstanding.update({(e, i): v for e, i, v in tickets})
        self.wait_seconds["admit"] += time.perf_counter() - t0
        return tickets

    async def get_batch(self, learner_version: int | None = None) -> list[Group]:
        """Block until B fresh, mixed-outcome groups are queued; return them oldest first. Staleness is
        judged against ``learner_version`` (the weights the batch will be trained on; default: the
        engines' version)."""
        t0 = time.perf_counter()
        async with self._cond():
            batch: list[Group] = []

            def ready() -> bool:
                got = self.policy.take_batch(learner_version)
                if got is not None:
                    batch.extend(got)
                return got is not None

            await self._cond().wait_for(ready)
            self._cond().notify_all()  # stale drops inside take_batch may free admission slots
        self.wait_seconds["batch"] += time.perf_counter() - t0
        return batch

    async def set_version(self, version: int) -> None:
        """The engines now run ``version``: advance, which widens admission and may make groups stale."""
        self.version.value = version
        await self._notify()

    async def stats(self) -> dict[str, Any]:
        wire = {k: v for k, v in self.receiver.counters.items() if k.startswith("rejected_")}
        return {**self.policy.stats.snapshot(), **wire,
                "rejected_unexpected": self.unexpected, "version": self.version.value, "wait_admit_s": self.wait_seconds["admit"],
                "wait_batch_s": self.wait_seconds["batch"]}

    async def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: the cursor with every admitted-but-untrained prompt given back."""
        queued = [(g.epoch, g.prompt_index) for g in self.policy.queued()]
        cur = PromptCursor(self.cursor.num_rows, self.cursor.seed)
        cur.load_state_dict(self.cursor.state_dict())
        cur.give_back(list(self.outstanding) + queued)
        return {"cursor": cur.state_dict(), "version": self.version.value}

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor.load_state_dict(state["cursor"])
        self.version.value = state["version"]

    async def close(self) -> None:
        if self._receiving is not None:
            self._receiving.cancel()
        self.receiver.close()


def replay_actor_class(cfg: Config, **options):
    import ray

    return ray.remote(ReplayService).options(num_cpus=cfg.placement.queue_cpus, max_concurrency=64, **options)
