# SPDX-License-Identifier: Apache-2.0
"""Attention of rows every rank holds (decode and verification rows) over a sharded cache.

vLLM's DCP decode, with the PCP group as the CP group and every head on every rank: each rank attends the
rows' queries over the context it keeps (the tokens before this step, ``seqused_k`` its local lengths),
the ranks' partial outputs are merged by their log-sum-exp (``merge_partials``), and the rows' own new
K/V, which every rank has from the step's input, are attended causally and merged in last (vLLM's
``merge_attn_states``). The step's new K/V are written to the cache by the rank that keeps each token
(``shard_block_tables``); none is read back from it in the step that writes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .merge import merge_partials


@dataclass(frozen=True)
class ShardedRows:
    """A step's rows held by every rank, as FlashAttention's varlen arguments: ``cu_q`` the rows' query
    starts per request (int32), ``context_lens`` this rank's kept tokens of each request's context
    (``KVShard.local_lens`` of the tokens before the step), ``block_table`` the attention group's rows."""

    cu_q: torch.Tensor
    max_q: int
    context_lens: torch.Tensor
    max_context: int
    block_table: torch.Tensor


def attend_sharded(query, key, value, key_cache, value_cache, rows: ShardedRows, scale: float, group,
                   output: torch.Tensor, varlen=None, **fa_kwargs) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] (the rows' new K/V) -> ``output`` [T, H, D], the rows'
    attention over every rank's context and their own new tokens. ``varlen``: FlashAttention's
    ``flash_attn_varlen_func`` (vLLM's, the default) or a function of the same contract; ``fa_kwargs`` go to
    both of its calls (on a GPU: ``fa_version``, the descales)."""
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    if varlen is None:
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func as varlen
    query = query.contiguous()
    context_out, context_lse = varlen(
        q=query, k=key_cache, v=value_cache, cu_seqlens_q=rows.cu_q, max_seqlen_q=rows.max_q,
        seqused_k=rows.context_lens, max_seqlen_k=max(1, rows.max_context), softmax_scale=scale, causal=False,
        block_table=rows.block_table, return_softmax_lse=True, **fa_kwargs)
    # FlashAttention's log-sum-exp is [H, T]; the merge over the group takes [T, H]
    context_out, context_lse = merge_partials(context_out, context_lse.transpose(0, 1), group)
    own_out, own_lse = varlen(
        q=query, k=key, v=value, cu_seqlens_q=rows.cu_q, max_seqlen_q=rows.max_q, cu_seqlens_k=rows.cu_q,
        max_seqlen_k=rows.max_q, softmax_scale=scale, causal=True, return_softmax_lse=True, **fa_kwargs)
    merge_attn_states(output, context_out, context_lse.transpose(0, 1).contiguous(), own_out, own_lse)
    return output
