# SPDX-License-Identifier: Apache-2.0
"""Every MoE expert whole on every PCP rank (``moe_experts="replicated"``): how many bytes that is per
GPU, in the form vLLM 0.20.2 stores the experts (bf16, online or checkpoint FP8), and the startup
check that they fit. ``doctor`` answers the same question from a checkpoint's config.json alone.
"""

from __future__ import annotations

import logging
import re

from .config import MTP_METHOD, pcp_config_of, uses_pcp

logger = logging.getLogger("vllm.qwen36_pcp")  # under vLLM's logger, so that it shows in the engine's log

# vLLM 0.20.2's online quantization methods: "online" with a scheme per layer kind, or one scheme's name
ONLINE_METHODS = ("online", "fp8_per_tensor", "fp8_per_block", "int8_per_channel_weight_only", "mxfp8")


def online_schemes(model_config) -> dict[str, str] | None:
    """{"linear": scheme, "moe": scheme} of vLLM's online quantization (``quantization="fp8"`` on a
    checkpoint without a ``quantization_config`` is its ``fp8_per_tensor``), or None: no online
    quantization."""
    method = model_config.quantization
    if method == "fp8" and checkpoint_quant_config(model_config) is None:
        return {"linear": "fp8_per_tensor", "moe": "fp8_per_tensor"}
    if method not in ONLINE_METHODS:
        return None
    args = getattr(model_config, "quantization_config", None)  # vLLM's OnlineQuantizationConfigArgs

    def value(scheme):
        return getattr(scheme, "value", scheme)

    default = value(getattr(args, "global_scheme", None)) or (method if method != "online" else None)
    return {kind: value(getattr(args, f"{kind}_scheme_override", None)) or default for kind in ("linear", "moe")}


def wants_whole_experts(vllm_config) -> bool:
    """Our MoE model at pcp > 1 with ``moe_experts="replicated"`` (the default)."""
    if not uses_pcp(vllm_config) or not getattr(vllm_config.model_config.hf_text_config, "num_experts", 0):
        return False
    try:
        return pcp_config_of(vllm_config).moe_experts == "replicated"
    except ValueError:  # reported by validate_pcp_config
        return False


def experts_storage(model_config) -> tuple[str, int, tuple[int, int] | None, list[str]] | None:
    """How vLLM 0.20.2 stores the routed experts: (description, bytes per weight, the block of one fp32
    scale or None for per-tensor scales, the checkpoint's ignored layers); None: a quantization
    without an estimate here.

    * unquantized: the model dtype, no scales.
    * ``quantization="fp8"`` on a bf16/fp16 checkpoint (``Fp8OnlineMoEMethod``), and the online schemes
      ``"fp8_per_tensor"`` / ``"fp8_per_block"`` (``online/fp8.py``): float8_e4m3fn weights with fp32
      scales per expert and weight (per-tensor) or per 128x128 block.
    * an FP8 checkpoint (``quantization_config`` ``quant_method="fp8"``, ``Fp8MoEMethod``): the same,
      with its ``weight_block_size`` (None: per-tensor); experts named in its ``ignored_layers`` /
      ``modules_to_not_convert`` stay in the model dtype.
    """
    method = model_config.quantization
    if method is None:
        return str(model_config.dtype).removeprefix("torch."), model_config.dtype.itemsize, None, []
    schemes = online_schemes(model_config)
    if schemes is not None:
        ignore = getattr(getattr(model_config, "quantization_config", None), "ignore", None)
        if schemes["moe"] == "fp8_per_tensor" and not ignore:
            return "fp8 (online, per-tensor scales)", 1, None, []
        if schemes["moe"] == "fp8_per_block" and not ignore:
            return "fp8 (online, 128x128 blocks)", 1, (128, 128), []
        return None  # other online schemes, online ignore patterns
    if method == "fp8":
        quant = checkpoint_quant_config(model_config)
        block = quant.get("weight_block_size")
        ignored = quant.get("ignored_layers") or quant.get("modules_to_not_convert") or []
        what = f"fp8, {block[0]}x{block[1]} blocks" if block else "fp8, per-tensor scales"
        return what, 1, tuple(block) if block else None, list(ignored)
    return None  # other methods


def checkpoint_quant_config(model_config) -> dict | None:
    """The checkpoint's ``quantization_config``, where vLLM's ``get_quant_config`` looks for it."""
    hf_config = getattr(model_config, "hf_config", None)
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        quant = getattr(cfg, "quantization_config", None)
        if quant is not None:
            return quant if isinstance(quant, dict) else quant.to_dict()
    return None


