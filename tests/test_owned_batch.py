# SPDX-License-Identifier: Apache-2.0
"""A spread decode step's new K/V on 2 and 4 gloo ranks (``owned_batch.defer_staged_kv``): each rank's
model call wrote its own rows into its caches through the plugin's attention impl, which kept them in
the step's ``KVStage``; from there every layer's rows of every rank reach every rank's caches with the
output gather, in one collective beside the sampled rows."""

import numpy as np
import pytest
import torch

from harness.dist import run_distributed
from harness.runner_stand_in import exchange_slots, pcp_attention_layers
from qwen36_pcp.config import PCPConfig
from qwen36_pcp.layers.context import PCPContext
from qwen36_pcp.plan import PCPPlan

from .layer_cases import kv_layout

KVH, D, BS = 2, 16, 8


def write_kv(k, v, cache, slots):
    """vLLM's cache write (``reshape_and_cache_flash``) on a cache of any stride order; slot -1: skipped.
    Its CUDA kernel reads token t's heads at ``t * stride(0) + i`` for i below heads x dim: any row
    stride, each row's heads contiguous."""
    for x in (k, v):
        assert x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2], (x.shape, x.stride())
    keep = slots >= 0
    block, offset = slots[keep] // BS, slots[keep] % BS
    cache[0][block, offset] = k[keep]
    cache[1][block, offset] = v[keep]


def _step(rank, group, layers=3, groups=((0, 1, 2),)):
    """``groups``: the stage indices of each KV-cache group's layers (a group's layers kept apart in the
    stage: ``(0, 2), (1,)``)."""
    from qwen36_pcp.spread.owned_batch import KVStage, defer_staged_kv

    num_computed, num_new = [40, 9, 3, 70, 12], [1] * 5
    plan = PCPPlan(num_computed, num_new, group.world_size, rank, PCPConfig(decode="spread"),
                   np.arange(5) % group.world_size, min_rows=4)
    block_table, slot_mapping, num_blocks = kv_layout(num_computed, num_new, BS)
    ctx = PCPContext(plan, group, "cpu", num_tokens_padded=plan.num_tokens + 3)
    every = torch.arange(5)
    kv_of = lambda layer, tok: (torch.arange(KVH * D, dtype=torch.float32).view(KVH, D) + 100 * layer  # noqa: E731
                                + 1000 * tok.view(-1, 1, 1).float())
    # FlashAttention's cache: [2, blocks, block_size, heads, dim] as a view of another stride order
    attention = pcp_attention_layers([torch.zeros(num_blocks, KVH, 2, BS, D).permute(2, 0, 3, 1, 4)
                                      for _ in range(layers)], writer=write_kv)
    KVStage(attention, 8, torch.float32, "cpu")
    # the model call: an earlier step of more rows (kept), then this one's, the rank's rows at the head
    # of its batch (padding rows past them: slot -1), each layer's cache write keeping them
    head = torch.full((plan.t_pad,), -1, dtype=torch.long)
    head[: plan.num_local_tokens] = torch.from_numpy(plan.local_full_idx[rank][: plan.num_local_tokens])
    for step_rows in (torch.arange(6) + 50, head):
        for j, layer in enumerate(attention):
            slots = torch.where(step_rows >= 0, slot_mapping[step_rows.clamp(min=0, max=4)], -1)
            layer.impl.do_kv_cache_update(layer, kv_of(j, step_rows), -kv_of(j, step_rows), layer.kv_cache,
                                          slots if step_rows is head else torch.full_like(slots, -1))
    for group_layers in groups:
        defer_staged_kv(ctx, [attention[j] for j in group_layers], exchange_slots(plan, slot_mapping))
    rows = torch.from_numpy(plan.local_full_idx[rank]).clamp(min=0)
    hidden = (rows.view(-1, 1) * 10 + torch.arange(8)).to(torch.bfloat16)
    last = ctx.gather_output(hidden, all_rows=False)

    def flat(c):
        return c.reshape(-1, KVH, D)

    return {"collectives": len(ctx.collectives),
            "sampled": bool(torch.equal(last[every], (every.view(-1, 1) * 10 + torch.arange(8)).to(torch.bfloat16))),
            "caches": [bool(torch.equal(flat(a.kv_cache[0])[slot_mapping], kv_of(j, every))
                            and torch.equal(flat(a.kv_cache[1])[slot_mapping], -kv_of(j, every)))
                       for j, a in enumerate(attention)]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_cached_kv_rides_in_the_output_gather(world_size):
    for rank, out in enumerate(run_distributed(_step, world_size)):
        assert out["collectives"] == 1 and out["sampled"] and all(out["caches"]), (rank, out)


def test_kv_of_groups_kept_apart_in_the_stage():
    for rank, out in enumerate(run_distributed(_step, 2, 3, ((0, 2), (1,)))):
        assert out["collectives"] == 1 and out["sampled"] and all(out["caches"]), (rank, out)


def test_exchange_slots_are_the_gathered_slots_of_each_rank_and_of_the_others():
    """``kv_exchange_slots`` (built on the host) against ``split_attention.gathered_slots`` (on the
    device) on random spread decode plans, ranks owning none and padded batches included: first this
    rank's slots, then every rank's with this rank's own rows and padding -1."""
    from types import SimpleNamespace

    from qwen36_pcp.layers.split_attention import gathered_slots

    rng = np.random.default_rng(0)
    for _ in range(40):
        n, b = int(rng.integers(2, 9)), int(rng.integers(1, 40))
        owner = rng.integers(0, n, b) if rng.random() < 0.7 else np.full(b, rng.integers(0, n))
        most = int(np.bincount(owner, minlength=n).max())
        slot_mapping = torch.from_numpy(rng.integers(0, 10**6, b + 7))
        for rank in range(n):
            plan = PCPPlan(rng.integers(1, 5000, b), np.ones(b, dtype=np.int64), n, rank, PCPConfig(decode="spread"),
                           owner, min_rows=most + int(rng.integers(0, 9)))
            ctx = PCPContext(plan, SimpleNamespace(world_size=n, rank_in_group=rank), "cpu")
            every = gathered_slots(ctx, slot_mapping[:b]).view(n, -1)
            slots = exchange_slots(plan, slot_mapping)
            assert torch.equal(slots[: plan.t_pad], every[rank])
            every[rank] = -1
            assert torch.equal(slots[plan.t_pad:], every.view(-1))


def test_the_stage_keeps_a_steps_first_rows_and_refuses_what_it_cannot_hold():
    from qwen36_pcp.spread.owned_batch import KVStage

    layers = pcp_attention_layers([torch.zeros(2, 4, BS, KVH, D) for _ in range(2)])
    stage = KVStage(layers, 3, torch.float32, "cpu")
    assert [layer.impl.kv_stage[1] for layer in layers] == [0, 1]
    k = torch.randn(5, KVH, D)
    layers[1].impl.do_kv_cache_update(layers[1], k, -k, layers[1].kv_cache, torch.full((5,), -1))
    assert torch.equal(stage.rows[:, 1, 0], k[:3]) and torch.equal(stage.rows[:, 1, 1], -k[:3])
    assert not stage.rows[:, 0].any()
    with pytest.raises(TypeError):
        stage.keep(0, k.double(), k.double())
    with pytest.raises(ValueError):
        KVStage(layers + pcp_attention_layers([torch.zeros(2, 4, BS, 1, D)]), 3, torch.float32, "cpu")
