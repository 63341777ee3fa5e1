"""Wire format of the rollout -> replay-queue group stream: typed, versioned, msgpack, never pickle.

One message carries one finished prompt **group** (G samples of one prompt), or the **progress** of a
group still in flight (:class:`Partial`: each sample's tokens, log-probs and versions so far), which the
queue keeps so that another engine can finish the group if this one leaves. This module holds the
schemas and the codec only; sockets live in ``async_dapo.stream.transport``.

Layout (schema ``async_dapo.group``, version 1): a msgpack map whose first keys are ``"schema"`` and
``"v"``, then exactly the fields of :class:`Group`; ``"samples"`` is an array of maps holding exactly
the fields of :class:`Sample`. Every array is a map ``{"dtype": "<i4" | "<f4", "shape": [n],
"data": <bin: raw little-endian bytes>}``; each field declares one dtype and arrays are 1-D.

Decoding treats the bytes as hostile: the size is checked before unpacking; msgpack runs with
``raw=False, strict_map_key=True``, no ext types and explicit length limits (so a header that
declares a 4-billion-element array fails at once instead of allocating); the schema name and
version, the exact key set of every map (duplicates included), every type, dtype, shape and byte
length are checked; then the same invariants the constructors enforce (below) are applied. Any
fault raises :class:`WireError` (or a subclass) with a one-line message that starts with the
dotted path of the field, e.g. ``samples.2.logprobs: length 5 != response length 6``.

A partial group (schema ``async_dapo.partial``, version 1) has the same layout: the schema keys, then
exactly the fields of :class:`Partial`, its ``"samples"`` maps holding exactly the fields of
:class:`Progress`. :func:`decode_message` reads either kind; :func:`decode_group` only groups.

Invariants of :class:`Sample` / :class:`Group` (checked on construction, so also on decode):
  - token ids and versions are int32 and >= 0; ``logprobs`` is float32, finite and <= 1e-4
    (``LOGPROB_TOLERANCE``: a log-softmax is <= 0 in exact arithmetic, but a bf16/fp32 engine can
    round the top token's logprob to a tiny positive number; such values are kept as they are,
    not clamped);
  - ``response_ids``, ``logprobs`` and ``versions`` of a sample have the same length (0 allowed);
  - a group has at least one sample and a non-empty prompt; counters/versions are ints >= 0;
    rewards, scores and times are finite floats.
The token arrays of :class:`Progress` obey the same rules; a partial has at least one sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

__all__ = [
    "LOGPROB_TOLERANCE",
    "SCHEMA",
    "SCHEMA_VERSION",
    "PARTIAL_SCHEMA",
    "Group",
    "OversizedMessage",
    "Partial",
    "Progress",
    "Sample",
    "SchemaMismatch",
    "WireError",
    "decode_group",
    "decode_message",
    "encode_group",
    "encode_message",
    "encode_partial",
]

SCHEMA = "async_dapo.group"
SCHEMA_VERSION = 1
PARTIAL_SCHEMA = "async_dapo.partial"  # same version rules as groups (SCHEMA_VERSION)
# Largest logprob accepted (see module docstring): rounding noise, not a modelling choice.
LOGPROB_TOLERANCE = 1e-4

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_I32_MAX = int(np.iinfo(np.int32).max)
_ARRAY_KEYS = frozenset({"dtype", "shape", "data"})
_REPR_LIMIT = 60  # error messages quote at most this much of an offending value


class WireError(ValueError):
    """A message (or a value bound for one) violates the schema; the text names the field."""


class SchemaMismatch(WireError):
    """The message is well-formed msgpack but of a foreign schema or an unsupported version."""


class OversizedMessage(WireError):
    """The message is larger than the receiver's ``max_bytes``; it was not unpacked."""


# ------------------------------------------------------------------------------ value coercion
def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


def _key_name(key: Any) -> str:
    # Keys are quoted bare, like the field paths; a hostile key is cut, a non-str one repr'd.
    return key[:_REPR_LIMIT] if isinstance(key, str) and key.isprintable() else _short(key)


def _type_name(value: Any) -> str:
    return type(value).__name__


