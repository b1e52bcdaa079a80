# SPDX-License-Identifier: Apache-2.0
"""A split step with MTP verification rows beside it, through the PCP GDN layer on gloo ranks.

The layer's verification rows go to vLLM's own core (``GatedDeltaNetAttention._forward_core``) with
vLLM's metadata narrowed to the requests the rank verifies; the other rows go through the relay with
the plan of the other requests. vLLM's core is a Triton kernel, so here it is stood in for by
``spec_core``: what vLLM's verification reads (each request's rows, its conv window at the
accepted-token offset of its first state block, its SSM state in block ``accepted - 1``) and writes (a
state per row into the request's blocks) — and, for the whole batch, vLLM's mixed path (spec rows by
``spec_token_indx``, the others through the chunked reference). Each rank's rows and states are compared
with that core run once over the whole batch with the whole batch's metadata, as vLLM runs at pcp=1.
It vouches for the rows, indices and counts the layer hands vLLM's core, not for vLLM's kernels (the
GPU end-to-end tests do: ``tests/gpu/test_mtp_load_e2e.py``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from harness.dist import run_distributed
from harness.gdn_unsplit import gdn_unsplit_core

from .gdn_reference import TorchGDNKernels

K = 3  # drafts: each verified request holds 1 + K state blocks, its conv window K more columns
HK, HV, DK, DV, WIDTH = 2, 4, 8, 8, 4
D = 2 * HK * DK + HV * DV
# in the order vLLM's runner puts a batch (requests of at most 1 + K new tokens first): A and C verify 3
# drafts (4 rows), E is a decode row without drafts, B a short prompt, D a split prompt
NUM_COMPUTED, NUM_NEW = [50, 77, 30, 0, 0], [4, 4, 1, 40, 600]
VERIFY = np.array([True, True, False, False, False])
ACCEPTED = [2, 1]  # A's and C's accepted tokens at their previous step
PREFIX = "model.layers.0.linear_attn"


def _case(seed: int = 5):
    """Inputs, weights and caches: conv states [lines, W-1+K, D] (vLLM's default layout), SSM states
    [lines, HV, V, K]; A's blocks 1..4, C's 5..8, E, B, D at lines 9, 10, 11."""
    g = torch.Generator().manual_seed(seed)
    T = sum(NUM_NEW)
    case = {"mixed_qkv": torch.randn(T, D, generator=g), "a": torch.randn(T, HV, generator=g),
            "b": torch.randn(T, HV, generator=g),
            "conv": torch.randn(12, WIDTH - 1 + K, D, generator=g), "ssm": torch.randn(12, HV, DV, DK,
                                                                                       generator=g) * 0.3,
            "conv_weight": torch.randn(D, 1, WIDTH, generator=g) * 0.5, "conv_bias": torch.randn(D, generator=g) * 0.1,
            "A_log": torch.linspace(math.log(0.02), math.log(8.0), HV), "dt_bias": torch.randn(HV, generator=g) * 0.1}
    return case


def _metadata(spec_token_order: bool = True):
    """vLLM's GDN metadata of the whole batch, as its builder makes it for a mixed batch."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    qsl = np.concatenate([[0], np.cumsum(NUM_NEW)])
    spec_rows = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in np.flatnonzero(VERIFY)])
    other_rows = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in np.flatnonzero(~VERIFY)])
    other = np.array(NUM_NEW)[~VERIFY]
    i32 = torch.int32
    return GDNAttentionMetadata(
        num_prefills=3, num_prefill_tokens=int(other.sum()), num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=2, num_spec_decode_tokens=8, num_actual_tokens=int(qsl[-1]),
        has_initial_state=torch.tensor([c > 0 for c, v in zip(NUM_COMPUTED, VERIFY) if not v]),
        spec_query_start_loc=torch.tensor([0, 4, 8], dtype=i32),
        non_spec_query_start_loc=torch.from_numpy(np.concatenate([[0], np.cumsum(other)])).to(i32),
        spec_state_indices_tensor=torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=i32),
        non_spec_state_indices_tensor=torch.tensor([9, 10, 11], dtype=i32),
        spec_sequence_masks=torch.from_numpy(VERIFY), spec_token_indx=torch.from_numpy(spec_rows),
        non_spec_token_indx=torch.from_numpy(other_rows), num_accepted_tokens=torch.tensor(ACCEPTED, dtype=i32))


