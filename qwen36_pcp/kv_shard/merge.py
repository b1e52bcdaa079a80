# SPDX-License-Identifier: Apache-2.0
"""The ranks' partial attention over their shards merged into the whole sequence's attention.

Each rank attends its queries over the K/V it keeps and returns its output with the log-sum-exp of its
scores; the merge rescales each output by ``exp(lse_rank - lse_all)`` and sums. vLLM 0.20.2 does this for
DCP (``cp_lse_ag_out_ar``: the log-sum-exps all-gathered, its Triton kernel's correction, one
all-reduce); a PCP rank holds every head, so that scheme applies over the PCP group. Its kernel reads a
power-of-two number of ranks' log-sum-exps unmasked (``N_ROUNDED``), so at pcp = 3 the gathered ones are
padded with ranks that keep nothing (``-inf``). Per request and layer that moves the heads' log-sum-exps
and one output row per query (Qwen3.6: 16 x 256 values, 8 KiB in bf16).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.ops.common import CPTritonContext, correct_attn_out


def merge_partials(out: torch.Tensor, lse: torch.Tensor, group, ctx: CPTritonContext | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """out: [tokens, heads, head_dim], this rank's attention over its shard (zeros where it keeps no key
    of the row); lse: [tokens, heads], natural-log log-sum-exp (``-inf`` there) -> the merged output and
    log-sum-exp, the same on every rank of ``group``."""
    n = group.world_size
    if n == 1:
        return out, lse
    lses = group.all_gather(lse.contiguous(), dim=0).view(n, *lse.shape)
    rounded = 1 << (n - 1).bit_length()
    if rounded != n:
        pad = lses.new_full((rounded - n, *lse.shape), float("-inf"))
        lses = torch.cat([lses, pad])
    out, merged_lse = correct_attn_out(out, lses, group.rank_in_group, ctx or CPTritonContext())
    return group.all_reduce(out), merged_lse
