"""Start-up checks that run where vLLM is installed: a memory share vLLM cannot fit is refused."""

from __future__ import annotations

from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.planning.startup_checks import vllm_startup_errors


def test_a_memory_share_vllm_cannot_fit_is_refused():
    overrides = ["rollout.engine=vllm", "model.hf_path=/x", "rollout.vllm.gpu_memory_utilization=0.01"]
    cfg = load_config("demo_cpu", overrides)
    [msg] = vllm_startup_errors(cfg, device_memory_bytes=100 * 2**20)  # 1 MiB share; the model needs ~3.6 MiB
    assert msg.startswith("rollout.vllm.gpu_memory_utilization: 0.01 x 0.1 GiB") and "cannot hold" in msg
    assert vllm_startup_errors(cfg, device_memory_bytes=2**40) == []
