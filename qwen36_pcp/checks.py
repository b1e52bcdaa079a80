"""Startup checks: what PCP for Qwen3.6 does not support is rejected when the engine's config is built,
with one message that names every problem (``validate_pcp_config``, run from the model's config hook in
``runner_hooks.install_startup_checks``). They read the config only; nothing here patches vLLM.
"""

from __future__ import annotations

import logging

from .config import ARCHITECTURE, pcp_config_of, uses_pcp


def validate_pcp_config(vllm_config) -> None:
    """Reject, at startup and with one clear message, what PCP for Qwen3.6 does not support."""
    if not uses_pcp(vllm_config):
        return
    pc = vllm_config.parallel_config
    problems = []
    try:
        pcp_config_of(vllm_config)
    except ValueError as e:
        problems.append(str(e))
    if pc.decode_context_parallel_size > 1:
        problems.append("decode context parallel (-dcp > 1) together with PCP")
    if pc.pipeline_parallel_size > 1:
        problems.append("pipeline parallel together with PCP")
    if pc.data_parallel_size > 1:
        problems.append("data parallel together with PCP")
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding (MTP / draft models) together with PCP")
    backend = getattr(vllm_config.attention_config, "backend", None)
    if backend is not None and getattr(backend, "name", str(backend)) != "FLASH_ATTN":
        problems.append(f"attention backend {getattr(backend, 'name', backend)} (PCP needs FLASH_ATTN)")
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype not in ("auto", "bfloat16", "float16"):
        problems.append(f"quantized KV cache (kv_cache_dtype={cache_dtype}) together with PCP")
    text = vllm_config.model_config.hf_text_config
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        problems.append("sliding-window attention layers")
    layer_types = list(getattr(text, "layer_types", None) or [])
    if "linear_attention" not in layer_types or "full_attention" not in layer_types:
        problems.append(
            "a non-hybrid model (PCP here is for Gated DeltaNet + full-attention hybrids; "
            f"layer_types={sorted(set(layer_types))})"
        )
    if getattr(vllm_config.model_config, "enable_return_routed_experts", False):
        problems.append("enable_return_routed_experts together with PCP")
    if gdn_prefill_backend(vllm_config) == "flashinfer":
        problems.append(
            "gdn_prefill_backend='flashinfer' (PCP's split steps run vLLM's Triton/FLA GDN kernels: "
            "pass 'triton' or leave it unset)"
        )
    problems += per_token_metadata_problems(vllm_config)
    problems += whole_experts_problems(vllm_config)
    problems += visible_gpu_problems(vllm_config)
    if problems:
        raise ValueError(
            f"qwen36_pcp: prefill_context_parallel_size={pc.prefill_context_parallel_size} with "
            f"{ARCHITECTURE} does not support: " + "; ".join(problems) + "."
        )


def per_token_metadata_problems(vllm_config) -> list[str]:
    """Features that read per-token metadata the runner prepared for the whole batch while the model
    runs on a rank's slice of the rows: at a split step they would compute with other tokens'
    metadata, silently (LoRA's adapter map) or by a crash (sequence parallelism), or they are
    unverified with a split batch (KV connectors, EPLB, pooling)."""
    problems = []
    if vllm_config.lora_config is not None:
        problems.append("LoRA (the per-token adapter mapping covers the whole batch, each PCP rank "
                        "computes a slice of it)")
    # KV offloading (kv_offloading_size) becomes a kv_transfer_config only after this check runs
    if (vllm_config.kv_transfer_config is not None
            or getattr(vllm_config.cache_config, "kv_offloading_size", None) is not None):
        problems.append("KV connectors / disaggregated prefill / KV offloading (kv_transfer_config, "
                        "kv_offloading_size)")
    if vllm_config.parallel_config.enable_eplb:
        problems.append("expert-parallel load balancing (enable_eplb)")
    passes = vllm_config.compilation_config.pass_config
    if vllm_config.parallel_config.tensor_parallel_size > 1 and (passes.enable_sp or passes.fuse_gemm_comms):
        problems.append("sequence parallelism (pass_config enable_sp / fuse_gemm_comms) with tp > 1")
    if vllm_config.model_config.runner_type != "generate":
        problems.append(f"the {vllm_config.model_config.runner_type!r} runner (PCP serves generation)")
    return problems


