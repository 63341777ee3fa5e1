"""tools/bench/logprob_memory.py: the chunked ``token_logprobs`` needs a fraction of the old path's peak
memory. Only ratios measured within one run are asserted (no absolute thresholds: the machine is shared)."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "bench"))
import logprob_memory  # noqa: E402


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux only)")
def test_chunked_logprobs_peak_memory_is_a_fraction_of_the_full_vocabulary_path():
    # 256 MiB of fp32 logits (V = 32768); chunks of 128 positions are 16 MiB of fp32 each.
    result = logprob_memory.measure((2, 1024, 32768), temperature=0.7, chunk_tokens=128)
    # Old: the division copy, the log_softmax output, and the backward's full-size gradients (~3x the
    # logits). If it does not show at least two full copies, the measurement itself is broken.
    assert result["old_over_logits"] > 2.0, result
    assert result["ratio_new_over_old"] < 0.5, result
    # New: the gradient (one logits-sized buffer, unavoidable) plus chunk-sized temporaries. Below
    # 2x the logits means it never holds a full fp32 copy besides the gradient.
    assert result["new_over_logits"] < 2.0, result
    assert result["new_logprob_sum"] == pytest.approx(result["old_logprob_sum"], rel=1e-5)
