# SPDX-License-Identifier: Apache-2.0
"""A split step's attention over a sharded cache: each rank's queries against every rank's shard.

At a split step each rank holds its own rows (``PCPPlan`` segments) and, after the K/V all-gather the
replicated cache already makes, every new K/V of the step. The new tokens are attended from that
gather (causal, end-aligned per segment); the context cached before the step lives in shards, so the
ranks' queries are all-gathered, each rank attends all of them over its shard, and the partial results
are merged by log-sum-exp (``merge_partials``), each rank keeping its own rows. A step where no request
has context skips the second part; where one has, every rank's rows take part (rows without context get
no keys: traffic that packing the rows with context would cut). The host builds the step's varlen
layout once (``SplitShardRows.of``), the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .layout import KVShard
from .merge import merge_partials


@dataclass(frozen=True)
class SplitShardRows:
    """One rank's view of a split step, as FlashAttention varlen arguments (int32 tensors).

    Context part, over every rank's ``t_pad`` rows gathered (rank-major): ``ctx_cu_q`` a sequence per
    (rank, segment) and one per rank for its padding, ``ctx_lens`` the keys of it this rank keeps
    (``KVShard.local_lens`` of the request's cached tokens), ``ctx_seq_req`` the request whose block-table
    row it reads. Own part, over this rank's rows: ``own_cu_q`` a sequence per segment, ``own_keys``
    the gathered rows holding its request's new tokens [0, segment end) in order, ``own_cu_k`` their
    starts."""

    t_pad: int
    rows: int  # this rank's rows (the rest of its t_pad is padding)
    has_context: bool
    ctx_cu_q: torch.Tensor
    ctx_lens: torch.Tensor
    ctx_seq_req: torch.Tensor
    max_ctx_q: int
    max_ctx_k: int
    own_cu_q: torch.Tensor
    own_keys: torch.Tensor
    own_cu_k: torch.Tensor
    max_own_q: int
    max_own_k: int

    @classmethod
    def of(cls, plan, shard: KVShard, device) -> SplitShardRows:
        t = plan.t_pad
        cached = plan.num_computed
        local = shard.local_lens(torch.from_numpy(cached.astype(np.int32))).numpy()
        ctx_q, ctx_k, ctx_req = [0], [], []
        for r, segs in enumerate(plan.segments):
            offs = plan.seg_offsets[r]
            for s, end in zip(segs, offs[1:]):
                ctx_q.append(r * t + int(end))
                ctx_k.append(int(local[s.req]))
                ctx_req.append(s.req)
            ctx_q.append((r + 1) * t)  # the rank's padding rows: no keys
            ctx_k.append(0)
            ctx_req.append(0)
        segs, offs = plan.segments[plan.rank], plan.seg_offsets[plan.rank]
        full = plan.gathered_of_full  # full token -> gathered row of its primary copy
        keys = [full[plan.req_start[s.req] + np.arange(s.end)] for s in segs]
        own_cu_k = np.concatenate([[0], np.cumsum([len(k) for k in keys])])

        def i32(x):
            return torch.as_tensor(np.asarray(x), dtype=torch.int32, device=device)

        q_lens = np.diff(ctx_q)
        return cls(
            t_pad=t, rows=int(offs[-1]), has_context=bool((cached > 0).any()),
            ctx_cu_q=i32(ctx_q), ctx_lens=i32(ctx_k),
            ctx_seq_req=torch.as_tensor(ctx_req, dtype=torch.long, device=device),
            max_ctx_q=int(q_lens.max()), max_ctx_k=max(1, max(ctx_k)),
            own_cu_q=i32(offs), own_keys=torch.as_tensor(np.concatenate(keys) if keys else np.zeros(0, np.int64),
                                                         dtype=torch.long, device=device),
            own_cu_k=i32(own_cu_k), max_own_q=int(np.diff(offs).max(initial=0)),
            max_own_k=int(np.diff(own_cu_k).max(initial=0)))


def attend_split_sharded(query, k_all, v_all, key_cache, value_cache, block_table, rows: SplitShardRows,
                         scale: float, group, output: torch.Tensor, varlen=None, **fa_kwargs) -> torch.Tensor:
    """query [t_pad, H, D] this rank's rows; k_all / v_all [N * t_pad, KVH, D] the step's gathered new K/V;
    ``block_table`` the attention group's rows of the step's requests -> ``output`` [t_pad, H, D] (padding
    rows zero). ``fa_kwargs`` go to both FlashAttention calls (on a GPU: ``fa_version``, ``num_splits=1``
    as ``attend_local_flash`` has it, the descales)."""
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    if varlen is None:
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func as varlen
    n = rows.rows
    output.zero_()
    own_out = own_lse = None
    if n:
        own_out, own_lse = varlen(
            q=query[:n].contiguous(), k=k_all.index_select(0, rows.own_keys),
            v=v_all.index_select(0, rows.own_keys), cu_seqlens_q=rows.own_cu_q, max_seqlen_q=rows.max_own_q,
            cu_seqlens_k=rows.own_cu_k, max_seqlen_k=rows.max_own_k, softmax_scale=scale, causal=True,
            return_softmax_lse=True, **fa_kwargs)
    if not rows.has_context:
        if n:
            output[:n] = own_out
        return output
    # every rank joins the context part's collectives, rows or not
    q_all = group.all_gather(query.contiguous(), dim=0)
    ctx_out, ctx_lse = varlen(
        q=q_all, k=key_cache, v=value_cache, cu_seqlens_q=rows.ctx_cu_q, max_seqlen_q=rows.max_ctx_q,
        seqused_k=rows.ctx_lens, max_seqlen_k=rows.max_ctx_k, softmax_scale=scale, causal=False,
        block_table=block_table.index_select(0, rows.ctx_seq_req), return_softmax_lse=True, **fa_kwargs)
    ctx_out, ctx_lse = merge_partials(ctx_out, ctx_lse.transpose(0, 1), group)
    if n:
        mine = slice(group.rank_in_group * rows.t_pad, group.rank_in_group * rows.t_pad + n)
        merge_attn_states(output[:n], ctx_out[mine].contiguous(), ctx_lse[mine].transpose(0, 1).contiguous(),
                          own_out, own_lse)
    return output
