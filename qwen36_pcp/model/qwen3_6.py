# SPDX-License-Identifier: Apache-2.0
"""Qwen3_6ForCausalLM: text-only Qwen3.6 / Qwen3.5 hybrid (Gated DeltaNet + gated attention) model.

Built on vLLM's own Qwen3.5 layers. It loads the published multimodal checkpoints
(``model.language_model.*``; the vision tower is skipped, and the MTP head is left to vLLM's MTP
drafter, which loads ``mtp.*`` itself when speculative decoding asks for it) as well as flat text
checkpoints, MoE and dense. It adds what vLLM 0.20.2's ``Qwen3_5*ForCausalLM`` lack for a hybrid model
(``IsHybrid`` and the mamba-state classmethods) and text-only M-RoPE positions. At
prefill_context_parallel_size > 1 it is built with the PCP layers (``layers.classes``: GDN, attention
impl, narrow linear layers, and experts whole on every rank unless ``moe_experts="sharded"``); at
pcp == 1 it is vLLM's model. ``Qwen3_6ForConditionalGeneration`` (``qwen3_6_vl``) is the same with
the vision tower.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.models.interfaces import IsHybrid, SupportsMRoPE
from vllm.model_executor.models.qwen3_5 import (
    Qwen3_5ForCausalLMBase,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
)
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

from ..config import ARCHITECTURE, VL_ARCHITECTURE
from .pcp_build import build_model

logger = init_logger(__name__)

# Checkpoint tensors that belong to parts this text-only model does not build.
SKIPPED_PREFIXES = ("model.visual.", "mtp.")


class Qwen3_6ForCausalLM(Qwen3_5MoeForCausalLM, IsHybrid, SupportsMRoPE):
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix={"model.language_model.": "model."})

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        def construct():
            Qwen3_5ForCausalLMBase.__init__(self, vllm_config=vllm_config, prefix=prefix)
            if getattr(self.config, "num_experts", 0):
                self.set_moe_parameters()

        build_model(self, vllm_config, ARCHITECTURE, construct)

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
            raise ValueError(f"{ARCHITECTURE} is text-only; for images and video use {VL_ARCHITECTURE} "
                             f"(--hf-overrides '{{\"architectures\": [\"{VL_ARCHITECTURE}\"]}}')")
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
