"""Split full attention: all-gather this step's new K/V, write all of it into the (replicated) paged KV
cache, then run end-aligned causal varlen attention of the local queries against the cache.

One code path covers fresh prefill, continuation over cached context (chunked prefill, prefix-cache
hits) and replicated decode rows: each local segment is a virtual sequence whose queries are the
segment's tokens and whose keys are the request's first ``num_computed + segment end`` cache entries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .context import PCPContext


def gather_kv_for_cache(ctx: PCPContext, key: torch.Tensor, value: torch.Tensor,
                        slot_mapping: torch.Tensor):
    """All ranks' new K/V ([N*t_pad, kv_heads, d]) and the slot of each row (-1: do not write).

    ``slot_mapping`` is the runner's slot mapping of the FULL batch (same on every rank); padding rows
    and the non-primary copies of replicated rows get -1, so every token is written exactly once.
    """
    head_k = key.shape[-1]
    kv = ctx.all_gather(torch.cat([key, value], dim=-1))
    k_all = kv[..., :head_k].contiguous()
    v_all = kv[..., head_k:].contiguous()
    idx = ctx.t.gathered_full_idx
    slots = torch.where(idx >= 0, slot_mapping.index_select(0, idx.clamp(min=0)),
                        torch.full_like(idx, -1).to(slot_mapping.dtype))
    return k_all, v_all, slots


def vseq_block_table(ctx: PCPContext, block_table: torch.Tensor) -> torch.Tensor:
    """The block-table row of each local virtual sequence."""
    return block_table.index_select(0, ctx.t.seg_req)


def attend_local_flash(ctx: PCPContext, query, key_cache, value_cache, block_table, output, *,
                       softmax_scale: float, fa_version: int, **fa_kwargs) -> torch.Tensor:
    """Local queries against the paged cache with vLLM's bundled flash-attention (GPU).

    ``fa_kwargs`` passes the impl's extras through (alibi_slopes, window_size, softcap, descales, s_aux).
    The builder's FA3 scheduler metadata is not reused: it was planned for the full batch shape.
    """
    from vllm.v1.attention.backends import flash_attn as fa

    t = ctx.t
    n = t.num_local_tokens
    fa.flash_attn_varlen_func(
        q=query[:n],
        k=key_cache,
        v=value_cache,
        out=output[:n],
        cu_seqlens_q=t.cu_q,
        max_seqlen_q=t.max_q,
        seqused_k=t.seqused_k,
        max_seqlen_k=t.max_k,
        softmax_scale=softmax_scale,
        causal=True,
        block_table=vseq_block_table(ctx, block_table),
        scheduler_metadata=None,
        fa_version=fa_version,
        num_splits=0,
        **fa_kwargs,
    )
    if n < output.shape[0]:
        output[n:] = 0
    return output


# ----------------------------------------------------------------------------- torch reference
def write_kv_reference(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Reference of vLLM's reshape_and_cache_flash: cache [num_blocks, block_size, kvh, d]."""
    keep = slots >= 0
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    flat_k[slots[keep]] = k[keep].to(flat_k.dtype)
    flat_v[slots[keep]] = v[keep].to(flat_v.dtype)


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
        query, key_cache, value_cache, t.cu_q, t.seqused_k, vseq_block_table(ctx, block_table), scale
    )
