# SPDX-License-Identifier: Apache-2.0
"""GDN context parallel on 2, 4 and 8 gloo ranks == the unsplit chunked scan (fp32)."""

import numpy as np
import pytest
import torch

from harness.dist import run_distributed
from qwen36_pcp.layers.context import PCPContext
from qwen36_pcp.layers.device_copy import Varlen
from qwen36_pcp.layers.gdn_cp import conv_with_halo
from qwen36_pcp.plan import PCPConfig, PCPPlan

from .gdn_reference import TorchGDNKernels
from .gdn_sweep import (
    case_name,
    compare,
    full_core,
    rank_modes,
    sweep_batches,
    sweep_configs,
    unaligned_blocks,
    worst_of,
)
from .layer_cases import cu_of, gdn_case


def _random_scan_inputs(seed, T, H=2, HV=4, K=8, V=8, S=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    v = torch.randn(T, HV, V, generator=g)
    gate = -torch.rand(T, HV, generator=g) * torch.tensor([0.02, 0.2, 1.0, 4.0])[:HV]
    beta = torch.rand(T, HV, generator=g)
    h0 = torch.randn(S, HV, V, K, generator=g) * 0.5  # V-first
    return q, k, v, gate, beta, h0


def test_recurrent_reference_matches_fla_naive_reference():
    """Our token-by-token scan (V-first state, GVA) against fla's naive recurrent gated delta rule."""
    from fla.ops.gated_delta_rule import naive_recurrent_gated_delta_rule

    T, H, HV, K = 19, 2, 4, 8
    q, k, v, gate, beta, h0 = _random_scan_inputs(0, T)
    cu = torch.tensor([0, T], dtype=torch.int32)
    o, final = TorchGDNKernels.recurrent(q, k, v, gate, beta, h0, cu)
    rep = lambda x: x.repeat_interleave(HV // H, 1)[None]  # noqa: E731
    o_ref, s_ref = naive_recurrent_gated_delta_rule(
        rep(q), rep(k), v[None], beta[None], gate[None], scale=K**-0.5,
        initial_state=h0.transpose(-1, -2), output_final_state=True,
    )
    torch.testing.assert_close(o, o_ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, s_ref.transpose(-1, -2), rtol=1e-5, atol=1e-5)


def test_chunked_reference_matches_recurrent_and_sees_a_wrong_chunk_grid():
    """The chunked form (64-token chunks from each sequence start) equals the token-by-token scan for
    sequences shorter than, equal to and longer than a chunk; and, like fla's kernels, it is wrong when
    its state stage walks another chunk grid than its chunk-local stage did."""
    lens = [1, 63, 64, 65, 200, 130]
    cu = cu_of(lens)
    q, k, v, gate, beta, h0 = _random_scan_inputs(1, sum(lens), S=len(lens))
    o, final = TorchGDNKernels.chunk(q, k, v, gate, beta, h0, Varlen(cu, cu))
    o_ref, final_ref = TorchGDNKernels.recurrent(q, k, v, gate, beta, h0, cu)
    torch.testing.assert_close(o.float(), o_ref, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(final, final_ref, rtol=1e-5, atol=2e-5)
    # sequences 4 and 5 (200 + 130 tokens) scanned as one by the state stage, as a relay run would
    # scan two adjacent blocks: right when the first is whole chunks, wrong otherwise
    for first, ok in ((192, True), (200, False)):
        lens2 = [1, 63, 64, 65, first, 330 - first]
        cu_local, cu_run = cu_of(lens2), cu_of([1, 63, 64, 65, 330])
        local, run = Varlen(cu_local, cu_local), Varlen(cu_run, cu_run)
        prep = TorchGDNKernels.chunk_local(q, k, v, gate, beta, local)
        fin, pend = TorchGDNKernels.chunk_states(prep, 0, sum(lens2), h0[:5], run)
        out = TorchGDNKernels.chunk_outputs(prep, 0, sum(lens2), pend, run)
        ref, ref_fin = TorchGDNKernels.recurrent(q, k, v, gate, beta, h0[:5], cu_run)
        err = (out.float() - ref).abs().max().item()
        assert (err < 2e-5) == ok, (first, err)


def _sweep_worker(rank, group, broken=False):
    """Every config, batch and mode of the sweep on this rank -> (failures, worst errors)."""
    if broken:
        unaligned_blocks()
    reports, failures = [], []
    for config in sweep_configs():
        for seed, (num_computed, num_new) in enumerate(sweep_batches(group.world_size, config)):
            inp, w = gdn_case(seed, num_computed, num_new)
            shape = (sum(num_new), inp["a"].shape[1], w.head_v_dim)
            ref = full_core(TorchGDNKernels, inp, w, num_computed, num_new, shape, torch.float32)
            rows, got = rank_modes(rank, group, TorchGDNKernels, inp, w, num_computed, num_new, config, "cpu")
            report = compare(rows, got, ref)
            reports.append(report)
            for mode, tensors in report.items():
                for name, e in tensors.items():
                    # fp32 rounding only; the conv state is a copy
                    limit = 0.0 if name == "conv" else 2e-5 * max(1.0, e["ref_max"])
                    if not e["finite"] or e["max_abs"] > limit:
                        failures.append(f"{case_name(config, group.world_size, num_computed, num_new)} "
                                        f"{mode} {name}: {e}")
    return failures, worst_of(reports)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_every_split_matches_the_unsplit_chunked_scan(world_size):
    """Relay, state passing and island on 2, 4 and 8 gloo ranks against the unsplit core, with fla's
    64-token chunk structure in the reference kernels, over the sweep's boundary lengths."""
    results = run_distributed(_sweep_worker, world_size)
    failures = [f for fails, _ in results for f in fails]
    print(worst_of([w for _, w in results]))
    assert not failures, "\n".join(failures[:20])


def test_sweep_sees_blocks_off_the_chunk_grid():
    """Negative control: with the split rule from before the split floor (blocks off the 64-token
    grid), the sweep finds the relay wrong, up to Inf/NaN (what pcp=8 gave end to end)."""
    results = run_distributed(_sweep_worker, 2, True)
    failures = [f for fails, _ in results for f in fails]
    assert any(" relay out" in f for f in failures)
    assert any("'finite': False" in f for f in failures)
    assert not any(" island " in f for f in failures)  # island does not depend on the grid


def _conv_worker(rank, group, spec_columns=0):
    """Conv halo alone: split prompts (fresh and continuing), a short prompt and a continuation that
    is not split, so halos come from other ranks' tails, the cache and zeros. ``spec_columns``: the
    cache keeps that many more columns (speculative decoding's verification rows), and the layer hands
    the kernels its first width - 1 (``PCPGatedDeltaNetAttention._forward_core``): those are read and
    written, the others left as they were."""
    num_computed, num_new = [0, 6, 70, 0], [513, 8, 700, 3]
    case, w = gdn_case(5, num_computed, num_new)
    plan = PCPPlan(num_computed, num_new, group.world_size, rank, PCPConfig(min_split_tokens=1))
    assert plan.split.tolist() == [True, False, True, False]
    rows = torch.from_numpy(plan.local_full_idx[rank]).clamp(min=0)
    ctx = PCPContext(plan, group, "cpu")
    conv_state = case["conv_state"].clone()
    extra = torch.randn(*conv_state.shape[:-1], spec_columns, generator=torch.Generator().manual_seed(3))
    wide = torch.cat([conv_state, extra.to(conv_state.dtype)], -1)
    conv_state = wide[..., : conv_state.shape[-1]]
    y = conv_with_halo(ctx, TorchGDNKernels, case["mixed_qkv"][rows], w, conv_state, case["state_idx"])
    assert torch.equal(wide[..., conv_state.shape[-1]:], extra.to(wide.dtype))
    ref_state = case["conv_state"].clone()
    init = torch.where(torch.tensor(num_computed)[:, None, None] > 0,
                       case["conv_state"][case["state_idx"]], 0.0)
    cu = cu_of(num_new)
    y_ref = TorchGDNKernels.conv(case["mixed_qkv"], w.conv_weight, w.conv_bias, init, Varlen(cu, cu))
    T = plan.num_local_tokens
    torch.testing.assert_close(y, y_ref[rows[:T]], rtol=1e-6, atol=1e-6)
    for i, (c, n) in enumerate(zip(num_computed, num_new)):
        start = int(np.sum(num_new[:i]))
        seq = torch.cat([init[i].T, case["mixed_qkv"][start : start + n]])
        ref_state[case["state_idx"][i]] = seq[-3:].T
    torch.testing.assert_close(conv_state, ref_state, rtol=0, atol=0)
    return True


@pytest.mark.parametrize("spec_columns", [0, 3])
def test_conv_halo_matches_full_conv(spec_columns):
    assert all(run_distributed(_conv_worker, 4, spec_columns))


def test_summary_runs_compose_adjacent_blocks():
    runs = lambda n, layout: PCPPlan([0], [4096], n, 0, PCPConfig(layout=layout)).summary_runs  # noqa: E731
    assert runs(2, "zigzag") == [(0, 0, 0), (1, 1, 2), (0, 3, 3)]
    assert runs(4, "zigzag") == [(0, 0, 0), (1, 1, 1), (2, 2, 2), (3, 3, 4), (2, 5, 5), (1, 6, 6), (0, 7, 7)]
    assert runs(2, "contiguous") == [(0, 0, 0), (1, 1, 1)]


def _exchange_worker(rank, group):
    """The summary exchange alone at the Qwen3.6-35B-A3B GDN shape (32 V heads x 128, K 128)."""
    from qwen36_pcp.layers.gdn_cp import _fold_split_states

    HV, V, K = 32, 128, 128
    plan = PCPPlan([0], [1024], 2, rank, PCPConfig(min_split_tokens=512))
    ctx = PCPContext(plan, group, "cpu")
    T = plan.num_local_tokens
    final = torch.randn(len(plan.local_segments), HV, V + K, K) * 0.01
    o = torch.randn(T, HV, V + K)
    out = o[:, :, :V].clone()
    x_end = _fold_split_states(ctx, o, final, out, V)
    return ctx.bytes_sent, x_end


def test_summary_exchange_sends_6_MiB_per_rank_at_35b_shape():
    """pcp=2 zigzag: rank 0 sends block 0's end state (2 MiB) and block 3's summary (4 MiB), rank 1
    the composed summary of blocks 1-2 (4 MiB, padded to 6)."""
    results = run_distributed(_exchange_worker, 2)
    assert [b for b, _ in results] == [6 * 2**20, 6 * 2**20]
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)


def _replicated_worker(rank, group):
    """Rank 1 computes the replicated requests from other inputs than rank 0 (as if its kernels had
    rounded differently): every rank must still keep rank 0's conv and SSM states."""
    num_computed, num_new = [5, 0, 0], [1, 40, 300]  # a decode row, a short prompt, a split prompt
    inp, w = gdn_case(3, num_computed, num_new)
    ref = full_core(TorchGDNKernels, inp, w, num_computed, num_new, (341, 4, 8), torch.float32)
    if rank == 1:  # the replicated requests come first in the local layout, as in the full batch
        for name in ("mixed_qkv", "a", "b"):
            inp[name] = inp[name].clone()
            inp[name][:41] += 0.5
    rows, got = rank_modes(rank, group, TorchGDNKernels, inp, w, num_computed, num_new,
                           PCPConfig(min_split_tokens=1), "cpu")
    return {mode: (conv, ssm) for mode, (_, conv, ssm) in got.items()}, ref


def test_replicated_requests_keep_rank0_states():
    results = run_distributed(_replicated_worker, 2)
    (_, ref_conv, ref_ssm) = results[0][1]
    for mode in ("relay", "state_passing", "island"):
        for states, _ in results:
            conv, ssm = states[mode]
            torch.testing.assert_close(conv, ref_conv, rtol=0, atol=0)
            torch.testing.assert_close(ssm, ref_ssm, rtol=1e-6, atol=2e-6)
        torch.testing.assert_close(results[0][0][mode][1], results[1][0][mode][1], rtol=0, atol=0)


def _owned_worker(rank, group):
    """decode="spread": decode rows owned by ranks 1, 0 and (pcp=4) 3 beside a replicated short prompt
    and a split prompt. Every rank but a row's owner holds a stale copy of its states (as after the
    owner decoded alone), so a row computed, or a state kept, from any copy but the owner's differs."""
    world = group.world_size
    num_computed, num_new = [5, 9, 0, 0, 33], [1, 1, 40, 300, 1]
    owner = np.array([1, 0, -1, -1, world - 1])
    inp, w = gdn_case(7, num_computed, num_new)
    ref = full_core(TorchGDNKernels, inp, w, num_computed, num_new, (343, 4, 8), torch.float32)
    for i in np.flatnonzero((owner >= 0) & (owner != rank)):
        line = inp["state_idx"][i]
        for name in ("conv_state", "ssm_state"):
            inp[name] = inp[name].clone()
            inp[name][line] += 0.25
    rows, got = rank_modes(rank, group, TorchGDNKernels, inp, w, num_computed, num_new,
                           PCPConfig(min_split_tokens=1), "cpu", owner)
    return rows, got, ref, owner


@pytest.mark.parametrize("world_size", [2, 4])
def test_owned_decode_rows_use_and_keep_the_owners_states(world_size):
    results = run_distributed(_owned_worker, world_size)
    for rank, (rows, got, (ref_out, ref_conv, ref_ssm), owner) in enumerate(results):
        lines = [int(x) for x in gdn_case(7, [5, 9, 0, 0, 33], [1, 1, 40, 300, 1])[0]["state_idx"]]
        mine = [lines[i] for i in range(5) if owner[i] in (-1, rank)]  # whole here: replicated, split, owned
        for mode in ("relay", "state_passing", "island"):
            out, conv, ssm = got[mode]
            torch.testing.assert_close(out, ref_out.index_select(0, rows), rtol=1e-5, atol=2e-5)
            torch.testing.assert_close(conv[mine], ref_conv[mine], rtol=0, atol=0)
            torch.testing.assert_close(ssm[mine], ref_ssm[mine], rtol=1e-5, atol=2e-5)
        # an owned row is computed on its owner alone (rows of requests 0, 1, 4: 0, 1, 342)
        for row, o in zip((0, 1, 342), owner[[0, 1, 4]]):
            assert (row in rows.tolist()) == (o == rank)


def _handover_worker(rank, group):
    """Requests 0 and 2 decoded on ranks 1 and 0 alone; every rank holds other (stale) copies of their
    states until the hand-over."""
    from qwen36_pcp.layers.gdn_cp import hand_over_states

    plan = PCPPlan([9, 4, 30], [5, 1, 40], group.world_size, rank, PCPConfig(), handover=np.array([1, -1, 0]))
    ctx = PCPContext(plan, group, "cpu")
    conv = torch.full((6, 8, 3), float(rank))
    ssm = torch.full((6, 2, 4, 4), 10.0 + rank)
    state_idx = torch.tensor([4, 1, 2])
    hand_over_states(ctx, (conv, ssm), state_idx)
    return conv, ssm, ctx.bytes_sent


def test_hand_over_sends_the_owners_states_to_every_rank():
    for rank, (conv, ssm, sent) in enumerate(run_distributed(_handover_worker, 2)):
        assert (conv[4] == 1).all() and (ssm[4] == 11).all()  # request 0: rank 1's
        assert (conv[2] == 0).all() and (ssm[2] == 10).all()  # request 2: rank 0's
        assert (conv[1] == rank).all() and (ssm[[0, 1, 3, 5]] == 10 + rank).all()  # the rest untouched
        assert sent == (8 * 3 + 2 * 4 * 4) * 4  # each rank sources the states of one request
