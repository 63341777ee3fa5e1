"""Test-only views into the real actors: subclasses that add what a test needs to drive or observe and a
run never calls. Ray runs them like the production classes (``rollout_actor_class(cfg, ProbedRolloutWorker)``);
a child process imports them from the repository root."""

from __future__ import annotations

from typing import Any

from async_dapo.rollout.actor import RolloutWorker, _progress_of, _Slot, gather_all
from async_dapo.stream.wire import Partial, Progress


class ProbedRolloutWorker(RolloutWorker):
    """A rollout actor that also samples plain prompts and reports its engine's request table."""

    def generate(self, prompts: list[list[int]], params: dict[str, Any]) -> list[dict[str, Any]]:
        """One completion per prompt by the training path (``sample_once``): SGLang's output dicts, bounded
        by rollout.request_timeout_s like any request of that path (cancelled, its requests aborted, on
        expiry). Not logging.val_timeout_s: a test shortens that one to time a validation out."""
        coro = gather_all(self.session.sample_once(p, params) for p in prompts)
        return self._call(coro, self.session.cfg.rollout.request_timeout_s, "generate (rollout.request_timeout_s)")

    def set_rollout(self, **fields: Any) -> None:
        """rollout.<field> = value on this actor (one engine serves a test module's cases with, e.g.,
        rollout.partial_rollout on and off). The session's abort rule follows partial_rollout as at start."""
        cfg = self.session.cfg
        self.session.cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update=fields)})
        self.session.keep_aborted = self.session.cfg.rollout.partial_rollout

    def num_running_requests(self) -> int:
        """Requests the engine is working on right now (to update weights mid-generation)."""
        return len(self.session.tm.rid_to_state)

    # -- progress reports (rollout.partial_every_s): a group in flight, read as a report reads it
    def start_tracked(self, prompt: list[int], params: dict[str, Any], n: int) -> None:
        """Start ``n`` samples of ``prompt`` by the training path (``sample_n``) with their progress slots, as
        a group in flight, and return at once."""
        import asyncio

        self._slots = [_Slot() for _ in range(n)]
        self._tracked = asyncio.run_coroutine_threadsafe(self.session.sample_n(prompt, params, n, self._slots),
                                                         self.loop)

    def snapshot(self) -> Partial:
        """The tracked group as a progress report would hold it now (read on the engine's loop)."""
        async def read():
            session = self.session
            now = None if session.update_started_at is not None else (session.updates_started, session.version)
            samples = [_progress_of(slot, now) for slot in self._slots]
            return Partial(group_id="probe", prompt_index=0, epoch=0, engine_rank=self.session.rank, sent_at=0.0,
                           samples=tuple(Progress(ids, lps, versions, finish, seconds)
                                         for ids, lps, versions, finish, seconds in samples))

        return self._call(read(), 10, "snapshot")

    def drop_tracked(self) -> None:
        """The engine gives the tracked group up, as a leaving engine does: its requests are aborted and gone."""
        import concurrent.futures

        self._tracked.cancel()
        try:
            self._tracked.result(30)
        except concurrent.futures.CancelledError:
            pass

    def carry_on(self, prompt: list[int], params: dict[str, Any], partial: Partial) -> list[dict[str, Any]]:
        """Continue each sample of another engine's report, as the engine that takes its prompt does."""
        coro = gather_all(self.session._carry_on(prompt, params, p, _Slot()) for p in partial.samples)
        return self._call(coro, self.session.cfg.rollout.request_timeout_s, "carry on")

    def carried_tokens(self) -> tuple[int, int]:
        """(tokens continued from another engine's reports, tokens of such reports thrown away as too old)."""
        return self.session.stats.carried_tokens, self.session.stats.carried_stale_tokens
