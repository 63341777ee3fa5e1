"""The planner's input: a measured hardware profile (one engine's decode and prefill costs, the learner's
step cost, the push, the contention between them, the workload's lengths and keep rate), read from YAML
and validated with one error naming the file and the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from async_dapo.config import ConfigError, read_yaml_mapping


class ProfileError(ConfigError):
    """A bad profile (or planner input): one line, ``<file>: <dotted.key>: <problem>``."""



# ------------------------------------------------------------------------------------------ the profile
class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineProfile(_Part):
    """One rollout engine's measured costs."""

    max_running_seqs: int = Field(..., ge=1, description="Sequences one engine decodes at once (batch / KV "
                                  "cap); more wait in its queue.")
    decode_base_s: float = Field(..., ge=0, description="a: fixed seconds of one decode iteration (one token "
                                 "for every running sequence).")
    decode_per_seq_s: float = Field(..., ge=0, description="b: seconds added per running sequence.")
    decode_per_ctx_token_s: float = Field(..., ge=0, description="c: seconds added per token of context held by "
                                          "the running sequences (attention reads).")
    prefill_per_token_s: float = Field(..., ge=0, description="Seconds per prompt token prefilled (one prefill "
                                       "per group: its G samples share the prompt).")
    per_group_s: float = Field(..., ge=0, description="Host seconds per finished group (score, send) during "
                               "which the engine does not decode.")
    per_sample_s: float = Field(0.0, ge=0, description="Engine seconds per finished sample beyond its decode "
                                "iterations (the request's own handling: admission, detokenization, its "
                                "output and log-probs), charged with its group's per_group_s.")
    devices: int = Field(1, ge=1, description="Accelerators one engine occupies (tensor parallel size); "
                         "recommend() splits total devices by it.")

    @model_validator(mode="after")
    def _iterations_take_time(self) -> "EngineProfile":
        if self.decode_base_s + self.decode_per_seq_s <= 0:
            raise ValueError("decode_base_s + decode_per_seq_s must be > 0: a decode iteration takes time")
        return self


class LearnerProfile(_Part):
    """The learner's measured step cost (planning.learner_model.step_seconds puts the parts together)."""

    step_base_s: float = Field(..., ge=0, description="Fixed seconds of one training step (scheduler, "
                               "metrics, the step's own calls).")
    per_token_s: float = Field(..., ge=0, description="Seconds per trained token (prompt + response) per "
                               "epoch on ONE rank: forward and backward compute.")
    scaling_efficiency: float = Field(1.0, gt=0, le=1, description="R ranks run R × this times faster on the "
                                      "token part (a summary figure; leave 1.0 when the collectives below "
                                      "are stated).")
    devices_per_rank: int = Field(1, ge=1, description="Accelerators one learner rank occupies.")
    per_micro_batch_s: float = Field(0.0, ge=0, description="Fixed seconds of one forward + backward "
                                     "micro-batch on one rank beyond its tokens (launches, hooks).")
    per_update_s: float = Field(0.0, ge=0, description="Seconds of one optimizer update (gradient clip + "
                                "AdamW) of the whole model on one rank; FSDP shards it over the ranks.")
    forward_share: float = Field(1 / 3, ge=0, le=1, description="Share of a token's compute that is its "
                                 "forward pass: the proximal log-prob pass (correction not naive, every "
                                 "mini-batch after a step's first) costs this much.")
    collective_bytes: float = Field(0.0, ge=0, description="Bytes of the model's parameters in the compute "
                                    "dtype; FSDP moves 3 × this × (R − 1)/R per rank per micro-batch "
                                    "(forward all-gather, backward all-gather, gradient reduce-scatter).")
    collective_bandwidth_bytes_per_s: float = Field(1e12, gt=0, description="Per-rank bytes per second of "
                                                    "all-gather / reduce-scatter among the learner ranks.")
    collective_latency_s: float = Field(0.0, ge=0, description="Fixed seconds of a micro-batch's collectives "
                                        "when R > 1 (one per FSDP unit, summed).")
    collective_overlap: float = Field(0.0, ge=0, le=1, description="Share of the collectives' time hidden "
                                      "under compute (FSDP's prefetch); 0 = none (gloo on shared CPU cores).")
    loop_per_step_s: float = Field(0.0, ge=0, description="Seconds per step the training loop spends outside "
                                   "the batch wait, the train call and the push call whatever the batch's size "
                                   "(collecting the metrics, writing the logs), measured in runs at two batch "
                                   "sizes; counted with the step.")
    loop_per_sample_s: float = Field(0.0, ge=0, description="Seconds per trained sample the training loop "
                                     "spends outside the batch wait, the train call and the push call (handing "
                                     "the batch over), beyond loop_per_step_s; measured in runs at two batch "
                                     "sizes; counted with the step.")


