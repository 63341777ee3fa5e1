"""Build the tiny CPU policy with no model hub: tokenizer, Qwen2 model, supervised warm start.

RL from a 0%-accuracy policy learns nothing (every group is all-wrong and dynamic sampling drops it), so
the bootstrap trains a small Qwen2-shaped byte-level BPE tokenizer on the synthetic task, builds a small
Qwen2-architecture model (loadable by transformers and SGLang), and warm-starts it with a short supervised
run until it has partial accuracy. With ``sft_target_accuracy`` the warm start stops on a measured target
(greedy accuracy of the easiest level's training problems) rather than a step count, so it lands where RL
has mixed groups on any CPU. The result is cached: a second call with the same settings returns at once.
Deterministic given the seed on one machine (one intra-op thread).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from async_dapo.config import Config, TinyModelConfig
from async_dapo.data.rows import (
    PromptRow, walk_rows, walk_shape, WALK_SYLLABLES, encode_prompt, synthetic_distinct_rows, synthetic_response, synthetic_rows,
)

log = logging.getLogger(__name__)

EOS = "<|im_end|>"
BOS = "<|im_start|>"
PAD = "<|endoftext|>"
# Frequent words as single tokens keep sequences ~15 tokens long, which is what makes a 0.3M-parameter
# model learn arithmetic in a minute.
WORD_TOKENS = {"arith": ["What is ", "Answer: "], "walk": ["Walk from ", *WALK_SYLLABLES]}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MARKER = "bootstrap.json"
# Greedy checks generate at most this many tokens: the answer line is 3-5 tokens, a 'steps' response ~16.
CHECK_TOKENS = {"answer": 8, "steps": 24}


@dataclass(frozen=True)
class BootstrapReport:
    path: str
    cached: bool
    seconds: float
    num_parameters: int
    sft_steps: int  # steps actually run
    stop_reason: str
    target_trace: list[tuple[int, float]]  # (step, greedy accuracy on the target level's training problems)
    train_accuracy: float
    val_accuracy: float
    val_accuracy_by_level: dict[int, float]


def build_tokenizer(corpus: list[str], vocab_size: int = 320, words: list[str] = WORD_TOKENS["arith"]):
    """Train a small byte-level BPE tokenizer on ``corpus`` with Qwen2's exact pipeline.

    transformers 5 always loads a ``qwen2`` model's tokenizer as ``Qwen2Tokenizer`` (it rebuilds the
    pipeline from vocab + merges with Qwen2's pre-tokenizer), and SGLang loads it the same way; so the
    tokenizer must be Qwen2-shaped to mean the same thing everywhere. Qwen2's split regex isolates every
    digit, so numbers stay one token per digit — which is what lets a tiny model learn arithmetic.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix=""))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens(words)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=PAD, bos_token=None,
        additional_special_tokens=[BOS],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def build_model(tc: TinyModelConfig, tokenizer, max_positions: int):
    """A freshly initialised Qwen2 causal LM with tied embeddings (fp32)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = int(math.ceil(len(tokenizer) / 8) * 8)  # padded: kernels like multiples of 8
    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=tc.num_layers, num_attention_heads=tc.num_heads,
        num_key_value_heads=tc.num_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=True, rope_theta=10000.0, torch_dtype="float32",
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD), bos_token_id=None,
    )
    torch.manual_seed(tc.seed)
    return Qwen2ForCausalLM(cfg)


def _sft_batch(tokenizer, rows: list[PromptRow], pad_id: int, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and labels (-100 on prompt and padding: loss on the response only)."""
    seqs, labels = [], []
    for row in rows:
        p = encode_prompt(tokenizer, row)
        r = tokenizer.encode(synthetic_response(row, style) + EOS, add_special_tokens=False)
        seqs.append(p + r)
        labels.append([-100] * len(p) + r)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id)
    lab = torch.full((len(seqs), width), -100)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(l)] = torch.tensor(l)
    return ids, lab


