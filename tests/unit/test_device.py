"""The CPU/CUDA seam and the stand-in kernel package."""

import subprocess
import sys

import pytest

from async_dapo import device


def test_cpu_env_puts_stand_in_first_when_real_kernel_cannot_load(monkeypatch):
    monkeypatch.setattr(device, "real_sgl_kernel_loads", lambda: False)
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    env = device.sglang_process_env("cpu")
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"].split(":") == [str(device.SHIM_DIR), "/somewhere/else"]
    assert env["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "sglang_cpu_models"
    monkeypatch.setenv("SGLANG_EXTERNAL_MODEL_PACKAGE", "users_models")  # a user's own package is kept
    assert device.sglang_process_env("cpu")["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "users_models"


def test_the_cpu_path_hides_flashinfer():
    """On the stand-in path ``import flashinfer`` fails as if it were not installed, so SGLang takes its own
    fallback (the engine's start and what it registers: test_learner's fresh engine)."""
    code = "try:\n    import flashinfer\nexcept ImportError as e:\n    print('hidden:', e)\n"
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(device.SHIM_DIR)},
                         capture_output=True, text=True, timeout=60)
    hidden = "hidden: flashinfer is CUDA-only: hidden from SGLang's CPU engine by async_dapo/cpu_shim"
    assert out.stdout.strip() == hidden, out.stderr[-2000:]


def test_nothing_on_cuda_or_with_a_working_kernel(monkeypatch):
    monkeypatch.setattr(device, "real_sgl_kernel_loads", lambda: False)
    assert device.sglang_process_env("cuda") == {}
    monkeypatch.setattr(device, "real_sgl_kernel_loads", lambda: True)
    assert device.sglang_process_env("cpu") == {}


def test_backend_and_dtype_choices():
    assert device.dist_backend("cpu") == "gloo"
    assert device.dist_backend("cuda") == "nccl"
    assert device.dist_backend("cpu", "nccl") == "nccl"
    assert device.engine_dtype("cpu") == "float32"
    assert device.engine_dtype("cuda") == "bfloat16"


def test_stand_in_raises_naming_itself_and_logs(tmp_path):
    log = tmp_path / "calls.log"
    code = (
        "import sgl_kernel\n"
        "try:\n    sgl_kernel.rmsnorm_cpu(1)\nexcept NotImplementedError as e:\n    print(e)\n"
        "try:\n    import sgl_kernel.scalar_type\nexcept ImportError:\n    print('no-submodule')\n"
        "print(hasattr(sgl_kernel, '__wrapped__'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONPATH": str(device.SHIM_DIR), "ASYNC_DAPO_SGL_KERNEL_SHIM_LOG": str(log)},
    ).stdout.splitlines()
    assert out[0].startswith("sgl_kernel.rmsnorm_cpu is a CPU stand-in")
    assert out[1] == "no-submodule"  # SGLang's ImportError fallbacks must stay reachable
    assert out[2] == "False"  # dunder lookups are not answered with stand-ins
    assert log.read_text() == "sgl_kernel.rmsnorm_cpu\n"


def test_resolve_device_follows_what_torch_sees(monkeypatch):
    # Both answers of torch.cuda.is_available are forced, so every branch is checked on any machine (the
    # old version asserted only "cpu" -> "cpu" on a machine with a GPU).
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device.resolve_device("cpu") == "cpu"
    assert device.resolve_device("auto") == "cpu"
    with pytest.raises(RuntimeError, match="device 'cuda' requested but torch sees no CUDA device"):
        device.resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device.resolve_device("auto") == "cuda"
    assert device.resolve_device("cuda") == "cuda"
    assert device.resolve_device("cpu") == "cpu"  # an explicit cpu stays cpu on a GPU machine


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA: torch sees no GPU here")
def test_resolve_device_on_a_real_gpu():
    # Unpatched: on a CUDA machine 'auto' must pick the GPU, and that GPU must take a tensor.
    import torch

    assert device.resolve_device("auto") == "cuda"
    assert torch.ones(2, device=device.resolve_device("cuda")).sum().item() == 2.0


