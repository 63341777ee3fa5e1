"""Prompt rows: the DAPO-Math-17k (verl-style) row schema, its parquet/JSONL loader, and the synthetic task.

Every prompt source yields :class:`PromptRow` — the schema users already have for DAPO-Math-17k::

    {"data_source": str, "prompt": [{"role": ..., "content": ...}, ...], "ability": str,
     "reward_model": {"style": "rule", "ground_truth": str}, "extra_info": {...}}

A bad row raises :class:`DatasetError` naming the file, the 0-based row number and the field. The synthetic
task (integer arithmetic in four difficulty levels) emits the same schema, so the rest of the system never
knows where a prompt came from.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

if TYPE_CHECKING:
    from async_dapo.config import SyntheticTaskConfig

log = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A bad dataset row: ``<file>: row <n>: <field>: <problem>``."""


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class RewardSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    style: str = "rule"
    ground_truth: str

    @field_validator("ground_truth", mode="before")
    @classmethod
    def _number_to_text(cls, v: Any) -> Any:
        # Users' files often store integer answers as numbers; the scorer compares strings.
        return str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v


class PromptRow(BaseModel):
    """One prompt of the DAPO-Math-17k schema (unknown top-level keys are kept, not rejected)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    data_source: str
    prompt: list[Message] = Field(min_length=1)
    ability: str = "math"
    reward_model: RewardSpec
    extra_info: dict[str, Any] = Field(default_factory=dict)

    @property
    def ground_truth(self) -> str:
        return self.reward_model.ground_truth


def _row_error(path: Path, index: int, exc: ValidationError) -> DatasetError:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or "<row>"
    return DatasetError(f"{path}: row {index}: {field}: {err['msg']}")


def _raw_rows(path: Path) -> list[Any]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # heavy import, only when parquet is used

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with path.open() as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path}: row {i}: not valid JSON ({exc.msg})") from None
        return rows
    raise DatasetError(f"{path}: unsupported file type '{path.suffix}' (use .parquet or .jsonl)")


def load_rows(path: str | Path) -> list[PromptRow]:
    """Read and validate every row of a .parquet or .jsonl file; the first bad row raises."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: file not found")
    rows = []
    for i, raw in enumerate(_raw_rows(path)):
        if not isinstance(raw, dict):
            raise DatasetError(f"{path}: row {i}: <row>: expected an object, got {type(raw).__name__}")
        try:
            rows.append(PromptRow.model_validate(raw))
        except ValidationError as exc:
            raise _row_error(path, i, exc) from None
    if not rows:
        raise DatasetError(f"{path}: no rows")
    return rows


def write_rows(rows: list[PromptRow], path: str | Path) -> None:
    """Write rows as .parquet or .jsonl (the formats :func:`load_rows` reads)."""
    path = Path(path)
    dicts = [r.model_dump(mode="json") for r in rows]
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(dicts), path)
    else:
        path.write_text("".join(json.dumps(d) + "\n" for d in dicts))


# ------------------------------------------------------------------------------------ synthetic task
SYNTHETIC_SOURCE = "async_dapo/arith"

# Level -> (first operand range, second operand range, operators). Four roughly equal steps of
# difficulty for a tiny model: after a short warm start level 1 is mostly solved and level 3/4 mostly
# not, so groups come out all-correct, all-wrong and mixed — the situation dynamic sampling is for.
LEVELS: dict[int, tuple[range, range, str]] = {
    1: (range(0, 10), range(0, 10), "+-"),
    2: (range(10, 100), range(0, 10), "+-"),
    3: (range(10, 100), range(10, 100), "+-"),
    4: (range(10, 100), range(2, 10), "*"),
}


def _answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _is_heldout(problem: str, fraction: float) -> bool:
    # Stable across processes and Python versions (unlike hash()).
    digest = int.from_bytes(hashlib.sha256(problem.encode()).digest()[:8], "little")
    return digest / 2**64 < fraction


def synthetic_problems(level: int, split: Literal["train", "val"], heldout_fraction: float) -> list[tuple[str, int]]:
    """All (question, answer) pairs of a level that fall in ``split``, in a fixed order."""
    left, right, ops = LEVELS[level]
    out = []
    for a in left:
        for b in right:
            for op in ops:
                q = f"What is {a}{op}{b}?"
                if _is_heldout(q, heldout_fraction) == (split == "val"):
                    out.append((q, _answer(a, op, b)))
    return out