class PushProfile(_Part):
    """One weight push (learner -> every engine)."""

    base_s: float = Field(..., ge=0, description="Fixed seconds of one push at the sender (snapshot, gather, "
                          "control plane).")
    bytes: float = Field(..., ge=0, description="Bytes pushed per update.")
    bandwidth_bytes_per_s: float = Field(..., gt=0, description="Bytes per second of the broadcast.")
    engine_pause_s: float = Field(..., ge=0, description="Seconds an engine does not decode per update (the "
                                  "load); inflight mode also re-prefills the running context at "
                                  "prefill_per_token_s.")
    engine_pause_per_seq_s: float = Field(0.0, ge=0, description="Seconds added to an engine's update per "
                                          "sequence it holds when it pauses, running or waiting for room "
                                          "(inflight retracts the running ones and re-queues them; abort "
                                          "restarts them), at the engine's share of the cores then.")
    learner_stall_s: float = Field(0.0, ge=0, description="Learner seconds lost per push (before it trains on).")


class Contention(_Part):
    """Slowdowns when the roles share hardware (1.0 = separate devices). With ``cores`` set, the busy
    processes also share those cores: every decoding engine and every training learner rank runs
    ``max(1, (busy + background_cores) / cores)`` times slower, and the two slowdowns below (measured with
    one engine and one rank busy) keep only what that sharing does not explain: a factor above 1 where the
    role loses more than its even share, below 1 where it keeps more."""

    engine_slowdown: float = Field(1.0, gt=0, description="Multiplier on engine time while the learner "
                                   "computes (shared CPU cores), as measured with one engine and one rank.")
    learner_slowdown: float = Field(1.0, gt=0, description="Multiplier on learner step time while any engine "
                                    "decodes, as measured with one engine and one rank.")
    cores: float | None = Field(None, gt=0, description="CPU cores the engines, the learner ranks and the "
                                "run's other processes share, as the work they do: fewer than the machine's "
                                "CPUs where two busy processes do less than twice one's work (the calibration "
                                "fits it to two engines against one); None: each role computes on its own "
                                "devices.")
    background_cores: float = Field(0.0, ge=0, description="Cores the run's other processes keep busy (the "
                                    "driver, the replay queue, the rollout actors' host side, Ray), with cores.")

    def share(self, busy: float) -> float:
        """How many times slower each of ``busy`` compute processes runs on the shared cores (1: no sharing)."""
        return 1.0 if self.cores is None else max(1.0, (busy + self.background_cores) / self.cores)

    def interference(self, slowdown: float) -> float:
        """A measured one-engine-one-rank slowdown without the core sharing it contains (may be below 1)."""
        return slowdown if self.cores is None else slowdown / self.share(2)


class Lognormal(_Part):
    median: float = Field(..., gt=0, description="Median response length (tokens).")
    sigma: float = Field(..., ge=0, description="Standard deviation of ln(length).")
    prompt_share: float = Field(0.0, ge=0, le=1, description="Share of ln(length)'s variance that is the prompt's: "
                                "a group's samples share that part, and an aborted sample's restart keeps it (a "
                                "long prompt is long again); 0 = every sample independent.")


