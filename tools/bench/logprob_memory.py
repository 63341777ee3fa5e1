"""Peak host memory of the learner's log-prob forward + backward: the old full-vocabulary path versus
``async_dapo.learner.loss.token_logprobs`` (chunked), each measured in a fresh process.

    python tools/bench/logprob_memory.py [--shape 4,2048,32768] [--temperature 0.7] [--chunk-tokens 1024]

old: ``torch.log_softmax(logits.float() / T, -1).gather(-1, targets)`` (what the learner did); new:
``token_logprobs(logits, targets, temperature=T, chunk_tokens=...)``. Each child allocates fp32 logits
``[B, T, V]`` requiring grad, resets the RSS high-water mark and reads the RSS, runs forward,
``.sum().backward()``, reads the high-water mark (VmHWM): the growth is the peak memory the path needs
beyond the logits (the gradient included). A fresh process per path, so the allocator starts clean. The
default temperature is 0.7 so that the old path's division copy is counted. Prints one JSON line: both
growths in bytes, their ratio (new / old), each growth over the logits' byte size, and the log-prob sums
(they must agree).
CPU only; Linux (/proc/self/status, clear_refs).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: common.py
import common  # noqa: E402

MODES = ("old", "new")


def _status_bytes(field: str) -> int:
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def _reset_peak_rss() -> int:
    """Reset this process's RSS high-water mark (Linux: clear_refs 5) and return the RSS now. Without the
    reset an earlier transient peak (torch's import, randn's temporaries) hides part of the growth: measured
    in CI, the old path then showed 0.75x the logits instead of 3x."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def child(mode: str, shape: tuple[int, int, int], temperature: float, chunk_tokens: int) -> dict:
    """Run one path in this process and return its peak RSS growth above the allocated logits."""
    import torch

    from async_dapo.learner.loss import token_logprobs

    gen = torch.Generator().manual_seed(0)
    targets = torch.randint(0, shape[-1], shape[:2], generator=gen)
    logits = torch.randn(shape, generator=gen).requires_grad_()  # randn writes every page: all resident
    baseline = _reset_peak_rss()
    if mode == "old":
        logprobs = torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)
    else:
        logprobs = token_logprobs(logits, targets, temperature=temperature, chunk_tokens=chunk_tokens)
    total = logprobs.sum()
    total.backward()
    growth = _status_bytes("VmHWM") - baseline
    return {"mode": mode, "growth_bytes": growth, "logprob_sum": total.item(),
            "logits_bytes": logits.numel() * logits.element_size()}


def run_child(mode: str, shape: tuple[int, int, int], temperature: float, chunk_tokens: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--shape", ",".join(map(str, shape)),
           "--temperature", str(temperature), "--chunk-tokens", str(chunk_tokens)]
    # A fixed mmap threshold gives every block >= 1 MiB its own mapping, returned to the OS when freed
    # (as a GPU caching allocator would reuse it). By default glibc raises the threshold up to 32 MiB
    # after the first free, and chunk-sized temporaries then leave resident holes in its heap that would
    # count as peak memory of the chunked path; blocks over 32 MiB (the full-size copies) are mmapped anyway.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"child {mode} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(shape: tuple[int, int, int], temperature: float = 0.7, chunk_tokens: int = 1024) -> dict:
    old, new = (run_child(mode, shape, temperature, chunk_tokens) for mode in MODES)
    size = old["logits_bytes"]
    return {"shape": list(shape), "temperature": temperature, "chunk_tokens": chunk_tokens, "logits_bytes": size,
            "old_peak_bytes": old["growth_bytes"], "new_peak_bytes": new["growth_bytes"],
            "ratio_new_over_old": new["growth_bytes"] / max(old["growth_bytes"], 1),
            "old_over_logits": old["growth_bytes"] / size, "new_over_logits": new["growth_bytes"] / size,
            "old_logprob_sum": old["logprob_sum"], "new_logprob_sum": new["logprob_sum"]}


def _shape(text: str) -> tuple[int, int, int]:
    dims = tuple(int(d) for d in text.split(","))
    if len(dims) != 3 or min(dims) <= 0:
        raise argparse.ArgumentTypeError(f"--shape must be B,T,V with positive sizes, got {text!r}")
    return dims


def main(argv: list[str] | None = None) -> None:
    parser = common.parser(__file__, __doc__)
    parser.add_argument("--shape", type=_shape, default=(4, 2048, 32768), help="B,T,V of the fp32 logits")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.shape, args.temperature, args.chunk_tokens)))
    else:
        print(json.dumps(measure(args.shape, args.temperature, args.chunk_tokens)))


if __name__ == "__main__":
    main()
