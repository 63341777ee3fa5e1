"""Rollout actor on real SGLang (CPU) + real Ray + real zmq + a real gloo weight broadcast.

One actor serves every test in this module (an engine start costs 25-60 s here). The test process plays
the learner: it owns rank 0 of the weight-update group and broadcasts tensors while the actor loads them.
"""

import time

import pytest
import torch

from async_dapo.data.rows import encode_prompt
from async_dapo.config import load_config
from async_dapo.data.rows import train_rows
from async_dapo.weights.sync import broadcast_bucket, free_port, open_update_group, plan_buckets
from tests.conftest import CPU_CONFIG

pytestmark = pytest.mark.integration
# fp32 SGLang vs transformers logprobs on 300-token samples of randomly perturbed weights. Measured on the
# tiny model: typically 1e-8..1e-5 per token, max 2.2e-5 over 3,600 tokens without a push; after a push
# single tokens reached 2.3e-4 (CI, 2026-11-30) and 1.9e-3 (CI, 2026-12-02, one token of 300 while the
# rest stayed under 2.4e-5): kernel accumulation order on a rare token. So one token may differ by up to
# TOL, and the mean over a segment must stay near the typical error. The old and new weights of these
# tests differ by a max of 12-16 per sample and by nats on average, so both bounds still tell them apart
# by three orders of magnitude or more.
TOL = 1e-2
MEAN_TOL = 1e-4
GROUP = "weights"


@pytest.fixture(scope="module")
def cfg(tiny_model):
    return load_config(CPU_CONFIG, [
        f"model.path={tiny_model}", "rollout.n=4", "algorithm.train_batch_groups=4",
        "learner.mini_batch_groups=4", "replay.max_staleness=1", "rollout.max_inflight_prompts=8",
        "rollout.engine.context_length=512", "logging.val_timeout_s=3",
        # with progress reports (switched on by the test that uses them), each streamed sample's tokens are
        # handed over every 4
        "rollout.partial_every_tokens=4",
    ])


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def system(cfg, ray_cluster):
    from async_dapo.replay.queue import replay_actor_class
    from async_dapo.rollout.actor import rollout_actor_class
    from tests.probes import ProbedRolloutWorker

    ray = ray_cluster
    queue = replay_actor_class(cfg).remote(cfg)
    actor = rollout_actor_class(cfg, ProbedRolloutWorker).remote(cfg, 0)
    ray.get(actor.get_stats.remote(), timeout=300)  # engine is up: a failed start surfaces here
    port = free_port()
    joined = actor.join_weight_group.remote("127.0.0.1", port, 2, 1, GROUP, "gloo")
    pg = open_update_group("127.0.0.1", port, 2, GROUP, "gloo", timeout_s=120)
    ray.get(joined)
    yield queue, actor, pg
    ray.get(actor.shutdown.remote())
    ray.get(queue.close.remote())


def _hf_logprobs(state, model_path, prompt, output):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def test_actor_streams_groups_into_queue(system, cfg):
    import ray

    queue, actor, _ = system
    address = ray.get(queue.address.remote(), timeout=60)
    served = ray.get(actor.get_stats.remote(), timeout=60)["version"]  # 0 unless a push test ran first
    ray.get(actor.start.remote(queue, address, ray.get(queue.producer_secret.remote(), timeout=60)), timeout=120)
    batch = ray.get(queue.get_batch.remote(None, 600), timeout=660)["batch"]
    assert batch is not None and len(batch) == 4
    for g in batch:
        assert len(g.samples) == 4
        accs = [s.acc for s in g.samples]
        assert 0 < sum(accs) < 4  # dynamic sampling: only mixed groups reach the learner
        for s in g.samples:
            assert len(s.response_ids) == len(s.logprobs) == len(s.versions) >= 1
            assert set(s.versions.tolist()) == {served}
            assert s.score == (1.0 if s.acc else -1.0)
            assert s.reward <= s.score  # the overlong penalty only subtracts
            assert (s.logprobs <= 0).all()
    stats = ray.get(queue.stats.remote())
    assert stats["accepted"] >= 4
    assert stats["received"] == stats["accepted"] + stats["dropped_all_correct"] + stats["dropped_all_wrong"] \
        + stats["dropped_uniform"] + stats["dropped_stale"]
    assert stats["dropped_all_correct"] + stats["dropped_all_wrong"] > 0  # level mix makes uniform groups
    # Admission bound (AReaL): the actor never admits past (eta + version + 1) * B prompts.
    stats = ray.get(queue.stats.remote())
    assert stats["in_window"] + stats["running"] <= (1 + 0 + 1) * 4


def _new_weights(model_path, seed):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    named = [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=gen)) for n, p in model.named_parameters()]
    return named


def _push(actor, pg, named, version, mode):
    import ray

    # Small buckets, so a push is several flat broadcasts (the learner's path).
    buckets = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in named], bucket_bytes=256 * 1024)
    assert len(buckets) > 1
    ref = actor.update_weights.remote(buckets, GROUP, version, mode)
    by_name = dict(named)
    for b in buckets:
        broadcast_bucket(pg, [by_name[n] for n in b.names])
    return ray.get(ref, timeout=300)


