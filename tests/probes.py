"""Test-only views into the real actors: subclasses that add what a test needs to drive or observe and a
run never calls. Ray runs them like the production classes (``rollout_actor_class(cfg, ProbedRolloutWorker)``);
a child process imports them from the repository root."""

from __future__ import annotations

from typing import Any

from async_dapo.rollout.actor import RolloutWorker, gather_all


class ProbedRolloutWorker(RolloutWorker):
    """A rollout actor that also samples plain prompts and reports its engine's request table."""

    def generate(self, prompts: list[list[int]], params: dict[str, Any]) -> list[dict[str, Any]]:
        """One completion per prompt by the training path (``sample_once``): SGLang's output dicts, bounded
        by rollout.request_timeout_s like any request of that path (cancelled, its requests aborted, on
        expiry). Not logging.val_timeout_s: a test shortens that one to time a validation out."""
        coro = gather_all(self.session.sample_once(p, params) for p in prompts)
        return self._call(coro, self.session.cfg.rollout.request_timeout_s, "generate (rollout.request_timeout_s)")

    def set_partial_rollout(self, keep: bool) -> None:
        """rollout.partial_rollout on this actor (one engine serves a test module's cases with it on and off)."""
        cfg = self.session.cfg
        self.session.cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"partial_rollout": keep})})

    def num_running_requests(self) -> int:
        """Requests the engine is working on right now (to update weights mid-generation)."""
        return len(self.session.tm.rid_to_state)
