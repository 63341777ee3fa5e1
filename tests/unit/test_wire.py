"""Tests for async_dapo.stream.wire: exact round trips and one named rejection per kind of malformation.

Malformed messages are built by unpacking a valid encoding into plain msgpack objects, breaking
one thing, and repacking, so each test differs from a valid message in exactly one place.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from async_dapo.stream.wire import (
    LOGPROB_TOLERANCE,
    PARTIAL_SCHEMA,
    SCHEMA,
    SCHEMA_VERSION,
    Group,
    OversizedMessage,
    Partial,
    Progress,
    Sample,
    SchemaMismatch,
    WireError,
    decode_group,
    decode_message,
    encode_group,
    encode_message,
    encode_partial,
)

I32_MAX = 2**31 - 1


def make_sample(ids, versions=None, logprobs=None, **kw: Any) -> Sample:
    n = len(ids)
    fields = dict(
        response_ids=ids if isinstance(ids, np.ndarray) else np.asarray(ids, dtype=np.int32),
        logprobs=np.asarray(logprobs if logprobs is not None else -0.25 * np.arange(1, n + 1), np.float32),
        versions=np.asarray(versions if versions is not None else [0] * n, dtype=np.int32),
        reward=1.0,
        score=1.0,
        acc=True,
        truncated=False,
        finish_reason="stop",
        gen_seconds=0.5,
    )
    fields.update(kw)
    return Sample(**fields)


def make_group(samples=None, **kw: Any) -> Group:
    fields = dict(
        group_id="e0-p7-abc",
        prompt_index=7,
        epoch=2,
        engine_rank=1,
        prompt_ids=np.array([11, 12, 13], dtype=np.int32),
        ground_truth="42",
        data_source="arith",
        samples=samples
        if samples is not None
        else (
            make_sample([5, 6, 7], versions=[3, 3, 4]),
            make_sample([8, 9, 10, 11, 12, 13], versions=[4, 4, 5, 5, 5, 6], acc=False,
                        score=-1.0, reward=-1.5, truncated=True, finish_reason="length"),
            make_sample([], acc=False, score=-1.0, reward=-1.0, finish_reason="abort", gen_seconds=0.0),
        ),
        created_at=1_700_000_000.123456,
        admitted_version=3,
    )
    fields.update(kw)
    return Group(**fields)


def raw(group: Group) -> dict[str, Any]:
    """The plain msgpack objects of a valid encoding, ready to be broken."""
    return msgpack.unpackb(encode_group(group), raw=False)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def reject(data: bytes, match: str, kind: type[WireError] = WireError, **kw: Any) -> WireError:
    with pytest.raises(kind, match=match) as info:
        decode_group(data, **kw)
    message = str(info.value)
    assert "\n" not in message and len(message) < 300, message
    return info.value


# --------------------------------------------------------------------------------- round trip
def test_round_trip_every_field_and_array():
    group = make_group()
    back = decode_group(encode_group(group))
    assert back == group
    for name in ("group_id", "prompt_index", "epoch", "engine_rank", "ground_truth", "data_source",
                 "created_at", "admitted_version"):
        assert getattr(back, name) == getattr(group, name)
        assert type(getattr(back, name)) is type(getattr(group, name))
    assert back.created_at == 1_700_000_000.123456  # float64 on the wire, not float32
    assert back.prompt_ids.tolist() == [11, 12, 13] and back.prompt_ids.dtype == np.int32
    assert len(back.samples) == 3
    s0, s1, s2 = back.samples
    assert s0.response_ids.tolist() == [5, 6, 7]
    assert s0.versions.tolist() == [3, 3, 4]
    assert s0.logprobs.tolist() == [-0.25, -0.5, -0.75]
    assert s1.versions.tolist() == [4, 4, 5, 5, 5, 6]
    assert (s1.acc, s1.score, s1.reward, s1.truncated, s1.finish_reason) == (False, -1.0, -1.5, True, "length")
    assert s2.num_tokens == 0 and s2.response_ids.dtype == np.int32 and s2.logprobs.dtype == np.float32
    assert (s2.finish_reason, s2.gen_seconds) == ("abort", 0.0)
    # Derived values: the empty sample counts as admitted_version (3), tokens span 3..6.
    assert (back.min_version, back.max_version) == (3, 6)
    assert back.num_tokens == 9
    assert back.accuracies == (True, False, False)


def test_int32_boundaries_and_float32_logprobs_are_exact():
    lp = np.array([-3.4028235e38, -1.4e-45, 0.0, LOGPROB_TOLERANCE], dtype=np.float32)
    sample = make_sample([0, I32_MAX, 1, I32_MAX - 1], versions=[0, I32_MAX, 7, 7], logprobs=lp)
    group = make_group(samples=(sample,), prompt_ids=[I32_MAX, 0], prompt_index=2**40,
                       admitted_version=2**62)
    back = decode_group(encode_group(group))
    assert back.samples[0].response_ids.tolist() == [0, I32_MAX, 1, I32_MAX - 1]
    assert back.samples[0].versions.tolist() == [0, I32_MAX, 7, 7]
    assert back.samples[0].logprobs.tobytes() == lp.tobytes()
    assert back.prompt_ids.tolist() == [I32_MAX, 0]
    assert (back.prompt_index, back.admitted_version) == (2**40, 2**62)
    assert (back.min_version, back.max_version) == (0, I32_MAX)


def test_version_range_uses_admitted_version_only_for_empty_responses():
    group = make_group(samples=(make_sample([1, 2], versions=[8, 9]), make_sample([])), admitted_version=7)
    assert (group.min_version, group.max_version) == (7, 9)
    group = make_group(samples=(make_sample([1, 2], versions=[8, 9]),), admitted_version=7)
    assert (group.min_version, group.max_version) == (8, 9)
    group = make_group(samples=(make_sample([]),), admitted_version=5)
    assert (group.min_version, group.max_version, group.num_tokens) == (5, 5, 0)


def test_decoded_arrays_are_read_only_views():
    back = decode_group(encode_group(make_group()))
    assert not back.samples[0].logprobs.flags.writeable
    with pytest.raises(ValueError):
        back.prompt_ids[0] = 1


def test_layout_schema_first_and_arrays_as_little_endian_bytes():
    obj = raw(make_group())
    assert list(obj)[:2] == ["schema", "v"]
    assert (obj["schema"], obj["v"]) == (SCHEMA, SCHEMA_VERSION) == ("async_dapo.group", 1)
    ids = obj["samples"][0]["response_ids"]
    assert ids == {"dtype": "<i4", "shape": [3], "data": b"\x05\x00\x00\x00\x06\x00\x00\x00\x07\x00\x00\x00"}
    assert obj["samples"][0]["logprobs"]["dtype"] == "<f4"
    assert obj["samples"][0]["logprobs"]["data"] == np.array([-0.25, -0.5, -0.75], "<f4").tobytes()


def test_constructor_normalises_inputs_and_refuses_lossy_ones():
    sample = make_sample([1, 2], logprobs=[-0.5, -1.0])
    group = make_group(samples=[sample], prompt_index=np.int64(3), prompt_ids=[1, 2])
    assert isinstance(group.samples, tuple) and type(group.prompt_index) is int
    assert group.prompt_ids.dtype == np.int32
    with pytest.raises(WireError, match=r"^response_ids: values do not fit int32$"):
        make_sample(np.array([2**31], dtype=np.int64))
    with pytest.raises(WireError, match=r"^response_ids: expected integers, got dtype float64$"):
        make_sample(np.array([1.5]))
    with pytest.raises(WireError, match=r"^prompt_ids: must not be empty$"):
        make_group(prompt_ids=[])
    with pytest.raises(WireError, match=r"^prompt_index: expected int, got bool$"):
        make_group(prompt_index=True)
    with pytest.raises(WireError, match=r"^samples: a group needs at least one sample$"):
        make_group(samples=())
    with pytest.raises(WireError, match=r"^group_id: must not be empty$"):
        make_group(group_id="")
    with pytest.raises(WireError, match=r"^gen_seconds: must be >= 0, got -1.0$"):
        make_sample([1], gen_seconds=-1.0)
    with pytest.raises(TypeError):
        encode_group({"schema": SCHEMA})  # type: ignore[arg-type]


def test_logprob_tolerance_boundary():
    assert make_sample([1], logprobs=[5e-5]).logprobs[0] == np.float32(5e-5)  # kept, not clamped
    with pytest.raises(WireError, match=r"^logprobs: logprob 0.000199.* > 0 \(tolerance 0.0001\)$"):
        make_sample([1], logprobs=[2e-4])


# ------------------------------------------------------------------------------ malformations
def _set_sample(i: int, key: str, value: Any):
    def edit(obj):
        obj["samples"][i][key] = value
    return edit


def _set_array(path: tuple, key: str, value: Any):
    def edit(obj):
        node = obj
        for p in path:
            node = node[p]
        node[key] = value
    return edit


def _drop(key: str):
    return lambda obj: obj.pop(key)


def _truncate_logprobs(obj):
    arr = obj["samples"][1]["logprobs"]
    arr["shape"], arr["data"] = [5], arr["data"][:20]


def case(name: str, edit, match: str, kind: type[WireError] = WireError):
    return pytest.param(edit, match, kind, id=name)


def _foreign(o):
    o["schema"] = "prime_rl.batch"


CASES = [
    case("foreign schema", _foreign,
         r"^schema: foreign schema 'prime_rl.batch' \(expected 'async_dapo.group'\)$", SchemaMismatch),
    case("schema not a str", lambda o: o.update(schema=5), r"^schema: foreign schema 5", SchemaMismatch),
    case("newer version", lambda o: o.update(v=2), r"^v: schema version 2 is newer than supported 1$",
         SchemaMismatch),
    case("older version", lambda o: o.update(v=0), r"^v: schema version 0 is not supported", SchemaMismatch),
    case("version not int", lambda o: o.update(v="1"), r"^v: expected int, got str$"),
    case("missing schema", _drop("schema"), r"^schema: missing key$"),
    case("missing key", _drop("epoch"), r"^epoch: missing key$"),
    case("extra key", lambda o: o.update(bonus=1), r"^bonus: unknown key$"),
    case("missing sample key", lambda o: o["samples"][1].pop("reward"), r"^samples\.1\.reward: missing key$"),
    case("extra sample key", _set_sample(0, "ref_logprobs", 1), r"^samples\.0\.ref_logprobs: unknown key$"),
    case("wrong dtype f8", _set_array(("samples", 0, "logprobs"), "dtype", "<f8"),
         r"^samples\.0\.logprobs\.dtype: '<f8' not allowed \(expected '<f4'\)$"),
    case("wrong dtype i8", _set_array(("prompt_ids",), "dtype", "<i8"),
         r"^prompt_ids\.dtype: '<i8' not allowed \(expected '<i4'\)$"),
    case("big-endian dtype", _set_array(("samples", 0, "versions"), "dtype", ">i4"),
         r"^samples\.0\.versions\.dtype: '>i4' not allowed"),
    case("data length mismatch", _set_array(("samples", 0, "response_ids"), "shape", [4]),
         r"^samples\.0\.response_ids\.data: 12 bytes != shape 4 x itemsize 4$"),
    case("2-d shape", _set_array(("samples", 0, "response_ids"), "shape", [1, 3]),
         r"^samples\.0\.response_ids\.shape: expected \[n\]"),
    case("data not bin", _set_array(("prompt_ids",), "data", "abc"),
         r"^prompt_ids\.data: expected bin bytes, got str$"),
    case("array as list", lambda o: o.update(prompt_ids=[1, 2, 3]), r"^prompt_ids: expected a map, got list$"),
    case("array extra key", _set_array(("prompt_ids",), "order", "C"), r"^prompt_ids\.order: unknown key$"),
    case("mismatched sample lengths", _truncate_logprobs,
         r"^samples\.1\.logprobs: length 5 != response length 6$"),
    case("wrong scalar type", _set_sample(0, "reward", "1.0"), r"^samples\.0\.reward: expected float, got str$"),
    case("int for bool", _set_sample(2, "acc", 1), r"^samples\.2\.acc: expected bool, got int$"),
    case("negative prompt index", lambda o: o.update(prompt_index=-1), r"^prompt_index: must be >= 0, got -1$"),
    case("no samples", lambda o: o.update(samples=[]), r"^samples: a group needs at least one sample$"),
    case("samples not array", lambda o: o.update(samples={}), r"^samples: expected an array, got dict$"),
    case("sample not map", lambda o: o["samples"].__setitem__(0, 3), r"^samples\.0: expected a map, got int$"),
    case("unprintable key", lambda o: o.update({"a\nb": 1}), r"^'a\\nb': unknown key$"),
]


@pytest.mark.parametrize("edit,match,kind", CASES)
def test_malformed_field_is_rejected_with_its_name(edit, match, kind):
    obj = raw(make_group())
    edit(obj)
    reject(pack(obj), match, kind)


@pytest.mark.parametrize("bad,match", [
    (float("nan"), r"non-finite value nan at token 1$"),
    (float("inf"), r"non-finite value inf at token 1$"),
    (float("-inf"), r"non-finite value -inf at token 1$"),
    (0.5, r"logprob 0.5 > 0"),
])
def test_bad_logprob_is_rejected(bad, match):
    obj = raw(make_group())
    lp = np.array([-0.1, bad, -0.2], dtype="<f4")
    obj["samples"][0]["logprobs"]["data"] = lp.tobytes()
    reject(pack(obj), r"^samples\.0\.logprobs: " + match)


def test_negative_token_id_and_version_rejected():
    obj = raw(make_group())
    obj["samples"][0]["versions"]["data"] = np.array([3, -1, 4], "<i4").tobytes()
    reject(pack(obj), r"^samples\.0\.versions: must be >= 0, got -1$")
    obj = raw(make_group())
    obj["prompt_ids"]["data"] = np.array([1, -5, 3], "<i4").tobytes()
    reject(pack(obj), r"^prompt_ids: must be >= 0, got -5$")


def test_duplicate_key_rejected():
    packer = msgpack.Packer(use_bin_type=True)
    obj = raw(make_group())
    pairs = list(obj.items()) + [("schema", SCHEMA)]
    reject(packer.pack_map_pairs(pairs), r"^schema: duplicate key in a map$")


@pytest.mark.parametrize("data", [b"", b"\xc1", b"hello world", b"\x81\xa1a", b"\x93\x01"])
def test_not_msgpack(data):
    reject(data, r"^message: not valid msgpack \(")


def test_top_level_must_be_a_map():
    reject(pack([SCHEMA, 1]), r"^message: expected a map, got list$")
    reject(pack(5), r"^message: expected a map, got int$")


def test_not_bytes():
    reject("a string", r"^message: expected bytes, got str$")  # type: ignore[arg-type]


def test_truncated_bytes():
    data = encode_group(make_group())
    for cut in (1, 2, 10, len(data) // 2, len(data) - 1):
        reject(data[:cut], r"^message: not valid msgpack \(")


def test_trailing_bytes():
    reject(encode_group(make_group()) + b"\x00", r"^message: not valid msgpack \(ExtraData")


def test_oversized_is_rejected_before_unpacking():
    data = encode_group(make_group())
    assert decode_group(data, max_bytes=len(data)) == make_group()
    reject(data, rf"^message: {len(data)} bytes > max_message_bytes {len(data) - 1}$", OversizedMessage,
           max_bytes=len(data) - 1)
    # Garbage that is too large is still "oversized", proving nothing was parsed.
    reject(b"\xc1" * 2000, r"^message: 2000 bytes > max_message_bytes 1024$", OversizedMessage, max_bytes=1024)


@pytest.mark.parametrize("bomb", [
    b"\xdd\xff\xff\xff\xff",  # array32 declaring 4e9 elements
    b"\xdf\xff\xff\xff\xff",  # map32 declaring 4e9 pairs
    b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
    b"\xdb\xff\xff\xff\xff",  # str32 of 4 GiB
    b"\xc9\xff\xff\xff\xff\x01",  # ext32 of 4 GiB
    b"\x91" * 100_000,  # 100k nested arrays
])
def test_msgpack_bomb_fails_fast(bomb):
    start = time.perf_counter()
    reject(bomb, r"^message: not valid msgpack \(")
    assert time.perf_counter() - start < 0.5


def test_ext_types_are_refused():
    obj = raw(make_group())
    obj["ground_truth"] = msgpack.ExtType(1, b"x")
    reject(pack(obj), r"^message: not valid msgpack \(")
    obj["ground_truth"] = msgpack.Timestamp(1, 0)
    reject(pack(obj), r"^message: not valid msgpack \(")


def test_non_string_map_key_refused():
    reject(pack({1: SCHEMA}), r"^message: not valid msgpack \(")


# --------------------------------------------------------------------------------- properties
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_random_bytes_raise_only_wire_error(data):
    try:
        decode_group(data)
    except WireError:
        pass


_VALID = encode_group(make_group())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), min_size=1, max_size=4))
def test_mutated_valid_message_decodes_or_raises_wire_error(edits):
    _mutated_decodes_or_raises_wire_error(_VALID, edits, decode_group, encode_group)


def _mutated_decodes_or_raises_wire_error(valid: bytes, edits, decode, encode) -> None:
    data = bytearray(valid)
    for pos, byte in edits:
        data[pos] = byte
    try:
        message = decode(bytes(data))
    except WireError:
        return
    assert decode(encode(message)) == message  # anything accepted is a valid message


_i32 = st.integers(0, I32_MAX)
_finite = st.floats(allow_nan=False, allow_infinity=False)


def _token_arrays(draw) -> dict[str, np.ndarray]:
    """response_ids, logprobs and versions of one random sample (0-20 tokens)."""
    n = draw(st.integers(0, 20))
    return dict(
        response_ids=np.array(draw(st.lists(_i32, min_size=n, max_size=n)), dtype=np.int32),
        # Bounds exactly representable in float32; 2**-14 < LOGPROB_TOLERANCE.
        logprobs=np.array(draw(st.lists(st.floats(-(2.0**100), 2.0**-14, width=32), min_size=n, max_size=n)),
                          dtype=np.float32),
        versions=np.array(draw(st.lists(_i32, min_size=n, max_size=n)), dtype=np.int32))


@st.composite
def samples(draw) -> Sample:
    return Sample(
        **_token_arrays(draw),
        reward=draw(_finite), score=draw(_finite), acc=draw(st.booleans()), truncated=draw(st.booleans()),
        finish_reason=draw(st.text(max_size=10)), gen_seconds=draw(st.floats(0, 1e9)),
    )


@st.composite
def groups(draw) -> Group:
    return Group(
        group_id=draw(st.text(min_size=1, max_size=20)),
        prompt_index=draw(st.integers(0, 2**63 - 1)),
        epoch=draw(st.integers(0, 1000)),
        engine_rank=draw(st.integers(0, 64)),
        prompt_ids=np.array(draw(st.lists(_i32, min_size=1, max_size=20)), dtype=np.int32),
        ground_truth=draw(st.text(max_size=20)),
        data_source=draw(st.text(max_size=10)),
        samples=tuple(draw(st.lists(samples(), min_size=1, max_size=4))),
        created_at=draw(st.floats(0, 1e12)),
        admitted_version=draw(st.integers(0, 2**31)),
    )


@settings(max_examples=150, deadline=None)
@given(groups())
def test_random_valid_groups_round_trip(group):
    back = decode_group(encode_group(group))
    assert back == group
    for a, b in zip(back.samples, group.samples):
        assert a.logprobs.tobytes() == b.logprobs.tobytes()  # bit-exact, including -0.0
    assert (back.min_version, back.max_version, back.num_tokens, back.accuracies) == (
        group.min_version, group.max_version, group.num_tokens, group.accuracies)


# ------------------------------------------------------------------------- partial groups
def make_partial(**kw: Any) -> Partial:
    fields = dict(
        group_id="e0-p7-abc", prompt_index=7, epoch=2, engine_rank=1, sent_at=1_700_000_000.5,
        samples=(Progress(np.array([5, 6, 7], np.int32), np.array([-0.5, -0.25, 0.0], np.float32),
                          np.array([3, 3, 4], np.int32), "stop", 0.75),
                 Progress(np.array([8, 9], np.int32), np.array([-1.0, -2.0], np.float32),
                          np.array([4, 5], np.int32), "", 0.5),
                 Progress(np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.int32), "", 0.0)),
    )
    fields.update(kw)
    return Partial(**fields)


def test_partial_round_trips_and_reports_its_progress():
    partial = make_partial()
    data = encode_partial(partial)
    assert encode_message(partial) == data
    back = decode_message(data)
    assert isinstance(back, Partial) and back == partial
    assert msgpack.unpackb(data, raw=False)["schema"] == PARTIAL_SCHEMA
    # 3 + 2 + 0 tokens; the oldest token is version 3; the first sample finished, the others still run
    assert (back.num_tokens, back.min_version) == (5, 3)
    assert [s.finished for s in back.samples] == [True, False, False]
    assert back.samples[1].logprobs.tolist() == [-1.0, -2.0] and back.samples[1].versions.tolist() == [4, 5]
    empty = make_partial(samples=(make_partial().samples[2],))
    assert decode_message(encode_partial(empty)).min_version is None  # no token yet


def test_decode_message_tells_groups_from_partials_and_decode_group_refuses_a_partial():
    group = make_group()
    assert decode_message(encode_group(group)) == group and encode_message(group) == encode_group(group)
    with pytest.raises(SchemaMismatch, match=r"^schema: foreign schema 'async_dapo.partial'"):
        decode_group(encode_partial(make_partial()))
    other = raw(group) | {"schema": "someone.else"}
    with pytest.raises(SchemaMismatch, match=r"expected 'async_dapo.group' or 'async_dapo.partial'"):
        decode_message(pack(other))


def _raw_partial() -> dict[str, Any]:
    return msgpack.unpackb(encode_partial(make_partial()), raw=False)


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.pop("sent_at"), r"^sent_at: missing key$"),
    (lambda m: m.update(extra=1), r"^extra: unknown key$"),
    (lambda m: m.update(samples=[]), r"^samples: a partial group needs at least one sample$"),
    (lambda m: m["samples"][1].pop("finish_reason"), r"^samples\.1\.finish_reason: missing key$"),
    (lambda m: m["samples"][1].update(reward=1.0), r"^samples\.1\.reward: unknown key$"),  # a Sample's field
    (lambda m: m["samples"][0]["versions"].update(shape=[2], data=b"\0" * 8),
     r"^samples\.0\.versions: length 2 != response length 3$"),
    (lambda m: m["samples"][0].update(gen_seconds=-1.0), r"^samples\.0\.gen_seconds: must be >= 0"),
    (lambda m: m.update(engine_rank=-1), r"^engine_rank: must be >= 0"),
    (lambda m: m.update(group_id=""), r"^group_id: must not be empty$"),
    (lambda m: m.update(v=2), r"^v: schema version 2 is newer"),
])
def test_malformed_partial_is_rejected_with_its_field(edit, match):
    obj = _raw_partial()
    edit(obj)
    with pytest.raises(WireError, match=match):
        decode_message(pack(obj))


def test_partial_constructor_refuses_samples_of_a_group():
    with pytest.raises(WireError, match=r"^samples\.0: expected Progress, got Sample$"):
        make_partial(samples=(make_sample([1]),))
    with pytest.raises(WireError, match=r"^logprobs: logprob 0\.5 > 0"):
        Progress(np.array([1], np.int32), np.array([0.5], np.float32), np.array([0], np.int32), "", 0.0)


@st.composite
def partials(draw) -> Partial:
    def progress():
        return Progress(**_token_arrays(draw), finish_reason=draw(st.sampled_from(["", "stop", "length"])),
                        gen_seconds=draw(st.floats(0, 1e9)))

    return Partial(group_id=draw(st.text(min_size=1, max_size=20)), prompt_index=draw(st.integers(0, 2**63 - 1)),
                   epoch=draw(st.integers(0, 1000)), engine_rank=draw(st.integers(0, 64)),
                   samples=tuple(progress() for _ in range(draw(st.integers(1, 4)))),
                   sent_at=draw(st.floats(0, 1e12)))


@settings(max_examples=150, deadline=None)
@given(partials())
def test_random_valid_partials_round_trip(partial):
    back = decode_message(encode_partial(partial))
    assert back == partial and back.num_tokens == partial.num_tokens and back.min_version == partial.min_version
    for a, b in zip(back.samples, partial.samples):
        assert a.logprobs.tobytes() == b.logprobs.tobytes()


_VALID_PARTIAL = encode_partial(make_partial())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_VALID_PARTIAL) - 1), st.integers(0, 255)), min_size=1, max_size=4))
def test_mutated_partial_decodes_or_raises_wire_error(edits):
    _mutated_decodes_or_raises_wire_error(_VALID_PARTIAL, edits, decode_message, encode_message)  # either kind


@given(st.binary(max_size=256))
def test_random_bytes_raise_only_wire_error_from_decode_message(data):
    try:
        decode_message(data)
    except WireError:
        pass
