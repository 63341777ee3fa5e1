"""A training row whose groups keep failing to score (a reward function that hangs or raises on it) is
quarantined after reward.max_score_failures: counted, logged once with its row, never issued again, and
checkpointed with the cursor. Before, its prompt went back to the cursor and was re-issued first every time,
so one poisonous row could burn every engine restart."""

import asyncio
import logging

from async_dapo.config import load_config
from async_dapo.data.rows import PromptCursor
from async_dapo.replay.queue import ReplayQueue


def _cfg(*extra):
    return load_config(None, ["algorithm.train_batch_groups=2", "learner.mini_batch_groups=2",
                              "replay.max_staleness=0", "rollout.n=2", "replay.capacity_groups=8",
                              "reward.max_score_failures=3", *extra])


def test_cursor_quarantine_skips_the_row_for_good_and_survives_a_checkpoint():
    cur = PromptCursor(4, seed=1)
    first = cur.take(4)  # one epoch: every row once
    bad = first[0][1]
    cur.give_back([first[0]])
    assert cur.quarantine(bad) and not cur.quarantine(bad)  # True only the first time
    rows_next = [i for _, i in cur.take(8)]  # the given-back ticket is gone, and the next epochs skip it
    assert bad not in rows_next and len(rows_next) == 8 and sorted(set(rows_next)) == sorted({0, 1, 2, 3} - {bad})
    again = PromptCursor(4, seed=1)
    again.load_state_dict(cur.state_dict())
    assert again.quarantined == {bad} and bad not in [i for _, i in again.take(6)]


def test_cursor_with_every_row_quarantined_is_exhausted_instead_of_spinning():
    cur = PromptCursor(3, seed=0)
    for i in range(3):
        cur.quarantine(i)
    assert cur.exhausted and cur.take(5) == []


def test_a_row_that_fails_scoring_k_times_is_quarantined_once_and_not_reissued(caplog):
    async def scenario():
        svc = ReplayQueue(_cfg())
        try:
            seen = []
            for attempt in range(3):
                (ticket,) = await svc.admit(0, 1)
                seen.append(ticket[2])
                assert await svc.abandon(ticket[0], "score_timeout" if attempt < 2 else "score_error")
            later = [t[2] for t in await svc.admit(0, 2)]
            return seen, later, await svc.stats(), svc.cursor.state_dict()
        finally:
            await svc.close()

    with caplog.at_level(logging.ERROR, logger="async_dapo.replay.queue"):
        seen, later, stats, state = asyncio.run(scenario())
    bad = seen[0]
    assert seen == [bad] * 3  # a given-back prompt is re-issued first: the same row three times
    assert bad not in later and len(later) == 2
    assert stats["quarantined_prompts"] == 1 and state["quarantined"] == [bad]
    assert stats["abandoned/score_timeout"] == 2 and stats["abandoned/score_error"] == 1
    assert stats["running"] == 2  # the three failed tickets freed their slots
    lines = [r.getMessage() for r in caplog.records if "quarantined" in r.getMessage()]
    assert len(lines) == 1 and f"training row {bad} quarantined after 3 scoring failures" in lines[0]
    assert "ground_truth=" in lines[0] and "What is" in lines[0]


def test_other_failures_never_quarantine():
    async def scenario():
        svc = ReplayQueue(_cfg())
        try:
            for _ in range(5):
                (ticket,) = await svc.admit(0, 1)
                await svc.abandon(ticket[0], "engine_error")
            return ticket[2], (await svc.admit(0, 1))[0][2], await svc.stats()
        finally:
            await svc.close()

    last, reissued, stats = asyncio.run(scenario())
    assert reissued == last and stats["quarantined_prompts"] == 0
