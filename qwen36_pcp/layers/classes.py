# SPDX-License-Identifier: Apache-2.0
"""Our model's layers at pcp > 1: vLLM's layers, built as their PCP subclasses.

vLLM's Qwen3.5 decoder layers build ``GatedDeltaNetAttention``, ``FusedMoE`` and ``ReplicatedLinear``
themselves. These are vLLM "pluggable layers": while an out-of-tree class is registered under such a
layer's name (``PluggableLayer.register_oot``), constructing the layer builds that class instead. The
PCP subclasses are registered only while the PCP model runner loads our model and its MTP drafter at
pcp > 1 (``pcp_model_build``) and removed right after, so no other model in the process, and no later
engine, sees them. Attention is not pluggable: its impl (vLLM's FlashAttention) adopts the PCP
subclass after the model is built (``adopt_pcp_attention``); the subclass adds no state but, with
``decode="spread"``, the stage its cache writes keep (``owned_batch.KVStage``).
"""

from __future__ import annotations

import contextlib

import torch
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.mamba.gdn_linear_attn import GatedDeltaNetAttention
from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

from ..config import ARCHITECTURES, pcp_config_of, pcp_runner_builds_model, uses_pcp
from .full_rows_linear import PCPReplicatedLinear
from .pcp_attention import PCPFlashAttentionImpl
from .pcp_gdn import PCPGatedDeltaNetAttention
from .whole_experts import WholeExpertsFusedMoE


def pcp_layer_replacements(vllm_config) -> dict[type, type]:
    """vLLM layer class -> the class built in its place at pcp > 1 (none at pcp == 1)."""
    if not uses_pcp(vllm_config):
        return {}
    out = {GatedDeltaNetAttention: PCPGatedDeltaNetAttention, ReplicatedLinear: PCPReplicatedLinear}
    moe = bool(getattr(vllm_config.model_config.hf_text_config, "num_experts", 0))
    if moe and pcp_config_of(vllm_config).moe_experts == "replicated":
        out[FusedMoE] = WholeExpertsFusedMoE
    return out


@contextlib.contextmanager
def pcp_model_build(vllm_config):
    """What the PCP model runner wraps around vLLM's model load (our model, then the MTP drafter when
    speculative decoding is on): its mark, without which our model at pcp > 1 refuses to be built, and
    the PCP layer classes. Yields the replacements in effect."""
    replacements = pcp_layer_replacements(vllm_config)
    with pcp_runner_builds_model(), pcp_layer_classes(replacements):
        yield replacements


@contextlib.contextmanager
def pcp_layer_classes(replacements: dict[type, type]):
    """Build ``replacements``' classes in place of vLLM's while the block runs (vLLM's out-of-tree
    layer registry); an out-of-tree class another plugin registered for one of them is an error, as
    the two cannot both hold."""
    taken = {vllm_cls.__name__: op_registry_oot[vllm_cls.__name__] for vllm_cls in replacements
             if vllm_cls.__name__ in op_registry_oot}
    if taken:
        raise RuntimeError(
            f"qwen36_pcp: {' and '.join(ARCHITECTURES)} at prefill_context_parallel_size > 1 builds its own "
            "subclasses of "
            f"vLLM's {sorted(taken)}, which another plugin already replaces "
            f"({', '.join(f'{k} -> {v.__module__}.{v.__qualname__}' for k, v in taken.items())})")
    registered = []
    try:
        for vllm_cls, ours in replacements.items():
            vllm_cls.register_oot(ours)
            registered.append(vllm_cls.__name__)
        yield
    finally:
        for name in registered:
            op_registry_oot.pop(name, None)


def adopt_pcp_attention(model: torch.nn.Module) -> None:
    """Every attention layer's FlashAttention impl becomes the PCP impl (split steps), after checking
    what PCP needs of it."""
    for name, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        impl = module.impl
        if type(impl) is PCPFlashAttentionImpl:
            continue
        if type(impl) is not FlashAttentionImpl:
            raise ValueError(
                f"qwen36_pcp: prefill context parallel needs the FLASH_ATTN attention backend, but "
                f"layer {name} uses {type(impl).__name__}. Pass attention_backend='FLASH_ATTN' (or leave "
                "the backend on auto)."
            )
        if tuple(impl.sliding_window) != (-1, -1):
            raise ValueError(
                f"qwen36_pcp: prefill context parallel does not support sliding-window attention "
                f"(layer {name})."
            )
        impl.__class__ = PCPFlashAttentionImpl