def visible_gpu_problems(vllm_config) -> list[str]:
    """One GPU per rank on this node: fewer visible GPUs than tp x pcp would fail later with a message
    about device ordinals. Not judged without a visible GPU (vLLM says so itself), with a custom
    worker class (it places its ranks itself), or with another launcher than vLLM's multiprocessing
    one (whose ranks per node are ``local_world_size``)."""
    pc = vllm_config.parallel_config
    if pc.worker_cls != "auto" or pc.distributed_executor_backend not in (None, "mp"):
        return []  # Ray and external launchers place ranks on other nodes than this one
    try:
        from vllm.platforms import current_platform

        count = current_platform.device_count()
    except Exception:  # noqa: BLE001 - a platform without the notion: nothing to judge
        return []
    need = pc.local_world_size
    if not count or count >= need:
        return []
    return [f"{count} visible GPU(s) for tensor_parallel_size={pc.tensor_parallel_size} x "
            f"prefill_context_parallel_size={pc.prefill_context_parallel_size} = {need} ranks on this "
            "node (each rank needs a GPU of its own; check CUDA_VISIBLE_DEVICES)"]


def gdn_prefill_backend(vllm_config) -> str:
    return str((vllm_config.additional_config or {}).get("gdn_prefill_backend", "auto")).strip().lower()


def triton_gdn_prefill_under_pcp(vllm_config) -> None:
    """At pcp > 1 an unset GDN prefill backend means Triton/FLA, not vLLM's 'auto' (FlashInfer on
    SM90): the split steps run the Triton kernels (the relay needs their stages), and every prefill
    step of the engine then runs the same kernels as pcp == 1 with ``gdn_prefill_backend='triton'``."""
    if uses_pcp(vllm_config) and gdn_prefill_backend(vllm_config) == "auto":
        vllm_config.additional_config["gdn_prefill_backend"] = "triton"
        logging.getLogger("vllm.qwen36_pcp").info(
            "qwen36_pcp: GDN prefill backend set to 'triton' for prefill context parallel")




def wants_whole_experts(vllm_config) -> bool:
    """Our MoE model at pcp > 1 with ``moe_experts="replicated"`` (the default)."""
    if not uses_pcp(vllm_config) or not getattr(vllm_config.model_config.hf_text_config, "num_experts", 0):
        return False
    try:
        return pcp_config_of(vllm_config).moe_experts == "replicated"
    except ValueError:  # reported by validate_pcp_config
        return False


def whole_experts_bytes(vllm_config) -> int | None:
    """Every expert's weights of every MoE layer, unquantized (None: quantized, size unknown here)."""
    if vllm_config.model_config.quantization is not None:
        return None
    t = vllm_config.model_config.hf_text_config
    layers = t.num_hidden_layers - len(getattr(t, "mlp_only_layers", None) or [])
    per_expert = 3 * t.hidden_size * t.moe_intermediate_size
    return layers * t.num_experts * per_expert * vllm_config.model_config.dtype.itemsize


def whole_experts_problems(vllm_config) -> list[str]:
    """Startup checks for whole experts: expert parallel would split them; they must fit a GPU."""
    if not wants_whole_experts(vllm_config):
        return []
    problems = []
    if vllm_config.parallel_config.enable_expert_parallel:
        problems.append(
            "enable_expert_parallel with moe_experts='replicated' (expert parallel splits the experts "
            "over the PCP ranks: pass additional_config={'qwen36_pcp': {'moe_experts': 'sharded'}})"
        )
    need = whole_experts_bytes(vllm_config)
    if need is not None:
        need //= vllm_config.parallel_config.tensor_parallel_size  # experts still shard over TP
    try:
        from vllm.platforms import current_platform

        total = current_platform.get_device_total_memory(0)
    except Exception:  # noqa: BLE001 - no device to ask (config built without a GPU)
        total = None
    util = vllm_config.cache_config.gpu_memory_utilization
    if need is not None and total and need > 0.8 * util * total:
        pcp = vllm_config.parallel_config.prefill_context_parallel_size
        problems.append(
            f"moe_experts='replicated' keeps every expert on every GPU: {need / 2**30:.3g} GiB, more than "
            f"80% of the {util * total / 2**30:.3g} GiB that gpu_memory_utilization={util} allows; pass "
            "additional_config={'qwen36_pcp': {'moe_experts': 'sharded'}} to shard them over the PCP "
            f"ranks as vLLM does ({need / pcp / 2**30:.3g} GiB each)"
        )
    return problems


