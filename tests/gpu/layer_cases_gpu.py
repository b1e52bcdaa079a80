# SPDX-License-Identifier: Apache-2.0
"""GPU layer comparisons (bf16, vLLM's kernels) of every PCP rank against the unsplit kernels.

Each function is one rank's part; it runs under ``replay`` (every rank in one process on one GPU) or
``run_distributed(..., backend="nccl")`` (one GPU per rank) alike.
"""

from __future__ import annotations

import torch

from harness.layer_inputs import ATTN, GDN, gdn_inputs
from qwen36_pcp.config import PCPConfig
from qwen36_pcp.layers.context import PCPContext
from qwen36_pcp.layers.gdn_kernels import VllmGDNKernels
from qwen36_pcp.layers.split_attention import attend_local_flash, gather_kv_for_cache
from qwen36_pcp.plan import PCPPlan
from tests.gdn_sweep import case_name, compare, errors, full_core, rank_modes, sweep_batches, sweep_configs

# fresh prompt, decode row, continuation, short prompt
ATTENTION_BATCH = ([0, 0, 1500, 40], [8192, 1, 3000, 7])


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _layout(num_computed, num_new, bs, device):
    total = [c + n for c, n in zip(num_computed, num_new)]
    nblk = [-(-t // bs) for t in total]
    table = torch.zeros(len(total), max(nblk), dtype=torch.int32, device=device)
    nxt = 1
    for i, nb in enumerate(nblk):
        table[i, :nb] = torch.arange(nxt, nxt + nb, device=device)
        nxt += nb
    slots = torch.cat([
        table[i, torch.arange(c, c + n, device=device) // bs].long() * bs
        + torch.arange(c, c + n, device=device) % bs
        for i, (c, n) in enumerate(zip(num_computed, num_new))
    ])
    return table, slots, nxt


def max_abs(got, ref) -> float:
    return errors(got, ref)["max_abs"]  # inf where got has NaN/Inf


def attention_case(rank, group, layout="zigzag"):
    """Split attention of this rank against the whole batch's flash-attention call -> max abs errors."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import flash_attn as fa

    dev = _device()
    num_computed, num_new = ATTENTION_BATCH
    H, KVH, D, BS = ATTN["heads"], ATTN["kv_heads"], ATTN["head_dim"], ATTN["block_size"]
    g = torch.Generator(device=dev).manual_seed(0)
    T = sum(num_new)
    q, k, v = (torch.randn(T, n, D, device=dev, generator=g, dtype=torch.bfloat16) for n in (H, KVH, KVH))
    table, slots, nblocks = _layout(num_computed, num_new, BS, dev)
    caches = [torch.randn(nblocks, BS, KVH, D, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2)]
    one = torch.ones((), device=dev)
    scale = D**-0.5
    ref_k, ref_v = caches[0].clone(), caches[1].clone()
    ops.reshape_and_cache_flash(k, v, ref_k, ref_v, slots, "auto", one, one)
    cu = torch.tensor([0] + list(torch.tensor(num_new).cumsum(0)), dtype=torch.int32, device=dev)
    used = torch.tensor([c + n for c, n in zip(num_computed, num_new)], dtype=torch.int32, device=dev)
    ref = torch.empty_like(q)
    fa.flash_attn_varlen_func(q=q, k=ref_k, v=ref_v, out=ref, cu_seqlens_q=cu, max_seqlen_q=max(num_new),
                              seqused_k=used, max_seqlen_k=int(used.max()), softmax_scale=scale, causal=True,
                              block_table=table, fa_version=3)
    plan = PCPPlan(num_computed, num_new, group.world_size, rank, PCPConfig(layout=layout, min_split_tokens=1))
    assert plan.split.tolist() == [True, False, True, False]
    ctx = PCPContext(plan, group, dev)
    idx = ctx.t.local_idx
    kc, vc = caches[0].clone(), caches[1].clone()
    k_all, v_all, gslots = gather_kv_for_cache(ctx, k[idx], v[idx], slots)
    ops.reshape_and_cache_flash(k_all, v_all, kc, vc, gslots, "auto", one, one)
    out = torch.empty(plan.t_pad, H, D, device=dev, dtype=torch.bfloat16)
    attend_local_flash(ctx, q[idx], kc, vc, table, out, softmax_scale=scale, fa_version=3)
    n = plan.num_local_tokens
    return {"output": max_abs(out[:n], ref[idx[:n]]), "cache_k": max_abs(kc, ref_k),
            "cache_v": max_abs(vc, ref_v)}


def gdn_sweep_case(rank, group):
    """The GDN sweep (``tests.gdn_sweep``) with vLLM's kernels at the 35B-A3B GDN shape -> failures,
    and the largest errors per mode."""
    from qwen36_pcp.deterministic_gdn import pin_gdn_configs

    pin_gdn_configs()  # as every engine at pcp > 1: one GDN output whatever the autotuners pick
    dev = _device()
    failures, worst = [], {}
    for config in sweep_configs():
        for seed, (num_computed, num_new) in enumerate(sweep_batches(group.world_size, config)):
            inp, w = gdn_inputs(num_computed, num_new, dev, seed=seed)
            shape = (sum(num_new), GDN["hv"], GDN["dv"])
            ref = full_core(VllmGDNKernels, inp, w, num_computed, num_new, shape, torch.bfloat16)
            rows, got = rank_modes(rank, group, VllmGDNKernels, inp, w, num_computed, num_new, config, dev)
            for mode, tensors in compare(rows, got, ref).items():
                for name, e in tensors.items():
                    rel = e["max_abs"] / max(e["ref_max"], 1e-12)
                    w_ = worst.setdefault(f"{mode} {name}", 0.0)
                    worst[f"{mode} {name}"] = max(w_, rel)
                    # relay and island cut pcp=1's chunks: bit for bit; state passing adds a bf16
                    # correction; the conv state is a copy in every mode
                    exact = mode != "state_passing" or name == "conv"
                    limit = 0.0 if exact else (2e-2 if name == "out" else 1e-2)
                    if not e["finite"] or rel > limit:
                        failures.append(f"{case_name(config, group.world_size, num_computed, num_new)} "
                                        f"{mode} {name}: max_abs {e['max_abs']:.3g} (rel {rel:.3g})")
    return failures, worst
