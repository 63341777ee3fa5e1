"""Continued-SFT baseline to put beside an RL run: what the supervised warm start reaches if it simply
keeps going, on the same held-out prompts and with the same validation sampling.

    python tools/study/sft_baseline.py --config configs/tiny_cpu.yaml [--set a.b=c ...] [--extra 600 --every 100]

Rebuilds the warm start of ``model.bootstrap`` in this process up to the step the cached model stopped at
(its bootstrap.json; deterministic on one machine: the same weights), then continues the same run, same
data order and the same cosine schedule (``sft_schedule_steps``), for ``--extra`` more steps. At the warm
start and every ``--every`` steps it samples ``logging.val_n`` completions per held-out prompt with
transformers at ``logging.val_temperature`` / ``logging.val_top_p`` (what an RL run's ``val/avg_at_k`` uses) and prints a Markdown row: extra steps,
SFT seconds since the warm start (evaluation excluded), avg@k, and avg@k per level.
One process, one thread. SFT sees the reference answers; RL sees only the reward.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: common.py
import common  # noqa: E402


def avg_at_k(model, tokenizer, rows, cfg, seed: int) -> tuple[float, dict[str, float]]:
    import torch

    from async_dapo.bootstrap import complete
    from async_dapo.rollout.evaluate import result_scores, val_metrics
    from async_dapo.data.reward import load_score_fn

    lg = cfg.logging
    torch.manual_seed(seed)
    model.eval()
    texts = complete(model, tokenizer, rows, cfg.rollout.max_response_length, n=lg.val_n, do_sample=True,
                     top_p=lg.val_top_p, temperature=lg.val_temperature)
    model.train()
    score = load_score_fn(cfg.reward)  # the run's reward, in-process: this tool has no engine or workers
    m = val_metrics(result_scores([[score(r.data_source, t, r.ground_truth, r.extra_info) for t in group]
                                   for group, r in zip(texts, rows)]), rows)
    return m["val/avg_at_k"], {key.rsplit("/", 1)[1]: v for key, v in m.items() if key.startswith("val/avg_at_k/")}


def main() -> None:
    ap = common.parser(__file__, __doc__, config=True)
    ap.add_argument("--extra", type=int, default=600, help="SFT steps past the warm start")
    ap.add_argument("--every", type=int, default=100, help="evaluate every this many extra steps")
    args = ap.parse_args()
    cfg = common.load(args)
    tc = cfg.model.bootstrap
    if tc is None:
        ap.error("model.bootstrap is null: this baseline continues the tiny model's supervised warm start")
    import torch

    from async_dapo.bootstrap import supervised_warm_start, untrained
    from async_dapo.data.rows import val_rows

    stop = common.bootstrap_model(cfg).sft_steps  # where the warm start stopped (its target, or sft_steps)
    torch.set_num_threads(1)
    tokenizer, model, train = untrained(cfg)
    rows = val_rows(cfg)
    clock = {"sft_s": 0.0, "t": None}

    def after_step(step: int) -> None:
        now = time.perf_counter()
        if clock["t"] is not None:
            clock["sft_s"] += now - clock["t"]
        extra = step - stop
        if extra >= 0 and extra % args.every == 0:
            avg, per = avg_at_k(model, tokenizer, rows, cfg, seed=extra)
            if extra == 0:
                head = ["extra SFT steps", "SFT s", f"avg@{cfg.logging.val_n}", *sorted(per)]
                print("| " + " | ".join(head) + " |\n|" + "---|" * len(head), flush=True)
            cells = [str(extra), f"{clock['sft_s']:.0f}", f"{avg:.3f}", *(f"{per[k]:.3f}" for k in sorted(per))]
            print("| " + " | ".join(cells) + " |", flush=True)
        clock["t"] = time.perf_counter() if extra >= 0 else None

    supervised_warm_start(model, tokenizer, train, tc, steps=stop + args.extra, after_step=after_step,
                          style=cfg.data.synthetic.response_style)


if __name__ == "__main__":
    main()
