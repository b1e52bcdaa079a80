"""Build vLLM configs and models on a machine without a GPU (tests only).

vLLM 0.20.2 imports on a CPU machine but refuses to infer a device. Pretending the platform is CUDA
(without touching any CUDA API) is enough to build a real ``VllmConfig`` for a checkpoint, construct the
model on the CPU and run its weight loader, which is what the CPU tests check. Call ``use_fake_cuda()``
first thing in a fresh process; nothing here ever runs a kernel.
"""

from __future__ import annotations

FLASH_ATTN_BACKEND = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"


def use_fake_cuda() -> None:
    import vllm.platforms as platforms
    from vllm.platforms.interface import UnspecifiedPlatform

    class FakeCudaPlatform(UnspecifiedPlatform):
        device_type = "cuda"

        @classmethod
        def current_device(cls):
            return "cpu"

        def is_cpu(self) -> bool:  # CPU MoE method: built, never run
            return True

        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            return FLASH_ATTN_BACKEND

    platforms._current_platform = FakeCudaPlatform()


def engine_config(model: str, **kwargs):
    """A real VllmConfig (runs every config check, ours included)."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs.setdefault("max_model_len", 4096)
    return EngineArgs(model=model, **kwargs).create_engine_config()


def build_model(vllm_config, port: int = 29555, rank: int = 0, pcp_ranks: int = 1):
    """Construct the configured model class on the CPU (gloo). ``pcp_ranks`` > 1: this process is
    ``rank`` of a real PCP group of that many processes (each calls this with the same port)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import get_model_architecture

    model_cls, _ = get_model_architecture(vllm_config.model_config)
    with set_current_vllm_config(vllm_config), torch.device("cpu"):
        init_distributed_environment(pcp_ranks, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
        initialize_model_parallel(1, 1, prefill_context_model_parallel_size=pcp_ranks, backend="gloo")
        return model_cls(vllm_config=vllm_config, prefix="")