def supervised_warm_start(
    model, tokenizer, rows: list[PromptRow], tc: TinyModelConfig, steps: int | None = None,
    after_step: Callable[[int], bool | None] | None = None, style: str = "answer",
) -> int:
    """AdamW with cosine decay over ``tc.sft_schedule_steps`` (default ``tc.sft_steps``), batches drawn
    cyclically from ``rows`` with reference responses in ``style`` (``data.synthetic.response_style``);
    runs ``steps`` steps (default ``tc.sft_steps``). ``after_step(step)`` is
    called after each step; returning True ends the warm start there (the target check does that;
    tools/study/sft_baseline.py continues past the bootstrap's stop with it). Returns the steps run."""
    pad_id = tokenizer.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=tc.sft_lr, weight_decay=0.0)
    horizon = tc.sft_schedule_steps or tc.sft_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, horizon) / horizon))
    )
    model.train()
    bs = tc.sft_batch_size
    done = 0
    for step in range(tc.sft_steps if steps is None else steps):
        start = (step * bs) % len(rows)
        ids, lab = _sft_batch(tokenizer, (rows + rows)[start : start + bs], pad_id, style)
        loss = model(input_ids=ids, attention_mask=(ids != pad_id).long(), labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0:
            log.info("sft step %d/%d loss %.4f", step, tc.sft_steps, loss.item())
        done = step + 1
        if after_step is not None and after_step(done):
            break
    model.eval()
    return done


@torch.no_grad()
def complete(model, tokenizer, rows: list[PromptRow], max_new_tokens: int, n: int = 1,
             **sampling: Any) -> list[list[str]]:
    """``n`` transformers completions per row, decoded; greedy unless ``sampling`` says otherwise (e.g.
    ``do_sample=True, top_p=0.7, temperature=1.0``). Prompts go in left-padded batches of 128."""
    pad_id = tokenizer.pad_token_id
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    out: list[list[str]] = []
    for start in range(0, len(rows), 128):
        chunk = rows[start : start + 128]
        prompts = [encode_prompt(tokenizer, r) for r in chunk]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts]).repeat_interleave(n, 0)
        gen = model.generate(
            input_ids=ids, attention_mask=(ids != pad_id).long(), max_new_tokens=max_new_tokens,
            **{"do_sample": False, **sampling}, top_k=0, eos_token_id=eos_id, pad_token_id=pad_id,
        )
        texts = tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True)
        out += [texts[i * n : (i + 1) * n] for i in range(len(chunk))]
    return out


def greedy_accuracy(model, tokenizer, rows: list[PromptRow], max_new_tokens: int) -> list[bool]:
    """Per-row correctness of a greedy completion, scored by the DAPO math reward."""
    from async_dapo.data.reward import builtin_score

    texts = complete(model, tokenizer, rows, max_new_tokens)
    return [builtin_score(r.data_source, t, r.ground_truth, r.extra_info).acc for r, (t,) in zip(rows, texts)]


def check_tokens(cfg: Config) -> int:
    """Most tokens a greedy check generates: the whole response budget for the walk task, whose answers are
    as long as the prompt asks."""
    task = cfg.data.synthetic
    return cfg.rollout.max_response_length if task.task == "walk" else CHECK_TOKENS[task.response_style]


def task_rows(cfg: Config, split: str, size: int, seed: int, levels: list[int] | None = None) -> list[PromptRow]:
    """Problems of the configured synthetic task (the target check and the bootstrap report): the arithmetic
    task's distinct ones; the walk task's as its training draws them (a distinct set of walk problems would be
    mostly long ones, which its lognormal rarely asks for), so accuracy is weighted as RL will see it."""
    task = cfg.data.synthetic
    if task.task == "walk":
        return walk_rows(split, size, **walk_shape(task), seed=seed)
    return synthetic_distinct_rows(split, levels=levels or task.levels, heldout_fraction=task.heldout_fraction,
                                   seed=seed, limit=size)