def _weights(case):
    from qwen36_pcp.layers.gdn_kernels import GDNWeights

    w = case["conv_weight"]
    return GDNWeights(w.view(D, WIDTH), case["conv_bias"], case["A_log"], case["dt_bias"], HK, DK, DV)


def spec_core(layer, mixed_qkv, b, a, core_attn_out):
    """vLLM's ``_forward_core`` stood in for (module docstring): the metadata's verification rows, and
    with a mixed batch the other rows through the chunked reference."""
    from vllm.forward_context import get_forward_context

    meta = get_forward_context().attn_metadata[layer.prefix]
    w = _weights(layer.case)
    conv_full = layer.kv_cache[0].transpose(-1, -2)  # [lines, D, W-1+K]
    ssm = layer.kv_cache[1]
    n = meta.num_actual_tokens
    if meta.num_prefills == 0 and meta.num_decodes == 0:
        spec_rows = torch.arange(n)
    else:
        spec_rows = meta.spec_token_indx.long()
        other = meta.non_spec_token_indx.long()
        out = torch.zeros(other.shape[0], HV, DV)
        state_idx = meta.non_spec_state_indices_tensor.long()
        gdn_unsplit_core(TorchGDNKernels, mixed_qkv[other], b[other], a[other], out, w,
                         conv_full[..., : WIDTH - 1], ssm, state_idx, meta.has_initial_state.int().tolist(),
                         meta.non_spec_query_start_loc.cpu())
        core_attn_out[other] = out
    starts = meta.spec_query_start_loc.tolist()
    for j in range(meta.num_spec_decodes):
        rows = spec_rows[starts[j]: starts[j + 1]]
        gates = torch.arange(starts[j], starts[j + 1])  # vLLM's kernel reads a and b at the spec query starts
        blocks = meta.spec_state_indices_tensor[j].long()
        accepted = int(meta.num_accepted_tokens[j])
        window = conv_full[blocks[0], :, accepted - 1: accepted - 1 + WIDTH - 1]  # [D, W-1]
        x = torch.cat([window.transpose(0, 1), mixed_qkv[rows]], 0)  # [W-1+L, D]
        y = torch.nn.functional.conv1d(x.T[None], w.conv_weight[:, None, :], w.conv_bias, groups=D)[0].T
        y = torch.nn.functional.silu(y)
        conv_full[blocks[0]] = torch.cat([conv_full[blocks[0]].T, x], 0)[-(WIDTH - 1 + K):].T
        q, k, v, g, beta = TorchGDNKernels.prep(y, a[gates], b[gates], w)
        state = ssm[blocks[accepted - 1]][None].clone()
        for t in range(len(rows)):
            o, state = TorchGDNKernels.recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                                                 state, torch.tensor([0, 1]))
            core_attn_out[rows[t]] = o[0]
            ssm[blocks[t]] = state[0]


def _layer(case):
    """A ``PCPGatedDeltaNetAttention`` with the case's weights and caches (not built from a config)."""
    from qwen36_pcp.layers.pcp_gdn import PCPGatedDeltaNetAttention

    layer = object.__new__(PCPGatedDeltaNetAttention)
    torch.nn.Module.__init__(layer)
    layer.conv1d = torch.nn.Conv1d(D, D, WIDTH, groups=D)
    layer.conv1d.weight.data, layer.conv1d.bias.data = case["conv_weight"], case["conv_bias"]
    layer.A_log, layer.dt_bias = case["A_log"], case["dt_bias"]
    layer.num_k_heads, layer.num_v_heads, layer.tp_size = HK, HV, 1
    layer.head_k_dim, layer.head_v_dim, layer.activation, layer.conv_kernel_size = DK, DV, "silu", WIDTH
    layer.prefix, layer.case = PREFIX, case
    layer.kv_cache = (case["conv"].clone(), case["ssm"].clone())
    return layer


