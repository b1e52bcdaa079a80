# SPDX-License-Identifier: Apache-2.0
"""Qwen3_6ForConditionalGeneration: the vision-language Qwen3.6 / Qwen3.5 (images and video), MoE and dense.

vLLM's Qwen3.5 vision-language model (vision tower, processor, encoder cache, M-RoPE positions), with
its language model built from the PCP layers at prefill_context_parallel_size > 1; at pcp == 1 it is
vLLM's class. Images need nothing of the PCP layers: vLLM's runner encodes the step's images and
merges their embeddings into ``inputs_embeds`` for the whole batch before the model runs, so a split
step hands each rank its rows of ``inputs_embeds`` and of the [3, T] M-RoPE positions of the whole
prompt (``runner_hooks.split_forward.SplitForward.split``), wherever an image's tokens fall among the blocks.
The vision encoder is split: each rank encodes its share of the step's frames and one all-gather
gives every rank's encoder cache every embedding (``layers.vision_split``; ``vision_encoder="replicated"``:
every rank encodes everything).

One class for the MoE (``Qwen3_5MoeForConditionalGeneration``) and the dense
(``Qwen3_5ForConditionalGeneration``) layouts, as ``Qwen3_6ForCausalLM`` is; the processor reads
either config.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.distributed import get_pcp_group
from vllm.model_executor.models.qwen3_5 import (
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
)
from vllm.model_executor.models.qwen3_vl import (
    Qwen3VLDummyInputsBuilder,
    Qwen3VLMultiModalProcessor,
    Qwen3VLProcessingInfo,
)
from vllm.model_executor.models.vision import run_dp_sharded_mrope_vision_model
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.transformers_utils.configs.qwen3_5 import Qwen3_5Config
from vllm.transformers_utils.configs.qwen3_5_moe import Qwen3_5MoeConfig

from ..config import VL_ARCHITECTURE, pcp_config_of
from ..layers.vision_split import encode_split
from .pcp_build import build_model


class Qwen3_6ProcessingInfo(Qwen3VLProcessingInfo):
    def get_hf_config(self):
        return self.ctx.get_hf_config((Qwen3_5MoeConfig, Qwen3_5Config))


@MULTIMODAL_REGISTRY.register_processor(
    Qwen3VLMultiModalProcessor, info=Qwen3_6ProcessingInfo, dummy_inputs=Qwen3VLDummyInputsBuilder,
)
class Qwen3_6ForConditionalGeneration(Qwen3_5MoeForConditionalGeneration):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "model"):
        moe = bool(getattr(vllm_config.model_config.hf_text_config, "num_experts", 0))
        base = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
        build_model(self, vllm_config, VL_ARCHITECTURE,
                    lambda: base.__init__(self, vllm_config=vllm_config, prefix=prefix))
        # vLLM's MTP drafter reads a multimodal target's image token from ``config.image_token_index``
        # unless it knows the target's class by name (Qwen3.5's among them, ours not); Qwen3.5's
        # config calls it ``image_token_id``
        if not hasattr(self.config, "image_token_index"):
            self.config.image_token_index = self.config.image_token_id
        self.split_encoder = (vllm_config.parallel_config.prefill_context_parallel_size > 1
                              and pcp_config_of(vllm_config).vision_encoder == "split")

    def _process_image_input(self, image_input):
        if self.split_encoder and image_input["type"] == "pixel_values":
            return self._encode_split(image_input["pixel_values"], image_input["image_grid_thw"])
        return super()._process_image_input(image_input)

    def _process_video_input(self, video_input):
        if self.split_encoder and video_input["type"] == "pixel_values_videos":
            return self._encode_split(video_input["pixel_values_videos"], video_input["video_grid_thw"])
        return super()._process_video_input(video_input)

    def _encode_split(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """vLLM's encoding of a batch of items (the tower, or with ``mm_encoder_tp_mode="data"`` its
        sharding over the TP group), on this rank's share of the frames."""
        def encode(local_pixels, grids):
            if self.use_data_parallel:  # frame by frame: vLLM balances whole items over the TP ranks
                frames = [[1, h, w] for t, h, w in grids for _ in range(t)]
                return torch.cat(run_dp_sharded_mrope_vision_model(self.visual, local_pixels, frames,
                                                                   rope_type="rope_3d"))
            return self.visual(local_pixels, grid_thw=grids)

        return encode_split(encode, pixels.type(self.visual.dtype), grid_thw.tolist(),
                            self.visual.spatial_merge_size ** 2, self.visual.out_hidden_size, get_pcp_group())
