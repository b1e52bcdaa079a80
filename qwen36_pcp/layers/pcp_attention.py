# SPDX-License-Identifier: Apache-2.0
"""vLLM's FlashAttention impl with split-attention steps (K/V all-gather + end-aligned causal varlen).

On steps without a PCP context (pcp == 1, decode-only steps, profiling) it is vLLM's impl unchanged.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

from .context import current_pcp_context
from .split_attention import attend_local_flash, gather_kv_for_cache


class PCPFlashAttentionImpl(FlashAttentionImpl):
    supports_pcp = True
    # (stage, this layer's index in it) with decode="spread": where the layer keeps the new K/V rows it
    # writes at a step without a PCP context (``owned_batch.KVStage``); None: nothing kept
    kv_stage: tuple | None = None

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        ctx = current_pcp_context()
        if ctx is None:
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            if self.kv_stage is not None:  # inside vLLM's CUDA graph where the step replays one
                stage, index = self.kv_stage
                stage.keep(index, key, value)
            return
        k_all, v_all, slots = gather_kv_for_cache(ctx, key, value, slot_mapping)
        super().do_kv_cache_update(layer, k_all, v_all, kv_cache, slots)

    def write_kv(self, layer, key, value, kv_cache, slots) -> None:
        """Other ranks' K/V rows into this rank's cache (a spread decode step's exchange): written as
        vLLM writes a step's, not kept in the stage."""
        super().do_kv_cache_update(layer, key, value, kv_cache, slots)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        ctx = current_pcp_context()
        if ctx is None or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        descale_shape = (ctx.t.num_segments, self.num_kv_heads)
        key_cache, value_cache = kv_cache.unbind(0)
        return attend_local_flash(
            ctx, query, key_cache, value_cache, attn_metadata.block_table, output,
            softmax_scale=self.scale,
            fa_version=self.vllm_flash_attn_version,
            alibi_slopes=self.alibi_slopes,
            window_size=list(self.sliding_window),
            softcap=self.logits_soft_cap,
            q_descale=layer._q_scale.expand(descale_shape) if self.supports_quant_query_input else None,
            k_descale=layer._k_scale.expand(descale_shape),
            v_descale=layer._v_scale.expand(descale_shape),
            s_aux=self.sinks,
        )