class PromptRecord(_Part):
    """One calibration prompt's samples: their response lengths and outcomes, in the same order."""

    lengths: list[int] = Field(..., min_length=1, description="Response lengths (tokens) of the prompt's samples.")
    correct: list[bool] = Field(..., min_length=1, description="Whether each sample was correct (the filter "
                                "metric acc).")

    @model_validator(mode="after")
    def _paired(self) -> "PromptRecord":
        if len(self.lengths) != len(self.correct):
            raise ValueError(f"lengths has {len(self.lengths)} entries, correct {len(self.correct)}: one per sample")
        if min(self.lengths) < 1:
            raise ValueError("lengths must all be >= 1")
        return self


class Workload(_Part):
    """What is generated: prompt length, response lengths, which groups dynamic sampling keeps. Either
    per-prompt records (``prompts``; keep is derived for any group size, see planning.workload) or
    population figures (``response_lengths`` or ``lognormal``, and ``keep_rate``)."""

    prompt_tokens: float = Field(..., ge=0, description="Mean prompt length (tokens).")
    prompts: list[PromptRecord] | None = Field(None, min_length=1, description="Per-prompt samples (lengths "
                                               "and outcomes) as calibration measured them; keep is derived.")
    response_lengths: list[int] | None = Field(None, min_length=1, description="An empirical sample of "
                                               "response lengths (resampled); or give lognormal or prompts.")
    lognormal: Lognormal | None = Field(None, description="Parametric response lengths; or give "
                                        "response_lengths or prompts. Lengths are capped at "
                                        "rollout.max_response_length.")
    keep_rate: float | None = Field(None, gt=0, le=1, description="Fraction of finished groups dynamic sampling "
                                    "keeps (mixed outcome), with response_lengths or lognormal; derived from "
                                    "prompts otherwise.")
    accuracy_by_version: list[float] | None = Field(None, min_length=1, description="Mean per-sample accuracy "
                                                    "at policy version 0, 1, ... (keep's drift during "
                                                    "training; the last value holds after the list), with "
                                                    "prompts. None: the recorded accuracies throughout.")

    @model_validator(mode="after")
    def _one_length_model(self) -> "Workload":
        given = [k for k in ("prompts", "response_lengths", "lognormal") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompts, response_lengths and lognormal (got {given or 'none'})")
        if self.response_lengths is not None and min(self.response_lengths) < 1:
            raise ValueError("response_lengths must all be >= 1")
        if self.prompts is not None and self.keep_rate is not None:
            raise ValueError("keep_rate is derived from prompts: give one or the other")
        if self.prompts is None and self.keep_rate is None:
            raise ValueError("keep_rate is required with response_lengths or lognormal")
        if self.accuracy_by_version is not None:
            if self.prompts is None:
                raise ValueError("accuracy_by_version needs prompts (it shifts each prompt's accuracy)")
            if not all(0 < a < 1 for a in self.accuracy_by_version):
                raise ValueError("accuracy_by_version values must be in (0, 1)")
        return self

    def all_lengths(self) -> list[int]:
        """Every response length the workload states (records or the empirical sample); [] for lognormal."""
        if self.prompts is not None:
            return [L for r in self.prompts for L in r.lengths]
        return list(self.response_lengths or [])


class Profile(_Part):
    """A measured hardware + workload profile (YAML; see docs/planning.md)."""

    name: str = Field(..., description="Short name of the profile.")
    hardware: str = Field(..., description="Free text: the machines the figures were measured on.")
    sources: dict[str, str] = Field(default_factory=dict, description="figure name -> citation or how it "
                                    "was measured.")
    engine: EngineProfile
    learner: LearnerProfile
    push: PushProfile
    contention: Contention = Field(default_factory=Contention)
    workload: Workload



def _profile_error(where: str, exc: ValidationError) -> ProfileError:
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"])
    msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return ProfileError(f"{where}: {key}: {msg}{more}" if key else f"{where}: {msg}{more}")


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile YAML; ProfileError naming the file and the field on any fault."""
    return profile_from_dict(read_yaml_mapping(path, "profile", ProfileError), str(path))


def profile_from_dict(tree: dict[str, Any], where: str = "profile") -> Profile:
    try:
        return Profile.model_validate(tree)
    except ValidationError as exc:
        raise _profile_error(where, exc) from None

