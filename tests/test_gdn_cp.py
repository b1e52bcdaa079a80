"""GDN context parallel on 2 and 4 gloo ranks == the full-sequence scan (fp32)."""

import numpy as np
import pytest
import torch

from qwen36_pcp.layers.context import PCPContext
from qwen36_pcp.layers.gdn_cp import (
    GDNWeights,
    TorchGDNKernels,
    conv_with_halo,
    gdn_full_reference,
    gdn_island,
    gdn_relay,
    gdn_state_passing,
)
from qwen36_pcp.plan import PCPConfig, PCPPlan

from qwen36_pcp.tools.dist import run_distributed
from .layer_cases import BATCHES, cu_of, gdn_case


def weights_of(case):
    return GDNWeights(case["conv_weight"], case["conv_bias"], case["A_log"], case["dt_bias"], **case["dims"])


def test_torch_scan_matches_fla_naive_reference():
    """Our fp32 reference scan (V-first state, GVA) against fla's naive recurrent gated delta rule."""
    from fla.ops.gated_delta_rule import naive_recurrent_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    T, H, HV, K, V = 19, 2, 4, 8, 8
    q = torch.nn.functional.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    v = torch.randn(T, HV, V, generator=g)
    gate = -torch.rand(T, HV, generator=g)
    beta = torch.rand(T, HV, generator=g)
    h0 = torch.randn(1, HV, V, K, generator=g)  # V-first
    cu = torch.tensor([0, T], dtype=torch.int32)
    o, final = TorchGDNKernels.chunk(q, k, v, gate, beta, h0, cu, cu)
    rep = lambda x: x.repeat_interleave(HV // H, 1)[None]  # noqa: E731
    o_ref, s_ref = naive_recurrent_gated_delta_rule(
        rep(q), rep(k), v[None], beta[None], gate[None], scale=K**-0.5,
        initial_state=h0.transpose(-1, -2), output_final_state=True,
    )
    torch.testing.assert_close(o, o_ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, s_ref.transpose(-1, -2), rtol=1e-5, atol=1e-5)


def full_reference(case, num_computed, num_new):
    conv_state, ssm_state = case["conv_state"].clone(), case["ssm_state"].clone()
    out = torch.zeros(case["mixed_qkv"].shape[0], case["a"].shape[1], case["dims"]["head_v_dim"])
    gdn_full_reference(TorchGDNKernels, case["mixed_qkv"], case["b"], case["a"], out, weights_of(case),
                       conv_state, ssm_state, case["state_idx"], num_computed, cu_of(num_new))
    return out, conv_state, ssm_state


def _worker(rank, group, layouts):
    worst = {"relay": 0.0, "state_passing": 0.0, "island": 0.0, "bytes": []}
    for (num_computed, num_new), layout in [(b, lay) for b in BATCHES for lay in layouts]:
        case = gdn_case(sum(num_new) + 7 * len(num_new), num_computed, num_new)
        ref_out, ref_conv, ref_ssm = full_reference(case, num_computed, num_new)
        plan = PCPPlan(num_computed, num_new, group.world_size, rank,
                       PCPConfig(layout=layout, min_split_tokens=4))
        rows = torch.from_numpy(plan.local_full_idx[rank]).clamp(min=0)
        T = plan.num_local_tokens
        w = weights_of(case)
        for mode in ("relay", "state_passing", "island"):
            ctx = PCPContext(plan, group, "cpu")
            conv_state, ssm_state = case["conv_state"].clone(), case["ssm_state"].clone()
            out = torch.full((plan.t_pad, case["a"].shape[1], case["dims"]["head_v_dim"]), 7.0)
            local = [case[n][rows] for n in ("mixed_qkv", "b", "a")]
            if mode != "island":
                core = gdn_relay if mode == "relay" else gdn_state_passing
                core(ctx, TorchGDNKernels, *local, out, w, conv_state, ssm_state, case["state_idx"])
                if mode == "state_passing":
                    worst["bytes"].append(ctx.bytes_sent)
            else:
                full_core = lambda qkv, b, a, o: gdn_full_reference(  # noqa: E731
                    TorchGDNKernels, qkv, b, a, o, w, conv_state, ssm_state, case["state_idx"],
                    num_computed, cu_of(num_new))
                gdn_island(ctx, full_core, *local, out)
            torch.testing.assert_close(out[:T], ref_out[rows[:T]], rtol=1e-5, atol=2e-5)
            assert (out[T:] == 7.0).all(), "padding rows must be left alone"
            # every rank holds every request's final states (decode can run on any rank)
            torch.testing.assert_close(conv_state, ref_conv, rtol=0, atol=0)
            torch.testing.assert_close(ssm_state, ref_ssm, rtol=1e-5, atol=2e-5)
            worst[mode] = max(worst[mode], (out[:T] - ref_out[rows[:T]]).abs().max().item())
    return worst


@pytest.mark.parametrize("world_size", [2, 4])
def test_gdn_relay_state_passing_and_island_match_full_scan(world_size):
    results = run_distributed(_worker, world_size, ("zigzag", "contiguous"))
    print({m: max(r[m] for r in results) for m in ("relay", "state_passing", "island")})
    assert max(r["relay"] for r in results) < 2e-5
    assert max(r["state_passing"] for r in results) < 2e-5
    assert max(r["island"] for r in results) < 2e-5


def _conv_worker(rank, group):
    """Conv halo alone, including segments shorter than the kernel (halo spans several segments)."""
    num_computed, num_new = [0, 6, 0], [9, 8, 2]  # 2N-block splits of 8-9 tokens: 1-2 token blocks
    case = gdn_case(5, num_computed, num_new)
    plan = PCPPlan(num_computed, num_new, group.world_size, rank, PCPConfig(min_split_tokens=1))
    rows = torch.from_numpy(plan.local_full_idx[rank]).clamp(min=0)
    ctx = PCPContext(plan, group, "cpu")
    conv_state = case["conv_state"].clone()
    y = conv_with_halo(ctx, TorchGDNKernels, case["mixed_qkv"][rows], weights_of(case), conv_state,
                       case["state_idx"])
    ref_state = case["conv_state"].clone()
    init = torch.where(torch.tensor(num_computed)[:, None, None] > 0,
                       case["conv_state"][case["state_idx"]], 0.0)
    y_ref = TorchGDNKernels.conv(case["mixed_qkv"], case["conv_weight"], case["conv_bias"], init,
                                 None, cu_of(num_new))
    T = plan.num_local_tokens
    torch.testing.assert_close(y, y_ref[rows[:T]], rtol=1e-6, atol=1e-6)
    for i, (c, n) in enumerate(zip(num_computed, num_new)):
        start = int(np.sum(num_new[:i]))
        seq = torch.cat([init[i].T, case["mixed_qkv"][start : start + n]])
        ref_state[case["state_idx"][i]] = seq[-3:].T
    torch.testing.assert_close(conv_state, ref_state, rtol=0, atol=0)
    return True


def test_conv_halo_matches_full_conv():
    assert all(run_distributed(_conv_worker, 4))


def test_summary_runs_compose_adjacent_blocks():
    runs = lambda n, layout: PCPPlan([0], [4096], n, 0, PCPConfig(layout=layout)).summary_runs  # noqa: E731
    assert runs(2, "zigzag") == [(0, 0, 0), (1, 1, 2), (0, 3, 3)]
    assert runs(4, "zigzag") == [(0, 0, 0), (1, 1, 1), (2, 2, 2), (3, 3, 4), (2, 5, 5), (1, 6, 6), (0, 7, 7)]
    assert runs(2, "contiguous") == [(0, 0, 0), (1, 1, 1)]


def _exchange_worker(rank, group):
    """The summary exchange alone at the Qwen3.6-35B-A3B GDN shape (32 V heads x 128, K 128)."""
    from qwen36_pcp.layers.gdn_cp import _fold_split_states

    HV, V, K = 32, 128, 128
    plan = PCPPlan([0], [1024], 2, rank, PCPConfig())
    ctx = PCPContext(plan, group, "cpu")
    T = plan.num_local_tokens
    final = torch.randn(len(plan.local_segments), HV, V + K, K) * 0.01
    o = torch.randn(T, HV, V + K)
    out = o[:, :, :V].clone()
    x_end = _fold_split_states(ctx, o, final, out, V)
    return ctx.bytes_sent, x_end


def test_summary_exchange_sends_6_MiB_per_rank_at_35b_shape():
    """pcp=2 zigzag: rank 0 sends block 0's end state (2 MiB) and block 3's summary (4 MiB), rank 1
    the composed summary of blocks 1-2 (4 MiB, padded to 6): within issue 3's 8 MiB per rank per layer."""
    results = run_distributed(_exchange_worker, 2)
    assert [b for b, _ in results] == [6 * 2**20, 6 * 2**20]
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)
