# SPDX-License-Identifier: Apache-2.0
"""Split full attention: every rank's new K/V into every rank's (replicated) paged KV cache, then
end-aligned causal varlen attention of the local queries against the cache.

One code path covers fresh prefill, continuation over cached context (chunked prefill, prefix-cache
hits) and replicated decode rows: each local segment is a virtual sequence whose queries are the
segment's tokens and whose keys are the request's first ``num_computed + segment end`` cache entries.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends import flash_attn as fa

from .context import PCPContext


def gathered_slots(ctx: PCPContext, slot_mapping: torch.Tensor) -> torch.Tensor:
    """The cache slot of each gathered row ([N*t_pad], rank-major; -1: do not write).

    ``slot_mapping`` is the runner's slot mapping of the FULL batch (same on every rank); padding rows
    and the non-primary copies of replicated rows get -1, so every token is written exactly once."""
    idx = ctx.t.gathered_full_idx
    return torch.where(idx >= 0, slot_mapping.index_select(0, idx.clamp(min=0)),
                       torch.full_like(idx, -1).to(slot_mapping.dtype))


def gather_kv_for_cache(ctx: PCPContext, key: torch.Tensor, value: torch.Tensor,
                        slot_mapping: torch.Tensor):
    """All ranks' new K/V ([N*t_pad, kv_heads, d]) and the slot of each row (``gathered_slots``)."""
    head_k = key.shape[-1]
    kv = ctx.all_gather(torch.cat([key, value], dim=-1))
    return kv[..., :head_k].contiguous(), kv[..., head_k:].contiguous(), gathered_slots(ctx, slot_mapping)


def vseq_block_table(ctx: PCPContext, block_table: torch.Tensor) -> torch.Tensor:
    """The block-table row of each local virtual sequence."""
    return block_table.index_select(0, ctx.t.seg_req)


def attend_local_flash(ctx: PCPContext, query, key_cache, value_cache, block_table, output, *,
                       softmax_scale: float, fa_version: int, **fa_kwargs) -> torch.Tensor:
    """Local queries against the paged cache with vLLM's bundled flash-attention (GPU).

    ``fa_kwargs`` passes the impl's extras through (alibi_slopes, window_size, softcap, descales, s_aux).
    The builder's FA3 scheduler metadata is not reused: it was planned for the full batch shape.

    ``num_splits=1``: left to itself (0), flash-attention splits a tile's keys over several thread
    blocks when a call has too few query tiles to fill the GPU, and the split count follows the
    call's shape. A rank's share of a step is a smaller call than pcp=1's whole step, so it split
    where pcp=1 did not and rounded differently (pcp=8, 1 bf16 ulp on 5 of 8 ranks). Unsplit, every
    query row is reduced over its keys in the one order pcp=1 uses on a step of that size: bit for
    bit pcp=1's wherever pcp=1 does not split (its long steps). The cost is occupancy on split steps
    whose ranks hold few query tiles against long keys (small prefill chunks at large N).
    """
    t = ctx.t
    n = t.num_local_tokens
    if t.num_segments == 0:  # a mixed step where this rank has no row
        output.zero_()
        return output
    fa.flash_attn_varlen_func(
        q=query[:n],
        k=key_cache,
        v=value_cache,
        out=output[:n],
        cu_seqlens_q=t.segments.cu,
        max_seqlen_q=t.max_q,
        seqused_k=t.seqused_k,
        max_seqlen_k=t.max_k,
        softmax_scale=softmax_scale,
        causal=True,
        block_table=vseq_block_table(ctx, block_table),
        scheduler_metadata=None,
        fa_version=fa_version,
        num_splits=1,
        **fa_kwargs,
    )
    if n < output.shape[0]:
        output[n:] = 0
    return output