def _whole_batch():
    """vLLM at pcp=1: the stand-in core over the whole batch with its mixed metadata."""
    from vllm.forward_context import ForwardContext, override_forward_context

    case = _case()
    layer = _layer(case)
    out = torch.zeros(sum(NUM_NEW), HV, DV)
    with override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata={PREFIX: _metadata()},
                                                 slot_mapping={})):
        spec_core(layer, case["mixed_qkv"], case["b"], case["a"], out)
    return out, layer.kv_cache


def _rank_step(rank, group, owner, broken: bool):
    """This rank's rows of the mixed step through the PCP layer -> (full index of its rows, their
    outputs, its caches)."""
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.model_executor.layers.mamba.gdn_linear_attn import GatedDeltaNetAttention

    from qwen36_pcp.config import PCPConfig
    from qwen36_pcp.layers import pcp_gdn
    from qwen36_pcp.layers.context import PCPContext, running_step
    from qwen36_pcp.plan import PCPPlan

    GatedDeltaNetAttention._forward_core = spec_core
    pcp_gdn.VllmGDNKernels = TorchGDNKernels
    if broken:  # narrowed to the first verified requests, whichever this rank computes
        real = pcp_gdn.verification_metadata

        def first_ones(ctx, meta):
            rows = ctx.verified
            object.__setattr__(rows, "picks", torch.arange(rows.num_reqs))
            return real(ctx, meta)
        pcp_gdn.verification_metadata = first_ones
    plan = PCPPlan(NUM_COMPUTED, NUM_NEW, group.world_size, rank, PCPConfig(min_split_tokens=256),
                   None if owner is None else np.array(owner), verify=VERIFY)
    ctx = PCPContext(plan, group, "cpu")
    case = _case()
    layer = _layer(case)
    rows = torch.from_numpy(plan.local_full_idx[rank].clip(min=0))
    local = [case[name].index_select(0, rows) for name in ("mixed_qkv", "b", "a")]
    out = torch.full((plan.t_pad, HV, DV), 7.0)
    with override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata={PREFIX: _metadata()},
                                                 slot_mapping={})), running_step(ctx):
        layer._forward_core(*local, out)
    n = plan.num_local_tokens
    return rows[:n], out[:n], out[n:], layer.kv_cache, plan.verify_rows(), plan.gdn_plan.num_reqs


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("owner", [None, [1, 0, -1, -1, -1]], ids=["replicated", "spread"])
def test_verification_rows_beside_a_split_prompt_are_vllms_whole_batch(world_size, owner):
    ref_out, (ref_conv, ref_ssm) = _whole_batch()
    for rank, (rows, out, pad, (conv, ssm), verify_rows, others) in enumerate(
            run_distributed(_rank_step, world_size, owner, False)):
        # the rank's verification rows first (A, C; or the one it owns), then E, B and its blocks of D
        mine = [i for i in (0, 1) if owner is None or owner[i] == rank]
        assert verify_rows == 4 * len(mine) and others == 3
        assert rows[:verify_rows].tolist() == [r for i in mine for r in ((0, 1, 2, 3) if i == 0 else (4, 5, 6, 7))]
        torch.testing.assert_close(out, ref_out.index_select(0, rows), rtol=1e-5, atol=2e-5)
        assert (pad == 7.0).all()
        # the verified requests' blocks (A: 1-4, C: 5-8) hold vLLM's states on the ranks that verify them
        lines = [b for i in mine for b in ((1, 2, 3, 4) if i == 0 else (5, 6, 7, 8))]
        torch.testing.assert_close(conv[lines], ref_conv[lines], rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(ssm[lines], ref_ssm[lines], rtol=1e-5, atol=2e-5)
        # the others' states (E, B, D at lines 9-11) on every rank
        torch.testing.assert_close(conv[9:12], ref_conv[9:12], rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(ssm[9:12], ref_ssm[9:12], rtol=1e-5, atol=2e-5)


def test_narrowing_to_other_requests_than_the_ranks_is_seen():
    """The same comparison with the metadata narrowed to the wrong requests (the first verified ones,
    not the rank's own): rank 1 owns A, rank 0 C, so rank 0 verifies C's rows from A's blocks."""
    ref_out, _ = _whole_batch()
    rows, out, *_ = run_distributed(_rank_step, 2, [1, 0, -1, -1, -1], True)[0]
    assert not torch.allclose(out[:4], ref_out.index_select(0, rows[:4]), rtol=1e-3, atol=1e-3)
