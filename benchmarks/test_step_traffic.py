# SPDX-License-Identifier: Apache-2.0
"""The step-time model's accounting of a split step's collectives (``step_traffic``) against what the
layers issue through ``PCPContext`` on real gloo ranks (pcp 2, 4, 8; attention, the GDN modes, the
output gather): call for call, bytes and peers, so the model cannot drift from the code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks import step_traffic
from harness.dist import run_distributed

SHAPE = step_traffic.LayerShape(kv_heads=2, head_dim=8, gdn_k_heads=2, gdn_v_heads=4, gdn_head_k=8,
                                gdn_head_v=8, conv_width=4, hidden=16, act_bytes=4)
# a decode row, a short prompt, a fresh prompt and a continuing one long enough to split at pcp=8
BATCH = ([37, 0, 0, 90], [1, 40, 1500, 1100])


class ShapeKernels:
    """The GDN kernels' contract (``gdn_kernels.VllmGDNKernels``) with outputs of the right shapes only: the
    collectives a mode issues depend on the plan and the shapes, not on the values."""

    @staticmethod
    def conv(x, weight, bias, init_states, seqs, activation="silu"):
        return x.clone()

    @staticmethod
    def prep(y, a, b, w):
        T, s = y.shape[0], SHAPE
        q = torch.zeros(T, s.gdn_k_heads, s.gdn_head_k)
        return q, q.clone(), torch.zeros(T, s.gdn_v_heads, s.gdn_head_v), a.float(), b.float()

    @staticmethod
    def chunk_local(q, k, v, g, beta, seqs):
        return v

    @staticmethod
    def chunk_states(prep, lo, hi, init, seqs):
        return init.clone(), None

    @staticmethod
    def chunk_outputs(prep, lo, hi, pending, seqs):
        return prep[lo:hi]

    @staticmethod
    def chunk(q, k, v, g, beta, init, seqs, scale=None):
        return torch.zeros(v.shape), torch.zeros(init.shape)


def _every_mode(rank, group):
    """``_issued`` for every GDN mode and layout, in one set of ranks."""
    cases = {(mode, layout): _issued(rank, group, mode, layout) for mode in ("relay", "state_passing", "island")
             for layout in ("zigzag", "contiguous")}
    # decode="spread": the decode row on rank 1 alone
    cases.update({(mode, "spread"): _issued(rank, group, mode, "zigzag", owner=[1, -1, -1, -1])
                  for mode in ("relay", "state_passing", "island")})
    return cases


def _issued(rank, group, mode, layout, owner=None):
    """Each layer kind's calls as this rank's contexts recorded them, with the model's for the same plan."""
    from qwen36_pcp.config import PCPConfig
    from qwen36_pcp.layers.context import PCPContext
    from qwen36_pcp.layers.gdn_cp import gdn_island, gdn_relay, gdn_state_passing
    from qwen36_pcp.layers.gdn_kernels import GDNWeights
    from qwen36_pcp.layers.split_attention import gather_kv_for_cache
    from qwen36_pcp.plan import PCPPlan

    s = SHAPE
    plan = PCPPlan(*BATCH, group.world_size, rank, PCPConfig(layout=layout, min_split_tokens=512), owner)
    assert plan.split.tolist() == [False, False, True, True]
    t, reqs = plan.t_pad, plan.num_reqs

    def calls(ctx):
        return [(c.kind, c.nbytes, c.peer) for c in ctx.collectives]

    issued = {}
    ctx = PCPContext(plan, group, "cpu")
    kv = torch.zeros(t, s.kv_heads, s.head_dim)
    gather_kv_for_cache(ctx, kv, kv, torch.arange(plan.num_tokens))
    issued["attention"] = calls(ctx)
    ctx = PCPContext(plan, group, "cpu")
    qkv, ab = torch.zeros(t, s.conv_dim), torch.zeros(t, s.gdn_v_heads)
    out = torch.zeros(t, s.gdn_v_heads, s.gdn_head_v)
    if mode == "island":
        gdn_island(ctx, lambda *args: None, qkv, ab, ab, out)
    else:
        w = GDNWeights(torch.zeros(s.conv_dim, s.conv_width), None, torch.zeros(s.gdn_v_heads),
                       torch.zeros(s.gdn_v_heads), s.gdn_k_heads, s.gdn_head_k, s.gdn_head_v)
        conv = torch.zeros(reqs + 1, s.conv_dim, s.conv_width - 1)
        ssm = torch.zeros(reqs + 1, s.gdn_v_heads, s.gdn_head_v, s.gdn_head_k)
        core = gdn_relay if mode == "relay" else gdn_state_passing
        core(ctx, ShapeKernels, qkv, ab, ab, out, w, conv, ssm, torch.arange(1, reqs + 1))
    issued["gdn"] = calls(ctx)
    for all_rows in (False, True):
        ctx = PCPContext(plan, group, "cpu")
        ctx.gather_output(torch.zeros(t, s.hidden), all_rows)
        issued[f"output all_rows={all_rows}"] = calls(ctx)
    modelled = {"attention": step_traffic.attention(plan, s), "gdn": step_traffic.gdn(plan, s, mode, rank),
                **{f"output all_rows={a}": step_traffic.output(plan, s, a) for a in (False, True)}}
    return issued, modelled


def _spread_decode_step(rank, group, layers=3):
    """A spread decode step's calls (``layers`` attention layers' K/V from their stage, then the output
    gather) as this rank's context recorded them, with the model's."""
    from harness.runner_stand_in import exchange_slots, pcp_attention_layers
    from qwen36_pcp.config import PCPConfig
    from qwen36_pcp.layers.context import PCPContext
    from qwen36_pcp.plan import PCPPlan
    from qwen36_pcp.spread.owned_batch import KVStage, defer_staged_kv

    s, reqs = SHAPE, 5
    plan = PCPPlan([40, 9, 3, 70, 12], [1] * reqs, group.world_size, rank, PCPConfig(decode="spread"),
                   np.arange(reqs) % group.world_size, min_rows=4)
    assert plan.decode_spread_only
    ctx = PCPContext(plan, group, "cpu")
    attention = pcp_attention_layers([torch.zeros(2, 4, 8, s.kv_heads, s.head_dim) for _ in range(layers)])
    KVStage(attention, plan.t_pad, torch.float32, "cpu")
    defer_staged_kv(ctx, attention, exchange_slots(plan, torch.arange(reqs)))
    ctx.gather_output(torch.zeros(plan.t_pad, s.hidden), all_rows=False)
    modelled = step_traffic.attention(plan, s) * layers + step_traffic.output(plan, s, False, layers)
    return [(c.kind, c.nbytes, c.peer) for c in ctx.collectives], modelled


@pytest.mark.parametrize("world_size", [2, 4])
def test_spread_decode_step_is_one_collective(world_size):
    for issued, modelled in run_distributed(_spread_decode_step, world_size):
        assert issued == modelled and len(issued) == 1


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_model_counts_what_the_layers_issue(world_size):
    for rank, cases in enumerate(run_distributed(_every_mode, world_size)):
        for (mode, layout), (issued, modelled) in cases.items():
            assert issued == modelled, (mode, layout, rank)
        # the relay: each run's end state goes to the next run's owner alone, then one broadcast
        gdn = cases[("relay", "zigzag")][0]["gdn"]
        sends = [c for c in gdn if c[0] == "send"]
        assert sends and all(nbytes == 2 * SHAPE.state_bytes and peer != rank for _, nbytes, peer in sends)
        assert gdn[-1] == ("broadcast", 2 * SHAPE.state_bytes, 0)  # zigzag: rank 0 owns the last block