def _shuffled_pools(split: Literal["train", "val"], levels: list[int], heldout_fraction: float,
                    seed: int) -> dict[int, list[tuple[str, int]]]:
    # One rng for all levels, shuffled in level order: the same seed gives the same pools everywhere.
    rng = random.Random(f"{seed}-{split}")
    pools = {}
    for lv in levels:
        pool = synthetic_problems(lv, split, heldout_fraction)
        rng.shuffle(pool)
        pools[lv] = pool
    return pools


def _synthetic_row(q: str, ans: int, index: int, level: int, split: str) -> PromptRow:
    return PromptRow(
        data_source=SYNTHETIC_SOURCE,
        prompt=[Message(role="user", content=q)],
        ability="math",
        reward_model=RewardSpec(style="rule", ground_truth=str(ans)),
        extra_info={"index": index, "level": level, "split": split},
    )


def synthetic_rows(
    split: Literal["train", "val"], size: int, *, levels: list[int], heldout_fraction: float, seed: int
) -> list[PromptRow]:
    """``size`` rows, levels interleaved round-robin, problems drawn without replacement per level
    (cycling when a level's pool is exhausted). Deterministic given the arguments."""
    pools = _shuffled_pools(split, levels, heldout_fraction, seed)
    rows = []
    for i in range(size):
        lv = levels[i % len(levels)]
        q, ans = pools[lv][(i // len(levels)) % len(pools[lv])]
        rows.append(_synthetic_row(q, ans, i, lv, split))
    return rows


def synthetic_distinct_rows(split: Literal["train", "val"], *, levels: list[int], heldout_fraction: float,
                            seed: int, limit: int | None = None) -> list[PromptRow]:
    """Every distinct problem of ``split`` in ``levels``, each once, at most ``limit`` in total (validation
    uses the held-out split; the warm start's target check uses the training split).

    Levels take turns (each pool shuffled with ``seed``, as :func:`synthetic_rows` does), and a level whose
    pool is used up is skipped rather than cycled: a repeated prompt would count one problem many times
    and make a small held-out set look large. While no pool is used up the order equals
    ``synthetic_rows(split, ...)``'s."""
    pools = _shuffled_pools(split, levels, heldout_fraction, seed)
    draws = {lv: iter(pool) for lv, pool in pools.items()}  # shared per level, so a repeated level stays distinct
    total = sum(len(pool) for pool in pools.values())
    cap = total if limit is None else min(limit, total)
    rows: list[PromptRow] = []
    while len(rows) < cap:
        for lv in levels:
            problem = next(draws[lv], None)
            if problem is not None and len(rows) < cap:
                rows.append(_synthetic_row(*problem, len(rows), lv, split))
    return rows


_QUESTION = re.compile(r"What is (\d+)([-+*])(\d+)\?")


def synthetic_response(row: PromptRow, style: Literal["answer", "steps"] = "answer") -> str:
    """The reference response used by the supervised warm start: the DAPO answer line, preceded in the
    'steps' style by the units-digit carry or borrow when there is one, for half of the problems (by hash):
    so the warm-started policy writes both forms and RL can learn the short one under a tight response
    budget (see ``response_style``)."""
    if row.data_source == WALK_SOURCE:
        return row.ground_truth  # the walk task has one correct response
    answer = f"Answer: {row.ground_truth}"
    match = _QUESTION.fullmatch(row.prompt[-1].content)
    if style == "answer" or match is None:
        return answer
    a, op, b = int(match[1]), match[2], int(match[3])
    ua, ub = a % 10, b % 10
    if hashlib.sha256(match[0].encode()).digest()[0] % 2:
        return answer  # half of the problems never show work: the policy sees both forms of a carry
    if op == "+" and ua + ub >= 10:
        return f"{ua}+{ub}={ua + ub}, carry 1. {answer}"
    if op == "-" and a >= 10 and ua < ub:
        return f"1{ua}-{ub}={10 + ua - ub}, borrow 1. {answer}"
    return answer


# -------------------------------------------------------------------------------------- walk task
WALK_SOURCE = "async_dapo/walk"
# A fixed cycle of 200 syllables (each one token: bootstrap adds them to the tokenizer). "Walk from X."
# is answered by every syllable from X to the last one, in order: the start sets the needed length.
WALK_SYLLABLES = [c + v for v in ("a", "e", "i", "o", "u", "ai", "au", "ei", "ou", "oo") for c in "bcdfghjklmnpqrstvwxz"]


def walk_response(start: int) -> str:
    """The one correct response to "Walk from WALK_SYLLABLES[start].": every syllable from there to the end."""
    return " ".join(WALK_SYLLABLES[start:])


def walk_shape(task: SyntheticTaskConfig) -> dict:
    """walk_rows' distribution arguments from a SyntheticTaskConfig."""
    return {"median": task.walk_median, "sigma": task.walk_sigma, "heldout_fraction": task.heldout_fraction}


def walk_rows(split: Literal["train", "val"], size: int, *, median: float, sigma: float, heldout_fraction: float,
              seed: int, distinct: bool = False) -> list[PromptRow]:
    """``size`` rows of the walk task, drawn i.i.d.: the number of steps k (syllables in the answer, about 2
    tokens each) lognormal(median, sigma), at most 200 — long-CoT RL response lengths are right-skewed, and a
    response budget truncates the longest. The problem with k steps starts at syllable 200 - k; it belongs
    to ``split`` by the hash of its text, as the arithmetic task's do. ``distinct``: each problem once, at
    most as many as the split holds (validation). Deterministic given the arguments."""
    rng, top = random.Random(f"{seed}-{split}-walk"), len(WALK_SYLLABLES)
    in_split = {k for k in range(1, top + 1)
                if _is_heldout(_walk_question(k), heldout_fraction) == (split == "val")}
    if not in_split:
        raise ValueError(f"heldout_fraction {heldout_fraction}: the walk task's {split} split is empty")
    rows: list[PromptRow] = []
    for _ in range(1000 * size + 100_000):  # bounded: a narrow distribution may miss the split entirely
        if len(rows) >= (min(size, len(in_split)) if distinct else size):
            return rows
        k = max(1, min(top, round(rng.lognormvariate(math.log(median), sigma))))
        if k not in in_split or (distinct and any(r.extra_info["steps"] == k for r in rows)):
            continue
        rows.append(PromptRow(data_source=WALK_SOURCE, prompt=[Message(role="user", content=_walk_question(k))],
                              ability="walk", reward_model=RewardSpec(style="rule", ground_truth=walk_response(top - k)),
                              extra_info={"index": len(rows), "level": 1, "split": split, "steps": k}))
    raise ValueError(f"walk_median {median:g}, walk_sigma {sigma:g}: draws almost never land in the {split} split "
                     f"(heldout_fraction {heldout_fraction:g}); widen walk_sigma")


def _walk_question(steps: int) -> str:
    return f"Walk from {WALK_SYLLABLES[len(WALK_SYLLABLES) - steps]}."


# ------------------------------------------------------------------------------ configured sources
SYNTHETIC_TRAIN_SIZE = 20_000  # rows of the synthetic training set (levels interleaved)


def train_rows(cfg) -> list[PromptRow]:
    """The training prompts of a run (``cfg``: async_dapo.config.Config), identical in every process."""
    if cfg.data.train == "synthetic":
        t = cfg.data.synthetic
        if t.task == "walk":
            return walk_rows("train", SYNTHETIC_TRAIN_SIZE, **walk_shape(t), seed=cfg.data.shuffle_seed)
        return synthetic_rows("train", SYNTHETIC_TRAIN_SIZE, levels=t.levels,
                              heldout_fraction=t.heldout_fraction, seed=cfg.data.shuffle_seed)
    return load_rows(cfg.data.train)


def prompt_key(row: PromptRow) -> tuple[tuple[str, str], ...]:
    """What makes two rows the same prompt: their chat messages (role, content), in order."""
    return tuple((m.role, m.content) for m in row.prompt)


def prompt_ids(rows: list[PromptRow]) -> list[int]:
    """One id per row, equal for rows with the same prompt (ids in order of first occurrence)."""
    ids: dict[tuple[tuple[str, str], ...], int] = {}
    return [ids.setdefault(prompt_key(row), len(ids)) for row in rows]


def distinct_prompt_rows(rows: list[PromptRow], source: str) -> list[PromptRow]:
    """``rows`` without repeated prompts, the first occurrence kept. verl-style eval files repeat each
    problem (AIME-2024: 30 problems x 32), which would only repeat the same measurement."""
    seen: set[tuple[tuple[str, str], ...]] = set()
    out = []
    for row in rows:
        if prompt_key(row) not in seen:
            seen.add(prompt_key(row))
            out.append(row)
    log.info("%s: removed %d duplicate prompt rows of %d (%d distinct)", source, len(rows) - len(out),
             len(rows), len(out))
    return out


def val_rows(cfg) -> list[PromptRow]:
    """The held-out prompts, each distinct, at most ``logging.val_prompts``: the synthetic task's held-out
    problems (levels taking turns, see :func:`synthetic_distinct_rows`), or the configured file's rows with
    repeated prompts removed."""
    n = cfg.logging.val_prompts
    if cfg.data.val == "synthetic":
        t = cfg.data.synthetic
        if t.task == "walk":
            return walk_rows("val", n, **walk_shape(t), seed=cfg.logging.seed, distinct=True)
        return synthetic_distinct_rows("val", levels=t.levels, heldout_fraction=t.heldout_fraction,
                                      seed=cfg.logging.seed, limit=n)
    return distinct_prompt_rows(load_rows(cfg.data.val), str(cfg.data.val))[:n]


def encode_prompt(tokenizer, row: PromptRow) -> list[int]:
    """Chat-templated prompt token ids, ending with the assistant header: what every engine request and the
    warm start see for ``row``."""
    text = tokenizer.apply_chat_template(
        [m.model_dump() for m in row.prompt], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def source_name(cfg, split: Literal["train", "val"]) -> str:
    """How messages name a split's prompt source: the configured file path, or ``synthetic:<split>``."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    value = cfg.data.train if split == "train" else cfg.data.val
    return f"synthetic:{split}" if value == "synthetic" else str(value)


def fit_prompt_lengths(
    rows: list[PromptRow], lengths: list[int], *, max_len: int, truncation: str, source: str
) -> list[int]:
    """Apply ``data.max_prompt_length`` / ``data.truncation`` to tokenized prompts (pure: the caller tokenizes).

    ``lengths[i]`` is the token count of ``rows[i]``'s prompt (chat template applied). Returns, per row, how
    many leading tokens to drop (0 for a prompt that fits). With ``truncation="error"`` the first prompt
    longer than ``max_len`` raises :class:`DatasetError` naming ``source`` and its 0-based row; with
    ``"left"`` a long prompt keeps its last ``max_len`` tokens (verl's left truncation).
    """
    if len(rows) != len(lengths):
        raise ValueError(f"{source}: {len(rows)} rows but {len(lengths)} prompt lengths")
    if truncation not in ("error", "left"):
        raise ValueError(f"data.truncation must be 'error' or 'left', got {truncation!r}")
    if max_len < 1:
        raise ValueError(f"data.max_prompt_length must be >= 1, got {max_len}")
    drops = []
    for i, n in enumerate(lengths):
        if n > max_len and truncation == "error":
            raise DatasetError(
                f"{source}: row {i}: prompt: {n} tokens > data.max_prompt_length {max_len} "
                f"(set data.truncation=left to keep the last {max_len} tokens)"
            )
        drops.append(max(0, n - max_len))
    return drops


class PromptCursor:
    """Epoch-aware prompt order: each epoch is a fresh seeded permutation of the row indices.

    ``take(n)`` hands out (epoch, index) tickets. Prompts handed out but never trained (in flight or queued
    at a checkpoint) are given back with ``give_back`` and are re-issued first, so that after a resume no
    prompt is replayed twice or skipped. ``state_dict``/``load_state_dict`` make it checkpointable.

    Retirement (``retire_after`` > 0): :meth:`solved` counts a row's all-correct groups per prompt (``keys``
    gives each row its prompt's id, so every row of a repeated prompt counts together); at ``retire_after``
    the prompt is retired and ``take`` skips its rows from then on, counting them in ``skipped``.

    Quarantine: :meth:`quarantine` takes one row out for good (its groups kept failing to score); ``take``
    never hands it out again, also not from the given-back prompts.
    """

    def __init__(self, num_rows: int, seed: int = 0, *, keys: Sequence[int] | None = None,
                 retire_after: int = 0) -> None:
        if num_rows <= 0:
            raise ValueError(f"num_rows must be > 0, got {num_rows}")
        if keys is not None and len(keys) != num_rows:
            raise ValueError(f"keys: {len(keys)} for {num_rows} rows")
        self.num_rows, self.seed = num_rows, seed
        self.epoch, self.position = 0, 0
        self.pending: list[tuple[int, int]] = []
        self._order_epoch, self._order = -1, []
        self.keys = list(keys) if keys is not None else None  # None: every row is its own prompt
        self._prompts = len(set(self.keys)) if self.keys is not None else num_rows
        self.retire_after = retire_after
        self.solved_counts: Counter[int] = Counter()
        self.retired: set[int] = set()
        self.skipped = 0  # rows not handed out because their prompt is retired
        self.quarantined: set[int] = set()  # rows never handed out again

    def _permutation(self) -> list[int]:
        if self._order_epoch != self.epoch:
            self._order = list(range(self.num_rows))
            random.Random(f"{self.seed}-{self.epoch}").shuffle(self._order)
            self._order_epoch = self.epoch
        return self._order

    @property
    def exhausted(self) -> bool:
        """Every row is retired or quarantined: ``take`` can hand out nothing more."""
        return len(self.retired) == self._prompts or (
            bool(self.quarantined) and all(self._dead(i) for i in range(self.num_rows)))

    def _dead(self, index: int) -> bool:
        return index in self.quarantined or (bool(self.retired) and self._key(index) in self.retired)

    def _key(self, index: int) -> int:
        return self.keys[index] if self.keys is not None else index

    def _live(self, index: int) -> bool:
        if index in self.quarantined:
            return False
        if self.retired and self._key(index) in self.retired:
            self.skipped += 1
            return False
        return True

    def take(self, n: int) -> list[tuple[int, int]]:
        """Up to ``n`` tickets, given-back ones first; fewer only when :attr:`exhausted`."""
        out = [t for t in self.pending[:n] if self._live(t[1])]
        self.pending = self.pending[n:]
        dead_run = 0  # rows passed in a row without a live one: a whole epoch of them means none is left
        while len(out) < n and len(self.retired) < self._prompts and dead_run < self.num_rows:
            index = self._permutation()[self.position]
            if self._live(index):
                out.append((self.epoch, index))
                dead_run = 0
            else:
                dead_run += 1
            self.position += 1
            if self.position == self.num_rows:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def give_back(self, tickets: list[tuple[int, int]]) -> None:
        self.pending = sorted(set(self.pending) | {(int(e), int(i)) for e, i in tickets})

    def solved(self, index: int) -> bool:
        """Row ``index`` came back all-correct once more; True if that retired its prompt just now."""
        if not self.retire_after:
            return False
        key = self._key(index)
        self.solved_counts[key] += 1
        if key in self.retired or self.solved_counts[key] < self.retire_after:
            return False
        self.retired.add(key)
        return True

    def quarantine(self, index: int) -> bool:
        """Never hand out row ``index`` again; True if it was not quarantined yet."""
        if index in self.quarantined:
            return False
        self.quarantined.add(index)
        self.pending = [t for t in self.pending if t[1] != index]
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"num_rows": self.num_rows, "seed": self.seed, "epoch": self.epoch,
                "position": self.position, "pending": [list(t) for t in self.pending],
                "solved_counts": [[k, c] for k, c in sorted(self.solved_counts.items())],
                "retired": sorted(self.retired), "skipped": self.skipped, "quarantined": sorted(self.quarantined)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["num_rows"], state["seed"]) != (self.num_rows, self.seed):
            raise ValueError("cursor state belongs to another dataset (num_rows/seed differ)")
        self.epoch, self.position = state["epoch"], state["position"]
        self.pending = [tuple(t) for t in state["pending"]]
        # Checkpoints from before retirement existed have none of these.
        self.solved_counts = Counter({int(k): int(c) for k, c in state.get("solved_counts", [])})
        self.retired = {int(k) for k in state.get("retired", [])}
        self.skipped = int(state.get("skipped", 0))
        self.quarantined = {int(i) for i in state.get("quarantined", [])}