def _experts_left_unquantized(ignored: list[str], layer: int, layers: str = "model.layers") -> bool:
    """vLLM's ``is_layer_skipped`` for the FusedMoE ``{layers}.{layer}.mlp.experts`` (our model's, or
    the MTP drafter's under ``mtp.layers``): it is skipped if it is part of an ignored name that names
    experts (names mapped as our model's ``hf_to_vllm_mapper`` maps them)."""
    prefix = f"{layers}.{layer}.mlp.experts"
    return any(prefix in re.sub(r"^model\.language_model\.", "model.", name)
               for name in ignored if "experts" in name)


def whole_experts_bytes(vllm_config, tp_size: int = 1) -> int | None:
    """Bytes of every routed expert of every MoE layer on one GPU, stored as ``experts_storage`` says,
    with the experts' intermediate dimension split over ``tp_size`` ranks as vLLM shards it over TP
    (scales counted per rank: ``Fp8MoEMethod.create_weights``' shapes), the MTP drafter's layers too
    when it is served (its experts are whole as well). None: no estimate."""
    mc = vllm_config.model_config
    storage = experts_storage(mc)
    if storage is None:
        return None
    _, weight_bytes, block, ignored = storage
    t = mc.hf_text_config
    h, i = t.hidden_size, -(-t.moe_intermediate_size // tp_size)
    if block is not None:  # w13 [E, 2I, H] and w2 [E, H, I], one fp32 scale per block
        bn, bk = block
        scales = 2 * -(-i // bn) * -(-h // bk) + -(-h // bn) * -(-i // bk)
    else:  # per-tensor: w13 [E, 2] and w2 [E] at most; none unquantized
        scales = 3 if mc.quantization is not None else 0
    per_expert = 3 * h * i * weight_bytes + 4 * scales
    plain = 3 * h * i * mc.dtype.itemsize
    mlp_only = set(getattr(t, "mlp_only_layers", None) or [])
    layers = [n for n in range(t.num_hidden_layers) if n not in mlp_only]
    spec = getattr(vllm_config, "speculative_config", None)  # the doctor passes a partial config
    serves_mtp = spec is not None and spec.method == MTP_METHOD
    mtp_layers = (getattr(t, "mtp_num_hidden_layers", 0) or 0) if serves_mtp else 0
    return t.num_experts * (
        sum(plain if _experts_left_unquantized(ignored, n) else per_expert for n in layers)
        + sum(plain if _experts_left_unquantized(ignored, n, "mtp.layers") else per_expert
              for n in range(mtp_layers)))


def _memory_not_checked(detail: str) -> None:
    logger.warning("qwen36_pcp: moe_experts='replicated' keeps %s: make sure they fit, or pass "
                   "additional_config={'qwen36_pcp': {'moe_experts': 'sharded'}}", detail)


def whole_experts_problems(vllm_config, memory: bool = True) -> list[str]:
    """Startup checks for whole experts: expert parallel would split them; they must fit a GPU
    (``memory``: judged against this process's GPU; the doctor judges it with its own numbers)."""
    if not wants_whole_experts(vllm_config):
        return []
    problems = []
    if vllm_config.parallel_config.enable_expert_parallel:
        problems.append(
            "enable_expert_parallel with moe_experts='replicated' (expert parallel splits the experts "
            "over the PCP ranks: pass additional_config={'qwen36_pcp': {'moe_experts': 'sharded'}})"
        )
    if not memory:
        return problems
    pc = vllm_config.parallel_config
    need = whole_experts_bytes(vllm_config, pc.tensor_parallel_size)  # experts still shard over TP
    if need is None:
        quant = vllm_config.model_config.quantization
        _memory_not_checked("every expert whole on every GPU; their memory is not checked at startup for "
                            f"quantization={quant!r} (no estimate for it here)")
        return problems
    try:
        from vllm.platforms import current_platform

        total = current_platform.get_device_total_memory(0)
    except Exception as e:  # noqa: BLE001 - no device to ask, or one the platform cannot read
        _memory_not_checked(f"{need / 2**30:.3g} GiB of experts whole on every GPU; the GPU's memory could "
                            f"not be read ({type(e).__name__}: {e}), so it is not checked at startup")
        return problems
    util = vllm_config.cache_config.gpu_memory_utilization
    if total and need > 0.8 * util * total:
        pcp = pc.prefill_context_parallel_size
        problems.append(
            f"moe_experts='replicated' keeps every expert on every GPU: {need / 2**30:.3g} GiB, more than "
            f"80% of the {util * total / 2**30:.3g} GiB that gpu_memory_utilization={util} allows (experts "
            f"in {experts_storage(vllm_config.model_config)[0]}); pass "
            "additional_config={'qwen36_pcp': {'moe_experts': 'sharded'}} to shard them over the PCP "
            f"ranks as vLLM does ({need / pcp / 2**30:.3g} GiB each)"
        )
    return problems
