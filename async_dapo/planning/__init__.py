"""The planner: a discrete-event model of the pipeline (engines -> replay queue -> learner -> weight push), to
predict a run's throughput, idle ratios and staleness from a measured hardware profile before renting a
cluster, and to search the rollout/train split, η, the push interval and the update mode.

Pure Python + numpy (no torch, Ray or SGLang): a 60-step plan runs in about a second. docs/planning.md states
the model, what it captures and what it ignores; the summary:

* E engines, each a continuous batcher. One decode iteration advances every running sequence by one token
  and takes ``a + b·n + c·K`` seconds (n running sequences, K their context tokens), times
  ``contention.engine_slowdown`` while the learner computes. Between events n is constant and K grows by n
  per iteration, so a whole segment up to the next finish is one closed-form jump.
* Admission is replay.py's rule, ``in_window + running < (η + v + 1)·B`` with v the version the engines have
  loaded (the queue's version, advanced when EVERY engine loaded a push), at most
  ``rollout.max_inflight_prompts`` groups in flight per engine, pulled by the engine with the most room.
* A finished group costs ``per_group_s + G·per_sample_s`` of engine time, then arrives: stale
  (v − min_version > η) or filtered (kept with probability ``keep_rate``) groups give their slot back; kept
  ones queue FIFO.
* The learner takes the B oldest queued groups (dropping those stale at its own version), trains (plus the
  loop's own ``loop_per_step_s + loop_per_sample_s·B·G``), version += 1, and every k steps pushes: it waits
  for the previous push, loses ``learner_stall_s``, the sender takes ``base_s + bytes/bandwidth``, then each
  engine applies the update by ``rollout.update_mode``.

The package in the order a plan is made: :mod:`.profile` (the measured input), :mod:`.shape` (the run
and the figures), :mod:`.engine_model` and :mod:`.learner_model` (the two halves of :mod:`.simulator`),
:mod:`.search` (the split and schedule search), :mod:`.validate` (predictions against a benchmark table).
"""

from async_dapo.planning.profile import (
    Contention, EngineProfile, LearnerProfile, Profile, ProfileError, PushProfile, Workload, load_profile,
    profile_from_dict,
)
from async_dapo.planning.search import Recommendation, recommend, splits_for
from async_dapo.planning.shape import UPDATE_MODES, Prediction, Shape
from async_dapo.planning.simulator import predict, predicted_step_s
from async_dapo.planning.validate import COMPARED, TOLERANCE, bench_row_shape, markdown, validate

__all__ = [
    "Contention", "EngineProfile", "LearnerProfile", "Prediction", "Profile", "ProfileError", "PushProfile",
    "Recommendation", "Shape", "TOLERANCE", "COMPARED", "UPDATE_MODES", "Workload", "bench_row_shape", "load_profile", "markdown", "predict",
    "predicted_step_s", "profile_from_dict", "recommend", "splits_for", "validate",
]