def test_engine_sleeps_when_idle_on_cpu_only_unless_configured(monkeypatch):
    # A busy-polling scheduler takes a core from the learner on a 2-core machine (docs/results/training.md).
    from async_dapo.rollout import engine
    from async_dapo.config import EngineConfig
    from async_dapo.rollout.engine import engine_kwargs

    monkeypatch.setattr(engine, "resolve_device", lambda d: d)  # no GPU here: test the choice, not the device

    assert engine_kwargs(EngineConfig(device="cpu"), "m")["sleep_on_idle"] is True
    assert engine_kwargs(EngineConfig(device="cuda"), "m")["sleep_on_idle"] is False
    assert engine_kwargs(EngineConfig(device="cpu", sleep_on_idle=False), "m")["sleep_on_idle"] is False


def test_learner_process_group_serves_cpu_and_cuda_tensors():
    assert device.learner_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert device.learner_backend("cpu") == "gloo"


def test_gpu_index_follows_ray_only_when_ray_leaves_cuda_visible_devices(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get_gpu_ids", lambda: ["6", "5"])
    monkeypatch.delenv(device.NOSET_CUDA_ENV, raising=False)
    assert device.assigned_gpu_ids() is None and device.local_gpu_index() == 0  # Ray set the variable
    monkeypatch.setenv(device.NOSET_CUDA_ENV, "1")
    assert device.assigned_gpu_ids() == [5, 6] and device.local_gpu_index() == 5


def test_engine_starts_on_its_first_assigned_gpu_when_ray_does_not_set_visibility(monkeypatch):
    from async_dapo.rollout import engine
    from async_dapo.config import load_config

    ec = load_config(None, ["rollout.engine.device=cuda", "placement.engine_gpus=1"]).rollout.engine
    monkeypatch.setattr(engine, "resolve_device", lambda requested: "cuda")
    monkeypatch.setattr(engine, "assigned_gpu_ids", lambda: [4, 5])
    assert engine.engine_kwargs(ec, "/m")["base_gpu_id"] == 4
    monkeypatch.setattr(engine, "assigned_gpu_ids", lambda: None)
    assert "base_gpu_id" not in engine.engine_kwargs(ec, "/m")


def test_a_cpu_only_driver_can_declare_gpu_actors(monkeypatch):
    """The driver (e.g. a CPU-only head node) never resolves the actors' device: declaring CUDA engines
    and learners from the 32B config must not ask this machine's torch for a GPU, and the actor classes must
    ask Ray for the config's resources."""
    import ray.actor
    import torch

    from async_dapo.config import load_config
    from async_dapo.learner.rank import learner_actor_class
    from async_dapo.rollout.actor import rollout_actor_class
    from tests.conftest import REPO

    def no_gpu_question(*_a, **_k):
        raise AssertionError("the driver asked torch about CUDA")

    for name in ("is_available", "device_count", "current_device"):
        monkeypatch.setattr(torch.cuda, name, no_gpu_question)
    asked: list[tuple[str, dict]] = []
    real_options = ray.actor.ActorClass.options

    def recording_options(self, **options):  # Ray's own options() still validates them
        asked.append((self.__ray_metadata__.class_name, options))
        return real_options(self, **options)

    monkeypatch.setattr(ray.actor.ActorClass, "options", recording_options)

    cfg = load_config(REPO / "configs" / "dapo_qwen2.5_32b_16x8.yaml")
    assert cfg.rollout.engine.device == "cuda"
    rollout_actor_class(cfg)
    learner_actor_class(cfg)
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}}
    # configs/dapo_qwen2.5_32b_16x8.yaml: engines of 8 CPUs and 4 GPUs (tp 4), learners of 8 CPUs and 1 GPU.
    assert asked == [
        ("RolloutWorker", {"num_cpus": 8, "num_gpus": 4, "max_concurrency": 8, "runtime_env": env}),
        ("LearnerWorker", {"num_cpus": 8, "num_gpus": 1, "runtime_env": env}),
    ]