def _assert_close(ref, got):
    diff = (ref - got).abs()
    assert diff.max().item() < TOL and diff.mean().item() < MEAN_TOL, (diff.max().item(), diff.mean().item())


# Each case owns its versions and first loads its own "old" weights with nothing running, so it passes
# alone and in any order (the engine does not require versions to increase).
@pytest.mark.parametrize("mode, version, keep", [("inflight", 2, False), ("drain", 4, False), ("abort", 6, False),
                                                 ("abort", 8, True)],
                         ids=["inflight", "drain", "abort", "abort-partial_rollout"])
def test_weight_push_changes_outputs_with_exact_versions(system, cfg, tiny_model, mode, version, keep):
    """Abort with rollout.partial_rollout: each aborted sample is continued from its tokens on the new weights,
    so, as in flight, its first tokens are the old weights' and the rest the new ones', log-probs included."""
    import ray

    _, actor, pg = system
    ray.get(actor.set_rollout.remote(partial_rollout=keep), timeout=60)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompts = [encode_prompt(tok, r) for r in train_rows(cfg)[:3]]
    old_named = _new_weights(tiny_model, version - 1)
    _push(actor, pg, old_named, version - 1, "drain")
    old_state = dict(old_named)
    named = _new_weights(tiny_model, version)
    # Long requests are running when the update arrives, so each mode's handling of them is exercised.
    params = {"temperature": 1.0, "max_new_tokens": 300, "ignore_eos": True}
    running = actor.generate.remote(prompts, params)
    deadline = time.time() + 60
    while ray.get(actor.num_running_requests.remote()) < len(prompts) and time.time() < deadline:
        time.sleep(0.05)
    assert ray.get(actor.num_running_requests.remote()) >= len(prompts)
    # A one-token probe submitted after them finishes only once the scheduler (FCFS) has prefilled the
    # long requests, and a prefill emits each request's first token: so every long request has at least
    # one token from the old weights when the update arrives.
    ray.get(actor.generate.remote(prompts[:1], {"max_new_tokens": 1}), timeout=120)
    try:
        seconds = _push(actor, pg, named, version, mode)
        outs = ray.get(running, timeout=600)
    finally:
        ray.get(actor.set_rollout.remote(partial_rollout=False), timeout=60)
    if mode == "abort":  # SGLang's pause_generation(abort) re-checked every 1 s: a second per update at least
        assert seconds < 1.0, seconds

    new_state = dict(named)
    for prompt, out in zip(prompts, outs):
        ids = out["output_ids"]
        lps = torch.tensor([lp for lp, *_ in out["meta_info"]["output_token_logprobs"]])
        spans = out["meta_info"].get("weight_versions") or []
        versions = (out["_versions"].tolist() if keep else  # the kept tokens' versions, then the continuation's
                    [int(s["version"]) if s["version"].isdigit() else 0 for s in spans for _ in range(s["end"] - s["start"])])
        assert len(versions) == len(ids) == len(lps) == 300
        switch = versions.index(version) if version in versions else len(ids)
        if mode == "inflight" or keep:  # started on the old weights, finished on the new ones
            assert 0 < switch < len(ids) and set(versions[switch:]) == {version}
            assert set(versions[:switch]) == {version - 1}
        elif mode == "drain":  # finished entirely on the old weights before the update
            assert switch == len(ids)
        else:  # aborted and resampled entirely on the new weights
            assert switch == 0
        if switch < len(ids):
            new_ref = _hf_logprobs(new_state, tiny_model, prompt, ids)
            _assert_close(new_ref[switch:], lps[switch:])
        if switch > 0:
            _assert_close(_hf_logprobs(old_state, tiny_model, prompt, ids)[:switch], lps[:switch])
    # After the update every new sample is on the new version and matches the new weights.
    fresh = ray.get(actor.generate.remote(prompts[:1], {"temperature": 1.0, "max_new_tokens": 8}), timeout=120)[0]
    assert {s["version"] for s in fresh["meta_info"]["weight_versions"]} == {str(version)}
    ref = _hf_logprobs(new_state, tiny_model, prompts[0], fresh["output_ids"])
    _assert_close(ref, torch.tensor([lp for lp, *_ in fresh["meta_info"]["output_token_logprobs"]]))


