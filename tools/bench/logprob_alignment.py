"""Engine against learner log-probs, position by position: the bare SGLang engine samples the config's
training prompts (rollout.temperature, top_p, max_response_length, return_logprob), then a transformers
forward of the same weights scores every response token. Prints the mean and max |difference| per band of 32
response positions, and how the responses ended (an EOS-stopped response must end with its EOS token: the
learner trains on it).

    python tools/bench/logprob_alignment.py --config configs/longtail_cpu.yaml [--prompts 48 --n 4]

A drift that grows with the position would show up as off-policy error in long responses
(``actor/rollout_logprob_abs_diff`` averages it over every trained token).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: common.py
import common  # noqa: E402

BAND = 32


def sample(cfg, prompts: list[list[int]], n: int) -> list[dict]:
    """n completions of each prompt from the bare engine, with their token log-probs."""
    from async_dapo.rollout.engine import start_engine
    from async_dapo.rollout.actor import sampling_params

    engine = start_engine(cfg.rollout.engine, cfg.model.path)
    try:
        return engine.generate(input_ids=[p for p in prompts for _ in range(n)],
                               sampling_params=sampling_params(cfg), return_logprob=True)
    finally:
        engine.shutdown()


def differences(cfg, prompts: list[list[int]], outs: list[dict], n: int) -> dict[int, list[float]]:
    """|engine - transformers| log-prob of every response token, by band of positions."""
    import torch
    from transformers import AutoModelForCausalLM

    from async_dapo.learner.loss import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).eval()
    bands: dict[int, list[float]] = {}
    for i, out in enumerate(outs):
        prompt, ids = prompts[i // n], out["output_ids"]
        x = torch.tensor([prompt + ids])
        with torch.no_grad():
            ref = token_logprobs(model(input_ids=x).logits[:, len(prompt) - 1 : -1], x[:, len(prompt):],
                                 temperature=cfg.rollout.temperature)[0]
        engine = torch.tensor([lp for lp, *_ in out["meta_info"]["output_token_logprobs"]])
        for k, d in enumerate((ref - engine).abs().tolist()):
            bands.setdefault(k // BAND, []).append(d)
    return bands


def main() -> None:
    ap = common.parser(__file__, __doc__, config=True)
    ap.add_argument("--prompts", type=int, default=48, help="training prompts (default %(default)s)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (default %(default)s)")
    args = ap.parse_args()
    cfg = common.load_model(args)
    from transformers import AutoTokenizer

    from async_dapo.data.rows import encode_prompt, train_rows

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    prompts = [encode_prompt(tok, r) for r in train_rows(cfg)[: args.prompts]]
    outs = sample(cfg, prompts, args.n)
    stopped = [o for o in outs if (o["meta_info"].get("finish_reason") or {}).get("type") == "stop"]
    rows = [{"positions": f"{b * BAND}-{b * BAND + BAND - 1}", "tokens": len(v),
             "mean_abs_diff": f"{sum(v) / len(v):.2e}", "max_abs_diff": f"{max(v):.2e}"}
            for b, v in sorted(differences(cfg, prompts, outs, args.n).items())]
    print(common.write_table(rows, ["positions", "tokens", "mean_abs_diff", "max_abs_diff"], None, None))
    print(json.dumps({"responses": len(outs), "mean_length": sum(len(o["output_ids"]) for o in outs) / len(outs),
                      "stopped": len(stopped), "stopped_on_eos": sum(o["output_ids"][-1] == tok.eos_token_id
                                                                      for o in stopped)}))


if __name__ == "__main__":
    main()
