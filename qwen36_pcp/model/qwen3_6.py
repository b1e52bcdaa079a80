"""Qwen3_6ForCausalLM: text-only Qwen3.6 / Qwen3.5 hybrid (Gated DeltaNet + gated attention) model.

Built on vLLM's own Qwen3.5 layers. It loads the published multimodal checkpoints
(``model.language_model.*``; the vision tower and the MTP head are skipped) as well as flat text
checkpoints, MoE and dense. It adds what vLLM 0.20.2's ``Qwen3_5*ForCausalLM`` lack for a hybrid model
(``IsHybrid`` and the mamba-state classmethods) and text-only M-RoPE positions. At
prefill_context_parallel_size > 1 its GDN layers and attention impls switch to the PCP versions and
its experts stay whole on every rank (``moe_experts``; see ``runner_hooks.whole_experts_on_every_pcp_rank``);
at pcp == 1 it is vLLM's model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.gdn_linear_attn import GatedDeltaNetAttention
from vllm.model_executor.models.interfaces import IsHybrid, SupportsMRoPE
from vllm.model_executor.models.qwen3_5 import (
    Qwen3_5ForCausalLMBase,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
)
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

from ..checks import whole_experts_bytes
from ..config import ARCHITECTURE, pcp_config_of
from ..runner_hooks import whole_experts_on_every_pcp_rank

logger = init_logger(__name__)

# Checkpoint tensors that belong to parts this text-only model does not build.
SKIPPED_PREFIXES = ("model.visual.", "mtp.")


class Qwen3_6ForCausalLM(Qwen3_5MoeForCausalLM, IsHybrid, SupportsMRoPE):
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix={"model.language_model.": "model."})

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        with whole_experts_on_every_pcp_rank(vllm_config):
            Qwen3_5ForCausalLMBase.__init__(self, vllm_config=vllm_config, prefix=prefix)
        if getattr(self.config, "num_experts", 0):
            self.set_moe_parameters()
        else:  # dense (Qwen3.6-27B-style): not a mixture of experts
            self.num_moe_layers = 0
            self.expert_weights = []
            self.moe_layers = []
        if vllm_config.parallel_config.prefill_context_parallel_size > 1:
            install_pcp_layers(self, pcp_config_of(vllm_config))
            experts = [m for m in self.modules() if hasattr(m, "moe_parallel_config")]
            if experts:
                par = experts[0].moe_parallel_config
                size = whole_experts_bytes(vllm_config)
                logger.info(
                    "%s: MoE experts %s over the PCP ranks (expert TP size %d%s)", ARCHITECTURE,
                    "sharded" if par.pcp_size > 1 else "whole on every rank, not sharded",
                    par.tp_size, "" if size is None else f", {size / par.tp_size / 2**30:.3g} GiB per GPU",
                )

    # ---------------------------------------------------------------- hybrid
    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return Qwen3_5ForConditionalGeneration.get_mamba_state_dtype_from_config(vllm_config)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return Qwen3_5ForConditionalGeneration.get_mamba_state_shape_from_config(vllm_config)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return Qwen3_5ForConditionalGeneration.get_mamba_state_copy_func()

    # ---------------------------------------------------------------- M-RoPE
    def get_mrope_input_positions(self, input_tokens, mm_features):
        """Text only: the three M-RoPE axes all carry the token position (as vLLM's Qwen3.5-VL does)."""
        if mm_features:
            raise ValueError(f"{ARCHITECTURE} is text-only; multimodal inputs are not supported")
        positions = torch.arange(len(input_tokens), dtype=torch.int64)
        return positions.unsqueeze(0).expand(3, -1).contiguous(), 0

    # --------------------------------------------------------------- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skipped: dict[str, int] = {}

        def kept():
            for name, tensor in weights:
                prefix = next((p for p in SKIPPED_PREFIXES if name.startswith(p)), None)
                if prefix is None:
                    yield name, tensor
                else:
                    skipped[prefix] = skipped.get(prefix, 0) + 1

        loader = AutoWeightsLoader(self)
        loaded = loader.load_weights(kept(), mapper=self.hf_to_vllm_mapper)
        if skipped:
            logger.info(
                "%s: skipped checkpoint tensors this text-only model does not use: %s",
                ARCHITECTURE,
                ", ".join(f"{n} under {p!r}" for p, n in sorted(skipped.items())),
            )
        return loaded


def install_pcp_layers(model: torch.nn.Module, config) -> None:
    """Switch GDN layers and attention impls to their PCP versions and narrow linear layers to pcp=1's
    row count (same weights, same caches)."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    from ..layers.full_rows_linear import full_row_count, is_narrow
    from ..layers.pcp_attention import PCPFlashAttentionImpl
    from ..layers.pcp_gdn import PCPGatedDeltaNetAttention

    for name, module in model.named_modules():
        if is_narrow(module):  # the shared-expert gate
            full_row_count(module)
        elif isinstance(module, GatedDeltaNetAttention):
            module.__class__ = PCPGatedDeltaNetAttention
            module.pcp_gdn_mode = config.gdn_mode
        elif isinstance(module, Attention):
            impl = module.impl
            if type(impl) is not FlashAttentionImpl:
                raise ValueError(
                    f"{ARCHITECTURE}: prefill context parallel needs the FLASH_ATTN attention "
                    f"backend, but layer {name} uses {type(impl).__name__}. Pass "
                    "attention_backend='FLASH_ATTN' (or leave the backend on auto)."
                )
            if tuple(impl.sliding_window) != (-1, -1):
                raise ValueError(
                    f"{ARCHITECTURE}: prefill context parallel does not support sliding-window "
                    f"attention (layer {name})."
                )
            impl.__class__ = PCPFlashAttentionImpl