def _as_int(name: str, value: Any) -> int:
    # bool is an int subclass; a flag in an int field is a producer bug, not a 0/1 count.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise WireError(f"{name}: expected int, got {_type_name(value)}")
    value = int(value)
    if value < 0:
        raise WireError(f"{name}: must be >= 0, got {value}")
    return value


def _as_float(name: str, value: Any, *, nonneg: bool = False) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise WireError(f"{name}: expected float, got {_type_name(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise WireError(f"{name}: must be finite, got {value}")
    if nonneg and value < 0:
        raise WireError(f"{name}: must be >= 0, got {value}")
    return value


def _as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise WireError(f"{name}: expected bool, got {_type_name(value)}")
    return bool(value)


def _as_str(name: str, value: Any, *, nonempty: bool = False) -> str:
    if not isinstance(value, str):
        raise WireError(f"{name}: expected str, got {_type_name(value)}")
    if nonempty and not value:
        raise WireError(f"{name}: must not be empty")
    return str(value)


def _as_1d(name: str, value: Any, dtype: np.dtype) -> np.ndarray:
    """Return ``value`` as a C-contiguous 1-D array of ``dtype``, refusing lossy casts.

    Already-correct arrays are returned as they are (no copy), which keeps decoding cheap.
    """
    if (
        isinstance(value, np.ndarray)
        and value.dtype == dtype
        and value.ndim == 1
        and value.flags.c_contiguous
    ):
        return value
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise WireError(f"{name}: expected a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=dtype)
    if dtype.kind == "i":
        if arr.dtype.kind not in "iu":
            raise WireError(f"{name}: expected integers, got dtype {arr.dtype}")
        # Range-check before the cast: astype would silently wrap 2**31 to -2**31.
        if int(arr.max()) > _I32_MAX or int(arr.min()) < -_I32_MAX - 1:
            raise WireError(f"{name}: values do not fit int32")
    elif arr.dtype.kind not in "fiu":
        raise WireError(f"{name}: expected floats, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=dtype)


def _check_nonneg(name: str, arr: np.ndarray) -> None:
    if arr.size and int(arr.min()) < 0:
        raise WireError(f"{name}: must be >= 0, got {int(arr.min())}")


def _check_logprobs(name: str, arr: np.ndarray) -> None:
    if not arr.size:
        return
    # Two reductions cover everything: min is nan/-inf if any value is; max catches +inf and > tol.
    low, high = float(arr.min()), float(arr.max())
    if not (math.isfinite(low) and math.isfinite(high)):
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise WireError(f"{name}: non-finite value {float(arr[bad])} at token {bad}")
    if high > LOGPROB_TOLERANCE:
        raise WireError(f"{name}: logprob {high} > 0 (tolerance {LOGPROB_TOLERANCE})")


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # frozen dataclass: normalise once in __post_init__


def _arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))


def _set_token_arrays(obj: Any) -> None:
    """Normalise and check ``obj``'s token-aligned arrays (response_ids, logprobs, versions) and set its
    version range: the rules a sample and a sample in progress share."""
    ids = _as_1d("response_ids", obj.response_ids, _I32)
    logprobs = _as_1d("logprobs", obj.logprobs, _F32)
    versions = _as_1d("versions", obj.versions, _I32)
    for name, arr in (("logprobs", logprobs), ("versions", versions)):
        if arr.shape[0] != ids.shape[0]:
            raise WireError(f"{name}: length {arr.shape[0]} != response length {ids.shape[0]}")
    _check_nonneg("response_ids", ids)
    _check_logprobs("logprobs", logprobs)
    if versions.size:
        vmin, vmax = int(versions.min()), int(versions.max())
        if vmin < 0:
            raise WireError(f"versions: must be >= 0, got {vmin}")
        _set(obj, "_min_version", vmin)
        _set(obj, "_max_version", vmax)
    _set(obj, "response_ids", ids)
    _set(obj, "logprobs", logprobs)
    _set(obj, "versions", versions)


# ------------------------------------------------------------------------------------ schema
class _Message:
    """Equality of the message dataclasses: field by field, arrays by dtype, shape and value."""

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(_field_equal(getattr(self, f.name), getattr(other, f.name)) for f in fields(self) if f.init)


@dataclass(frozen=True, eq=False)
class Sample(_Message):
    """One generated response of a group, token-aligned.

    Arrays are normalised on construction (lists and other integer/float dtypes are accepted if
    the cast is lossless for ints) but NOT copied when already of the right dtype: do not mutate
    an array after handing it over. Decoded samples hold read-only views of the message bytes.
    """

    response_ids: np.ndarray  # int32 [L] generated token ids
    logprobs: np.ndarray  # float32 [L] behaviour-policy logprob of each generated token
    versions: np.ndarray  # int32 [L] policy version that produced each token
    reward: float  # shaped reward: score + overlong penalty
    score: float  # raw correctness score (+1 / -1)
    acc: bool  # answer judged correct (what dynamic sampling filters on with its default metric, acc)
    truncated: bool  # hit max_response_length
    finish_reason: str
    gen_seconds: float  # wall time from request to completion
    _min_version: int | None = field(init=False, repr=False, default=None)
    _max_version: int | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        _set_token_arrays(self)
        _set(self, "reward", _as_float("reward", self.reward))
        _set(self, "score", _as_float("score", self.score))
        _set(self, "acc", _as_bool("acc", self.acc))
        _set(self, "truncated", _as_bool("truncated", self.truncated))
        _set(self, "finish_reason", _as_str("finish_reason", self.finish_reason))
        _set(self, "gen_seconds", _as_float("gen_seconds", self.gen_seconds, nonneg=True))

    @property
    def num_tokens(self) -> int:
        return int(self.response_ids.shape[0])



@dataclass(frozen=True, eq=False)
class Group(_Message):
    """All G samples of one prompt, as one rollout actor emits them and the replay queue stores them."""

    group_id: str
    prompt_index: int  # position in the dataset
    epoch: int  # dataset epoch the prompt was drawn in
    engine_rank: int  # which rollout actor produced it
    prompt_ids: np.ndarray  # int32 [P]
    ground_truth: str
    data_source: str
    samples: tuple[Sample, ...]
    created_at: float  # time.time() when the last sample finished
    admitted_version: int  # learner version when the prompt was admitted

    def __post_init__(self) -> None:
        _set(self, "group_id", _as_str("group_id", self.group_id, nonempty=True))
        for name in ("prompt_index", "epoch", "engine_rank", "admitted_version"):
            _set(self, name, _as_int(name, getattr(self, name)))
        prompt = _as_1d("prompt_ids", self.prompt_ids, _I32)
        if not prompt.size:
            raise WireError("prompt_ids: must not be empty")
        _check_nonneg("prompt_ids", prompt)
        _set(self, "prompt_ids", prompt)
        _set(self, "ground_truth", _as_str("ground_truth", self.ground_truth))
        _set(self, "data_source", _as_str("data_source", self.data_source))
        _set(self, "created_at", _as_float("created_at", self.created_at, nonneg=True))
        _set(self, "samples", _as_members("samples", self.samples, Sample, "a group"))

    @property
    def min_version(self) -> int:
        """Oldest policy version of any token; an empty response counts as ``admitted_version``."""
        return min(
            s._min_version if s._min_version is not None else self.admitted_version for s in self.samples
        )

    @property
    def max_version(self) -> int:
        """Newest policy version of any token; an empty response counts as ``admitted_version``."""
        return max(
            s._max_version if s._max_version is not None else self.admitted_version for s in self.samples
        )

    @property
    def num_tokens(self) -> int:
        """Generated tokens over all samples (prompt not included)."""
        return sum(s.num_tokens for s in self.samples)

    @property
    def accuracies(self) -> tuple[bool, ...]:
        return tuple(s.acc for s in self.samples)

    @property
    def scores(self) -> tuple[float, ...]:
        """Per-sample reward-function scores (dynamic-sampling metric ``score``)."""
        return tuple(s.score for s in self.samples)

    @property
    def rewards(self) -> tuple[float, ...]:
        """Per-sample shaped rewards, score + overlong penalty (metrics ``seq_reward``, ``seq_final_reward``)."""
        return tuple(s.reward for s in self.samples)



@dataclass(frozen=True, eq=False)
class Progress(_Message):
    """One sample of a group in flight, as far as its engine got: the tokens so far with the behaviour
    log-probs and policy versions they were sampled with. ``finish_reason`` is "" while the sample still
    runs; a finished sample (its reason set) is complete and only needs scoring."""

    response_ids: np.ndarray  # int32 [L]
    logprobs: np.ndarray  # float32 [L]
    versions: np.ndarray  # int32 [L]
    finish_reason: str
    gen_seconds: float  # engine wall time spent on it so far
    _min_version: int | None = field(init=False, repr=False, default=None)
    _max_version: int | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        _set_token_arrays(self)
        _set(self, "finish_reason", _as_str("finish_reason", self.finish_reason))
        _set(self, "gen_seconds", _as_float("gen_seconds", self.gen_seconds, nonneg=True))

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    @property
    def num_tokens(self) -> int:
        return int(self.response_ids.shape[0])



@dataclass(frozen=True, eq=False)
class Partial(_Message):
    """The progress of one admitted prompt's group (its ticket ``group_id``), sample by sample in the
    group's order, as its engine last reported it."""

    group_id: str
    prompt_index: int
    epoch: int
    engine_rank: int
    samples: tuple[Progress, ...]
    sent_at: float  # time.time() of the snapshot

    def __post_init__(self) -> None:
        _set(self, "group_id", _as_str("group_id", self.group_id, nonempty=True))
        for name in ("prompt_index", "epoch", "engine_rank"):
            _set(self, name, _as_int(name, getattr(self, name)))
        _set(self, "sent_at", _as_float("sent_at", self.sent_at, nonneg=True))
        _set(self, "samples", _as_members("samples", self.samples, Progress, "a partial group"))

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    @property
    def min_version(self) -> int | None:
        """Oldest policy version of any token so far (None: no token yet)."""
        return min((s._min_version for s in self.samples if s._min_version is not None), default=None)



def _as_members(name: str, value: Any, kind: type, whole: str) -> tuple:
    """``value`` as a non-empty tuple of ``kind`` (the samples of a ``whole``)."""
    if not isinstance(value, (tuple, list)):
        raise WireError(f"{name}: expected a sequence of {kind.__name__}, got {_type_name(value)}")
    members = tuple(value)
    if not members:
        raise WireError(f"{name}: {whole} needs at least one sample")
    for i, member in enumerate(members):
        if not isinstance(member, kind):
            raise WireError(f"{name}.{i}: expected {kind.__name__}, got {_type_name(member)}")
    return members


def _field_equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and _arrays_equal(a, b)
    return type(a) is type(b) and a == b


_SAMPLE_FIELDS = tuple(f.name for f in fields(Sample) if f.init)
_GROUP_FIELDS = tuple(f.name for f in fields(Group) if f.init)
_SAMPLE_ARRAYS = {"response_ids": _I32, "logprobs": _F32, "versions": _I32}
_GROUP_ARRAYS = {"prompt_ids": _I32}
_GROUP_KEYS = frozenset(("schema", "v") + _GROUP_FIELDS)
_SAMPLE_KEYS = frozenset(_SAMPLE_FIELDS)
_PROGRESS_FIELDS = tuple(f.name for f in fields(Progress) if f.init)
_PARTIAL_FIELDS = tuple(f.name for f in fields(Partial) if f.init)
_PARTIAL_KEYS = frozenset(("schema", "v") + _PARTIAL_FIELDS)
_PROGRESS_KEYS = frozenset(_PROGRESS_FIELDS)


# ------------------------------------------------------------------------------------- encode
def _pack_array(arr: np.ndarray, dtype: np.dtype) -> dict[str, Any]:
    # The constructors guarantee a contiguous 1-D array of ``dtype``; astype is a no-op on
    # little-endian hosts, and memoryview lets msgpack copy the bytes once, into its own buffer.
    arr = arr.astype(dtype, copy=False)
    return {"dtype": dtype.str, "shape": [int(arr.shape[0])], "data": memoryview(arr).cast("B")}


def _sample_to_map(sample: Sample | Progress, names: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        value = getattr(sample, name)
        out[name] = _pack_array(value, _SAMPLE_ARRAYS[name]) if name in _SAMPLE_ARRAYS else value
    return out


def _encode(obj: Group | Partial, schema: str, names: tuple[str, ...], sample_names: tuple[str, ...]) -> bytes:
    out: dict[str, Any] = {"schema": schema, "v": SCHEMA_VERSION}
    for name in names:
        value = getattr(obj, name)
        if name == "samples":
            out[name] = [_sample_to_map(s, sample_names) for s in value]
        elif name in _GROUP_ARRAYS:
            out[name] = _pack_array(value, _GROUP_ARRAYS[name])
        else:
            out[name] = value
    return msgpack.packb(out, use_bin_type=True)


def encode_group(group: Group) -> bytes:
    """Serialise ``group`` (already validated by its constructor) to schema-v1 msgpack bytes."""
    if not isinstance(group, Group):
        raise TypeError(f"encode_group expects a Group, got {_type_name(group)}")
    return _encode(group, SCHEMA, _GROUP_FIELDS, _SAMPLE_FIELDS)


def encode_partial(partial: Partial) -> bytes:
    """Serialise ``partial`` (already validated by its constructor) to msgpack bytes of PARTIAL_SCHEMA."""
    if not isinstance(partial, Partial):
        raise TypeError(f"encode_partial expects a Partial, got {_type_name(partial)}")
    return _encode(partial, PARTIAL_SCHEMA, _PARTIAL_FIELDS, _PROGRESS_FIELDS)


def encode_message(message: Group | Partial) -> bytes:
    """A group or a partial group, each in its own schema."""
    return encode_partial(message) if isinstance(message, Partial) else encode_group(message)


# ------------------------------------------------------------------------------------- decode
def _pairs_to_dict(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    # A plain dict would let a repeated key silently overwrite the first one (e.g. two "schema"s).
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[Any] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise WireError(f"{_key_name(dup)}: duplicate key in a map")
    return out


def _unpack(data: bytes | bytearray | memoryview) -> Any:
    n = len(data)
    try:
        # Every msgpack element takes >= 1 byte (a map entry >= 2), so no honest length can exceed
        # these limits; they turn a "bomb" header into an immediate error instead of an allocation.
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            object_pairs_hook=_pairs_to_dict,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n // 2,
            max_ext_len=0,
        )
    except WireError:
        raise
    except Exception as exc:  # any parser failure on hostile bytes is "not msgpack"
        text = str(exc).splitlines()[0] if str(exc) else ""
        raise WireError(f"message: not valid msgpack ({type(exc).__name__}: {text[:120]})") from None


def _expect_map(path: str, obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise WireError(f"{path}: expected a map, got {_type_name(obj)}")
    return obj


def _check_keys(path: str, obj: dict[Any, Any], expected: frozenset[str]) -> None:
    missing = expected.difference(obj)
    if missing:
        raise WireError(f"{path}{min(missing)}: missing key")
    if len(obj) != len(expected):
        extra = sorted((k for k in obj if k not in expected), key=str)[0]
        raise WireError(f"{path}{_key_name(extra)}: unknown key")


def _check_schema(obj: dict[Any, Any], accepted: tuple[str, ...] = (SCHEMA,)) -> str:
    """The message's schema name (one of ``accepted``), its version checked."""
    if "schema" not in obj:
        raise WireError("schema: missing key")
    if obj["schema"] not in accepted:
        expected = " or ".join(repr(a) for a in accepted)
        raise SchemaMismatch(f"schema: foreign schema {_short(obj['schema'])} (expected {expected})")
    if "v" not in obj:
        raise WireError("v: missing key")
    version = obj["v"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise WireError(f"v: expected int, got {_type_name(version)}")
    if version > SCHEMA_VERSION:
        raise SchemaMismatch(f"v: schema version {version} is newer than supported {SCHEMA_VERSION}")
    if version != SCHEMA_VERSION:
        raise SchemaMismatch(f"v: schema version {version} is not supported (expected {SCHEMA_VERSION})")
    return obj["schema"]


def _decode_array(path: str, obj: Any, dtype: np.dtype) -> np.ndarray:
    obj = _expect_map(path, obj)
    _check_keys(path + ".", obj, _ARRAY_KEYS)
    if obj["dtype"] != dtype.str:
        raise WireError(f"{path}.dtype: {_short(obj['dtype'])} not allowed (expected {dtype.str!r})")
    shape = obj["shape"]
    if (
        not isinstance(shape, list)
        or len(shape) != 1
        or isinstance(shape[0], bool)
        or not isinstance(shape[0], int)
        or shape[0] < 0
    ):
        raise WireError(f"{path}.shape: expected [n] with n >= 0, got {_short(shape)}")
    data = obj["data"]
    if not isinstance(data, bytes):
        raise WireError(f"{path}.data: expected bin bytes, got {_type_name(data)}")
    if shape[0] * dtype.itemsize != len(data):
        raise WireError(
            f"{path}.data: {len(data)} bytes != shape {shape[0]} x itemsize {dtype.itemsize}"
        )
    return np.frombuffer(data, dtype=dtype)


def _decode_sample(index: int, obj: Any, kind: type = Sample) -> Sample | Progress:
    path = f"samples.{index}"
    names, keys = (_SAMPLE_FIELDS, _SAMPLE_KEYS) if kind is Sample else (_PROGRESS_FIELDS, _PROGRESS_KEYS)
    obj = _expect_map(path, obj)
    _check_keys(path + ".", obj, keys)
    kwargs = {name: obj[name] for name in names}
    for name, dtype in _SAMPLE_ARRAYS.items():
        kwargs[name] = _decode_array(f"{path}.{name}", obj[name], dtype)
    try:
        return kind(**kwargs)
    except WireError as exc:
        raise type(exc)(f"{path}.{exc}") from None


def _decode_samples(obj: dict[str, Any], kind: type, whole: str) -> tuple:
    raw_samples = obj["samples"]
    if not isinstance(raw_samples, list):
        raise WireError(f"samples: expected an array, got {_type_name(raw_samples)}")
    if not raw_samples:
        raise WireError(f"samples: {whole} needs at least one sample")
    return tuple(_decode_sample(i, s, kind) for i, s in enumerate(raw_samples))


def _message_map(data: bytes | bytearray | memoryview, max_bytes: int | None) -> dict[str, Any]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"message: expected bytes, got {_type_name(data)}")
    if isinstance(data, memoryview) and (data.ndim != 1 or data.itemsize != 1):
        data = data.cast("B")
    if max_bytes is not None and len(data) > max_bytes:
        raise OversizedMessage(f"message: {len(data)} bytes > max_message_bytes {max_bytes}")
    return _expect_map("message", _unpack(data))


def _group_of(obj: dict[str, Any]) -> Group:
    _check_keys("", obj, _GROUP_KEYS)
    kwargs = {name: obj[name] for name in _GROUP_FIELDS}
    kwargs["samples"] = _decode_samples(obj, Sample, "a group")
    kwargs["prompt_ids"] = _decode_array("prompt_ids", obj["prompt_ids"], _I32)
    return Group(**kwargs)


def _partial_of(obj: dict[str, Any]) -> Partial:
    _check_keys("", obj, _PARTIAL_KEYS)
    kwargs = {name: obj[name] for name in _PARTIAL_FIELDS}
    kwargs["samples"] = _decode_samples(obj, Progress, "a partial group")
    return Partial(**kwargs)


def decode_group(data: bytes | bytearray | memoryview, max_bytes: int | None = None) -> Group:
    """Parse and fully validate one group message; raise :class:`WireError` on any fault.

    ``max_bytes`` (if given) is checked before anything is unpacked (:class:`OversizedMessage`).
    A foreign schema (a partial group included) or unsupported version raises :class:`SchemaMismatch`.
    The arrays of the returned group are read-only ``np.frombuffer`` views (no copy beyond msgpack's own).
    """
    obj = _message_map(data, max_bytes)
    _check_schema(obj)
    return _group_of(obj)


def decode_message(data: bytes | bytearray | memoryview, max_bytes: int | None = None) -> Group | Partial:
    """As :func:`decode_group`, for a group or a partial group (told apart by their schema name)."""
    obj = _message_map(data, max_bytes)
    if _check_schema(obj, (SCHEMA, PARTIAL_SCHEMA)) == PARTIAL_SCHEMA:
        return _partial_of(obj)
    return _group_of(obj)


def write_groups(groups: list[Group], path: Path) -> None:
    """A batch of groups as one file (a msgpack array of encoded groups): logging.record_batches."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgpack.packb([encode_group(g) for g in groups]))


def read_groups(path: Path) -> list[Group]:
    """The groups :func:`write_groups` wrote, each decoded and checked like a message off the wire."""
    return [decode_group(b) for b in msgpack.unpackb(path.read_bytes())]
