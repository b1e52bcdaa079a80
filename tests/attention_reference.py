# SPDX-License-Identifier: Apache-2.0
"""torch references of split attention (CPU tests): vLLM's cache write and an end-aligned causal paged
attention in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.runner_stand_in import write_kv_reference
from qwen36_pcp.layers.context import PCPContext
from qwen36_pcp.layers.split_attention import gather_kv_for_cache, vseq_block_table


def paged_causal_attention_reference(q: torch.Tensor, key_cache: torch.Tensor,
                                     value_cache: torch.Tensor, cu_q: torch.Tensor,
                                     seqused_k: torch.Tensor, block_table: torch.Tensor,
                                     scale: float) -> torch.Tensor:
    """End-aligned causal attention of varlen queries against a paged cache (GQA), in fp32."""
    block_size = key_cache.shape[1]
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    cu = cu_q.tolist()
    used = seqused_k.tolist()
    for s in range(len(used)):
        a, b, n_k = cu[s], cu[s + 1], used[s]
        if b == a:
            continue
        pos = torch.arange(n_k, device=q.device)
        slots = block_table[s, pos // block_size].long() * block_size + pos % block_size
        k = key_cache.view(-1, *key_cache.shape[2:])[slots].float()  # [n_k, kvh, d]
        v = value_cache.view(-1, *value_cache.shape[2:])[slots].float()
        qs = q[a:b].float()  # [n_q, h, d]
        rep = qs.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        n_q = b - a
        # bottom-right aligned causal mask: query i sees keys [0, n_k - n_q + i]
        mask = pos[None, :] <= (n_k - n_q + torch.arange(n_q, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
        )
        out[a:b] = o.transpose(0, 1).to(q.dtype)
    return out


def split_attention_reference(ctx: PCPContext, query, key, value, key_cache, value_cache,
                              slot_mapping, block_table, scale) -> torch.Tensor:
    """The whole split-attention layer step with torch reference kernels (CPU tests)."""
    k_all, v_all, slots = gather_kv_for_cache(ctx, key, value, slot_mapping)
    write_kv_reference(k_all, v_all, key_cache, value_cache, slots)
    t = ctx.t
    return paged_causal_attention_reference(
        query, key_cache, value_cache, t.segments.cu, t.seqused_k, vseq_block_table(ctx, block_table), scale
    )
