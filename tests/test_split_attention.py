# SPDX-License-Identifier: Apache-2.0
"""Split full attention on 2 and 4 gloo ranks == causal attention over the whole sequence, with the
decode rows replicated or each on one rank (decode="spread"): every rank's cache gets every new K/V."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harness.dist import run_distributed
from qwen36_pcp.layers.context import PCPContext
from qwen36_pcp.plan import PCPConfig, PCPPlan

from .attention_reference import split_attention_reference
from .layer_cases import BATCHES, kv_layout

H, KVH, D, BS = 4, 2, 16, 8


def make_case(seed, num_computed, num_new):
    g = torch.Generator().manual_seed(seed)
    ctx_kv = [(torch.randn(c, KVH, D, generator=g), torch.randn(c, KVH, D, generator=g)) for c in num_computed]
    T = int(sum(num_new))
    q, k, v = (torch.randn(T, n, D, generator=g) for n in (H, KVH, KVH))
    return ctx_kv, q, k, v


def reference(ctx_kv, q, k, v, num_computed, num_new, scale):
    out, start = [], 0
    for (ck, cv), c, n in zip(ctx_kv, num_computed, num_new):
        kk = torch.cat([ck, k[start : start + n]]).repeat_interleave(H // KVH, 1)
        vv = torch.cat([cv, v[start : start + n]]).repeat_interleave(H // KVH, 1)
        mask = torch.arange(c + n)[None, :] <= (c + torch.arange(n))[:, None]
        o = F.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
            attn_mask=mask, scale=scale,
        )
        out.append(o.transpose(0, 1))
        start += n
    return torch.cat(out)


def _worker(rank, group, layouts):
    scale = D**-0.5
    worst = 0.0
    cases = [(b, lay, spread) for b in BATCHES for lay in layouts for spread in (False, True)]
    cases.append((([40, 9, 3, 0], [1, 1, 1, 700]), "zigzag",
                  True))  # decode rows beside a split: at pcp=4 rank 3 owns none
    for (num_computed, num_new), layout, spread in cases:
        seed = sum(num_new) * 31 + len(num_new)
        ctx_kv, q, k, v = make_case(seed, num_computed, num_new)
        block_table, slot_mapping, num_blocks = kv_layout(num_computed, num_new, BS)
        key_cache = torch.zeros(num_blocks, BS, KVH, D)
        value_cache = torch.zeros(num_blocks, BS, KVH, D)
        for i, (ck, cv) in enumerate(ctx_kv):  # context written earlier
            pos = torch.arange(len(ck))
            blk = block_table[i, pos // BS].long()
            key_cache[blk, pos % BS] = ck
            value_cache[blk, pos % BS] = cv
        # decode="spread": each one-token row on one rank (spread over the ranks by its position)
        owner = np.where(np.array(num_new) == 1, np.arange(len(num_new)) % group.world_size, -1) if spread else None
        plan = PCPPlan(num_computed, num_new, group.world_size, rank,
                       PCPConfig(layout=layout, min_split_tokens=4), owner)
        ctx = PCPContext(plan, group, "cpu", num_tokens_padded=plan.num_tokens + 3)  # the runner's padding
        rows = torch.from_numpy(plan.local_full_idx[rank])
        local = lambda x: x[rows.clamp(min=0)]  # noqa: E731
        out = split_attention_reference(ctx, local(q), local(k), local(v), key_cache, value_cache,
                                        slot_mapping, block_table, scale)
        ref = reference(ctx_kv, q, k, v, num_computed, num_new, scale)
        T = plan.num_local_tokens
        torch.testing.assert_close(out[:T], ref[rows[:T]], rtol=1e-5, atol=1e-5)
        assert (out[T:] == 0).all()
        # every rank's cache now holds all new K/V (replicated KV cache)
        flat_k = key_cache.view(-1, KVH, D)
        torch.testing.assert_close(flat_k[slot_mapping], k, rtol=0, atol=0)
        torch.testing.assert_close(value_cache.view(-1, KVH, D)[slot_mapping], v, rtol=0, atol=0)
        worst = max(worst, (out[:T] - ref[rows[:T]]).abs().max().item() if T else 0.0)
        check_output_gather(ctx, out, ref)
    return worst


def check_output_gather(ctx, out, ref):
    """The step's output in full row order from the primary copies (``ref``: attention over the whole
    sequence): every row, or only each request's last row (zeros elsewhere). Rows a rank holds but
    does not own (padding, replicated requests on ranks > 0) are spoiled first, so a gather that took
    a wrong copy differs."""
    plan, rank = ctx.plan, ctx.rank
    primary = torch.from_numpy(plan.primary[rank])
    hidden = torch.where(primary[:, None, None], out, torch.full_like(out, 100.0 + rank))
    every = ctx.gather_output(hidden, all_rows=True)
    assert every.shape[0] == ctx.num_tokens_padded
    torch.testing.assert_close(every[: plan.num_tokens], ref, rtol=1e-5, atol=1e-5)
    assert (every[plan.num_tokens:] == 0).all()
    sent = ctx.bytes_sent
    last = ctx.gather_output(hidden, all_rows=False)
    rows = torch.from_numpy(plan.req_start[1:] - 1)
    assert torch.equal(last[rows], every[rows])
    assert last.count_nonzero() == last[rows].count_nonzero()  # zeros elsewhere
    assert ctx.bytes_sent - sent == plan.num_reqs * hidden[0].numel() * hidden.element_size()


@pytest.mark.parametrize("world_size", [2, 4])
def test_split_attention_matches_full_sequence(world_size):
    errors = run_distributed(_worker, world_size, ("zigzag", "contiguous"))
    assert max(errors) < 1e-5