def test_a_progress_report_holds_the_engines_tokens_and_another_engine_continues_them(system, cfg, tiny_model):
    """A group in flight, read as a progress report reads it: each report extends the one before, token for
    token. An in-flight push lands meanwhile: with progress reports on it aborts the running requests and each
    sample goes on from its tokens as a new request on the new weights (SGLang tells an unfinished request's
    versions only when it finishes), so the reports follow it across the push with exact per-token versions. The engine then gives the group up (as when it leaves the fleet) and each sample is continued
    from the last report, as the engine that takes the prompt does: the finished samples hold the report's
    tokens with their log-probs and versions, then the current weights' tokens, and every log-prob matches a
    transformers recompute of the whole sequence at the version it records. One version later (η = 1 here) the
    same report is too old: its tokens are thrown away and counted, and the samples start afresh."""
    import ray

    _, actor, pg = system
    from transformers import AutoTokenizer

    prompt = encode_prompt(AutoTokenizer.from_pretrained(tiny_model), train_rows(cfg)[0])
    states = {v: _new_weights(tiny_model, v) for v in (10, 11, 12)}
    _push(actor, pg, states[10], 10, "drain")
    params = {"temperature": 1.0, "max_new_tokens": 300, "ignore_eos": True}
    ray.get(actor.set_rollout.remote(partial_every_s=0.5), timeout=60)
    try:
        ray.get(actor.start_tracked.remote(prompt, params, 3), timeout=60)
        reports = [_report_once(actor, lambda r: min(s.num_tokens for s in r.samples) >= 8)]
        _push(actor, pg, states[11], 11, "inflight")
        reports.append(_report_once(actor, lambda r: min(s.num_tokens for s in r.samples)
                                    >= max(s.num_tokens for s in reports[0].samples) + 8))
        ray.get(actor.drop_tracked.remote(), timeout=60)
    finally:
        ray.get(actor.set_rollout.remote(partial_every_s=0.0), timeout=60)
    last = reports[-1]
    for a, b in zip(reports[0].samples, last.samples):  # a report is a prefix of every later one
        k = a.num_tokens
        assert b.response_ids[:k].tolist() == a.response_ids.tolist() and b.versions[:k].tolist() == a.versions.tolist()
        assert b.logprobs[:k].tobytes() == a.logprobs.tobytes()
    for p in last.samples:
        assert not p.finished and 0 < p.num_tokens < 300 and set(p.versions.tolist()) == {10, 11}
    before = ray.get(actor.carried_tokens.remote(), timeout=60)
    outs = ray.get(actor.carry_on.remote(prompt, params, last), timeout=600)
    assert _since(ray.get(actor.carried_tokens.remote(), timeout=60), before) == (last.num_tokens, 0)
    for p, out in zip(last.samples, outs):
        ids, versions = out["output_ids"], out["_versions"].tolist()
        lps = torch.tensor([lp for lp, *_ in out["meta_info"]["output_token_logprobs"]])
        assert len(ids) == len(versions) == len(lps) == 300
        assert ids[:p.num_tokens] == p.response_ids.tolist() and versions[:p.num_tokens] == p.versions.tolist()
        assert set(versions[p.num_tokens:]) == {11}
        for v in (10, 11):
            at = [i for i, x in enumerate(versions) if x == v]
            assert at and at == list(range(at[0], at[-1] + 1)), (v, versions)  # one contiguous segment each
            _assert_close(_hf_logprobs(dict(states[v]), tiny_model, prompt, ids)[at], lps[at])
    _push(actor, pg, states[12], 12, "drain")  # the report's oldest tokens are now 2 versions old: past η = 1
    before = ray.get(actor.carried_tokens.remote(), timeout=60)
    outs = ray.get(actor.carry_on.remote(prompt, {**params, "max_new_tokens": 8}, last), timeout=600)
    assert _since(ray.get(actor.carried_tokens.remote(), timeout=60), before) == (0, last.num_tokens)
    assert all(len(o["output_ids"]) == 8 and "_versions" not in o for o in outs)  # drawn afresh, at version 12


def _since(after: tuple, before: tuple) -> tuple:
    return tuple(a - b for a, b in zip(after, before))


def _report_once(actor, done, timeout_s: float = 120.0):
    """Snapshots of the tracked group until ``done(report)``; the last one."""
    import ray

    deadline = time.time() + timeout_s
    while not done(report := ray.get(actor.snapshot.remote(), timeout=60)):
        assert time.time() < deadline, [s.num_tokens for s in report.samples]
        time.sleep(0.02)
    return report


def test_a_timed_out_validation_leaves_the_engine_idle(system, cfg):
    """RolloutWorker._call: a validation past logging.val_timeout_s (3 s here; this one needs minutes) is
    cancelled on the engine loop and its SGLang requests aborted: right after the TimeoutError the engine
    runs nothing (before, it went on generating behind the caller's back)."""
    import ray

    _, actor, _ = system
    deadline = time.time() + 120  # the producer of the first test may still finish its last admitted groups
    while ray.get(actor.num_running_requests.remote(), timeout=60) and time.time() < deadline:
        time.sleep(0.2)
    rows = train_rows(cfg)[:64]
    params = {"max_new_tokens": 400, "temperature": 1.0, "ignore_eos": True}
    t0 = time.time()
    with pytest.raises(ray.exceptions.RayTaskError, match=r"validation \(logging.val_timeout_s\): no result in 3 s"):
        ray.get(actor.validate.remote(rows, 16, params), timeout=120)
    assert time.time() - t0 < 30
    assert ray.get(actor.num_running_requests.remote(), timeout=60) == 0
    # and the actor serves again at once: a short request is answered well within its bound
    out = ray.get(actor.validate.remote(rows[:2], 2, {"max_new_tokens": 4, "temperature": 1.0}), timeout=60)
    assert len(out["scores"]) == 2