def untrained(cfg: Config) -> tuple[Any, Any, list[PromptRow]]:
    """(tokenizer, freshly initialised model, warm-start rows) of ``cfg.model.bootstrap``: the state the
    warm start begins from, the same in every call."""
    tc, task = cfg.model.bootstrap, cfg.data.synthetic
    assert tc is not None
    train = (walk_rows("train", 20000, **walk_shape(task), seed=tc.seed) if task.task == "walk" else
             synthetic_rows("train", 20000, levels=task.levels, heldout_fraction=task.heldout_fraction, seed=tc.seed))
    corpus = [f"user\n{r.prompt[0].content}\nassistant\n{synthetic_response(r, task.response_style)}"
              for r in train[:2000]]
    tokenizer = build_tokenizer(corpus, words=WORD_TOKENS[task.task])
    model = build_model(tc, tokenizer, max_positions=cfg.rollout.engine.context_length or 2048)
    return tokenizer, model, train


class TargetCheck:
    """``after_step`` of the warm start: every ``sft_check_every`` steps, greedy accuracy on the training
    problems of the target level (at most ``eval_prompts``, distinct). Once that has been at
    ``sft_target_accuracy`` or above for ``sft_target_checks`` checks in a row, every other configured level
    is measured too, and the check says stop (True) when each has at least ``sft_level_floor``. Training
    problems, not held-out ones: the stop never peeks at validation."""

    def __init__(self, cfg: Config, model, tokenizer) -> None:
        tc, task = cfg.model.bootstrap, cfg.data.synthetic
        assert tc is not None and tc.sft_target_accuracy is not None
        self.level = tc.sft_target_level if tc.sft_target_level is not None else min(task.levels)
        self.target, self.floor, self.every = tc.sft_target_accuracy, tc.sft_level_floor, tc.sft_check_every
        self.checks = tc.sft_target_checks
        self.rows = {lv: task_rows(cfg, "train", tc.eval_prompts, tc.seed, [lv]) for lv in task.levels}
        self.model, self.tokenizer = model, tokenizer
        self.max_tokens = check_tokens(cfg)
        self.trace: list[tuple[int, float]] = []  # (step, target level's accuracy)
        self.others: dict[int, float] = {}  # the other levels at the last check that measured them

    def _accuracy(self, level: int) -> float:
        ok = greedy_accuracy(self.model, self.tokenizer, self.rows[level], max_new_tokens=self.max_tokens)
        return round(sum(ok) / len(ok), 4)

    def __call__(self, step: int) -> bool:
        if step % self.every:
            return False
        self.model.eval()
        self.trace.append((step, self._accuracy(self.level)))
        if self._held() and self.floor is not None:
            self.others = {lv: self._accuracy(lv) for lv in self.rows if lv != self.level}
        self.model.train()
        log.info("sft step %d: level %d greedy accuracy %.3f (target %.2f)%s", step, self.level,
                 self.trace[-1][1], self.target, f", other levels {self.others}" if self.others else "")
        return self.reached()

    def _held(self) -> bool:
        """The target level is at the target at each of the last ``sft_target_checks`` checks."""
        last = self.trace[-self.checks:]
        return len(last) == self.checks and all(acc >= self.target for _, acc in last)

    def reached(self) -> bool:
        if not self._held():
            return False
        return self.floor is None or all(acc >= self.floor for acc in self.others.values())

    def reason(self, steps: int) -> str:
        floor = f"; other levels {self.others} >= {self.floor:g}" if self.floor is not None else ""
        if self.reached():
            held = f" (and at the {self.checks - 1} check(s) before)" if self.checks > 1 else ""
            return (f"target reached at step {steps}: level {self.level} greedy accuracy on "
                    f"{len(self.rows[self.level])} training problems {self.trace[-1][1]:.3f} >= {self.target:g}"
                    f"{held}{floor}")
        best = max((acc for _, acc in self.trace), default=0.0)
        return (f"sft_steps ({steps}) used up before the target: best level {self.level} greedy accuracy "
                f"{best:.3f} (target {self.target:g}), other levels at the last check {self.others}")


