"""Measure the SGLang engine on the configured device: start time, and generation tokens/s for
P prompts x T new tokens (EOS ignored so every request really makes T tokens).

    python tools/bench/engine.py --config configs/tiny_cpu.yaml [--prompts 32 --tokens 64 --repeats 3]

Prints one JSON line: engine_start_s, prompts, new_tokens, tok_per_s_runs, tok_per_s_median.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: common.py
import common  # noqa: E402


def main() -> None:
    ap = common.parser(__file__, __doc__, config=True)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = common.load_model(args)
    from transformers import AutoTokenizer

    from async_dapo.data.rows import encode_prompt, synthetic_rows
    from async_dapo.rollout.engine import start_engine

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    rows = synthetic_rows("val", args.prompts, levels=[1, 2, 3, 4], heldout_fraction=0.1, seed=0)
    prompts = [encode_prompt(tok, r) for r in rows]
    t0 = time.perf_counter()
    engine = start_engine(cfg.rollout.engine, cfg.model.path)
    start_s = time.perf_counter() - t0
    params = {"temperature": 1.0, "max_new_tokens": args.tokens, "ignore_eos": True}
    try:
        engine.generate(input_ids=prompts[:2], sampling_params=params)  # first-call overheads out of the timing
        runs = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params)  # the bare engine, one batch
            dt = time.perf_counter() - t
            runs.append(sum(len(o["output_ids"]) for o in outs) / dt)
    finally:
        engine.shutdown()
    print(json.dumps({"engine_start_s": round(start_s, 1), "prompts": args.prompts, "new_tokens": args.tokens,
                      "tok_per_s_runs": [round(r) for r in runs], "tok_per_s_median": round(sorted(runs)[len(runs) // 2])}))


if __name__ == "__main__":
    main()
