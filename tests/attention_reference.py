# SPDX-License-Identifier: Apache-2.0
"""torch references of split attention (CPU tests): vLLM's cache write, an end-aligned causal paged
attention in fp32, and FlashAttention's varlen call with its log-sum-exp."""

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


def varlen_reference(q, k, v, cu_seqlens_q, max_seqlen_q, softmax_scale, causal, return_softmax_lse,
                     seqused_k=None, max_seqlen_k=None, cu_seqlens_k=None, block_table=None, empty_lse=float("-inf")):
    """FlashAttention's ``flash_attn_varlen_func`` contract in fp32 torch (the sharded-cache tests): paged
    keys (``block_table``, ``seqused_k``) or packed ones (``cu_seqlens_k``), causal end-aligned -> (out
    [T, H, D], lse [H, T]); a row without keys gets 0 and ``empty_lse`` (FlashAttention 3: -inf, 2: +inf)."""
    assert return_softmax_lse
    # what FlashAttention needs of its arguments, which this stand-in would otherwise not notice
    cus = [cu_seqlens_q] + ([cu_seqlens_k] if cu_seqlens_k is not None else [seqused_k])
    assert all(x.dtype == torch.int32 for x in cus), [x.dtype for x in cus]
    assert int(cu_seqlens_q[-1]) == q.shape[0] and int(torch.diff(cu_seqlens_q).max()) <= max_seqlen_q
    k_lens = torch.diff(cu_seqlens_k) if cu_seqlens_k is not None else seqused_k
    assert cu_seqlens_k is None or int(cu_seqlens_k[-1]) == k.shape[0]
    assert int(k_lens.max()) <= max_seqlen_k and max_seqlen_k >= 1
    out = torch.zeros(q.shape, device=q.device)
    lse = torch.full(q.shape[:2], empty_lse, device=q.device)
    cu = cu_seqlens_q.tolist()
    for i in range(len(cu) - 1):
        if block_table is not None:
            n = int(seqused_k[i])
            idx = torch.arange(n, device=q.device)
            slots = block_table[i, idx // k.shape[1]].long() * k.shape[1] + idx % k.shape[1]
            ks, vs = k.view(-1, *k.shape[2:])[slots], v.view(-1, *v.shape[2:])[slots]
        else:
            a, b = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
            ks, vs = k[a:b], v[a:b]
        qs = q[cu[i]:cu[i + 1]].float()
        if ks.shape[0] == 0 or qs.shape[0] == 0:
            continue
        rep = qs.shape[1] // ks.shape[1]
        s = torch.einsum("qhd,khd->hqk", qs, ks.float().repeat_interleave(rep, 1)) * softmax_scale
        if causal:  # query j of n_q sees keys up to n_k - n_q + j
            n_q, n_k = qs.shape[0], ks.shape[0]
            sees = n_k - n_q + torch.arange(n_q, device=q.device)
            later = torch.arange(n_k, device=q.device)[None, :] > sees[:, None]
            s = s.masked_fill(later, float("-inf"))
        lse[cu[i]:cu[i + 1]] = torch.logsumexp(s, -1).transpose(0, 1)
        out[cu[i]:cu[i + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vs.float().repeat_interleave(rep, 1))
    return out, lse.transpose(0, 1).contiguous()