def _fingerprint(cfg: Config) -> str:
    tc = cfg.model.bootstrap
    assert tc is not None
    task = cfg.data.synthetic
    # the arithmetic task's key leaves out the walk task's fields: models built before they existed still match
    walk_fields = {"task", "walk_median", "walk_sigma"}
    key = {"tiny": tc.model_dump(),
           "task": task.model_dump() if task.task == "walk" else task.model_dump(exclude=walk_fields),
           "ctx": cfg.rollout.engine.context_length, "version": 3}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def bootstrap(cfg: Config, force: bool = False) -> BootstrapReport:
    """Build (or reuse) the tiny model at ``cfg.model.path``; returns what was built and how well it does."""
    tc = cfg.model.bootstrap
    if tc is None:
        raise ValueError("model.bootstrap: is null, so there is nothing to build; set model.path instead")
    out = Path(cfg.model.path)
    marker = out / MARKER
    fp = _fingerprint(cfg)
    if not force and marker.exists():
        saved = json.loads(marker.read_text())
        if saved.get("fingerprint") == fp and saved.get("weights_sha256") == _weights_sha256(out):
            rep = saved["report"]
            rep["val_accuracy_by_level"] = {int(k): v for k, v in rep["val_accuracy_by_level"].items()}
            rep["target_trace"] = [tuple(x) for x in rep["target_trace"]]
            # path: where it is now (the shipped default was built elsewhere and copied)
            return BootstrapReport(**{**rep, "path": str(out), "cached": True})
        log.warning("%s: cached model does not match this config or its recorded weights: rebuilding", out)
    t0 = time.perf_counter()
    torch.set_num_threads(1)  # one thread per busy process: 2 threads on 2 cores ran 10-30x slower
    task = cfg.data.synthetic
    tokenizer, model, train = untrained(cfg)
    val = task_rows(cfg, "val", tc.eval_prompts, tc.seed)
    check = TargetCheck(cfg, model, tokenizer) if tc.sft_target_accuracy is not None else None
    steps = supervised_warm_start(model, tokenizer, train, tc, after_step=check, style=task.response_style)
    reason = check.reason(steps) if check else f"fixed step count (sft_steps {steps}, no sft_target_accuracy)"
    log.info("warm start stopped after %d steps: %s", steps, reason)
    most = check_tokens(cfg)
    val_ok = greedy_accuracy(model, tokenizer, val, max_new_tokens=most)
    train_ok = greedy_accuracy(model, tokenizer, train[-tc.eval_prompts:], max_new_tokens=most)
    by_level = {
        lv: sum(ok for ok, r in zip(val_ok, val) if r.extra_info["level"] == lv)
        / max(1, sum(r.extra_info["level"] == lv for r in val))
        for lv in task.levels
    }
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.do_sample = True  # no greedy default baked into the exported model
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    report = BootstrapReport(
        path=str(out), cached=False, seconds=round(time.perf_counter() - t0, 1),
        num_parameters=sum(p.numel() for p in model.parameters()), sft_steps=steps,
        stop_reason=reason, target_trace=check.trace if check else [],
        train_accuracy=sum(train_ok) / len(train_ok), val_accuracy=sum(val_ok) / len(val_ok),
        val_accuracy_by_level=by_level,
    )
    marker.write_text(json.dumps({"fingerprint": fp, "weights_sha256": _weights_sha256(out),
                                  "report": asdict(report)}, indent=1))
    return report


def _weights_sha256(out: Path) -> str | None:
    """The weights' hash, recorded beside the report: a cache hit means these exact weights, on any machine."""
    weights = out / "model.safetensors"
    return hashlib.sha256(weights.read_bytes()).hexdigest() if weights.exists() else None
