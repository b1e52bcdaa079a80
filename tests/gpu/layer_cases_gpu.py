"""GPU layer comparisons (2 ranks, NCCL, bf16, vLLM's kernels) against the unsplit kernels on one GPU."""

from __future__ import annotations

import torch

from qwen36_pcp.layers.context import PCPContext
from qwen36_pcp.layers.gdn_cp import VllmGDNKernels, gdn_full_reference, gdn_island, gdn_relay, gdn_state_passing
from qwen36_pcp.layers.split_attention import attend_local_flash, gather_kv_for_cache
from qwen36_pcp.plan import PCPConfig, PCPPlan
from qwen36_pcp.tools.layer_inputs import ATTN, GDN, gdn_inputs

BATCH = ([0, 0, 1500, 40], [8192, 1, 3000, 7])  # fresh, decode row, continuation, short prompt


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


def errors(got, ref):
    """Max abs error, relative to the largest |ref| (max_rel), and relative RMS error."""
    diff = got.float() - ref.float()
    ref_max = max(ref.float().abs().max().item(), 1e-12)
    max_abs = diff.abs().max().item()
    return {"max_abs": max_abs, "max_rel": max_abs / ref_max,
            "rel_rms": (diff.norm() / ref.float().norm().clamp_min(1e-30)).item()}


def attention_case(rank, group, layout="zigzag"):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import flash_attn as fa

    dev = torch.device("cuda", rank)
    num_computed, num_new = BATCH
    H, KVH, D, BS = ATTN["heads"], ATTN["kv_heads"], ATTN["head_dim"], ATTN["block_size"]
    g = torch.Generator(device=dev).manual_seed(0)
    T = sum(num_new)
    q, k, v = (torch.randn(T, n, D, device=dev, generator=g, dtype=torch.bfloat16) for n in (H, KVH, KVH))
    table, slots, nblocks = _layout(num_computed, num_new, BS, dev)
    caches = [torch.randn(nblocks, BS, KVH, D, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2)]
    one = torch.ones((), device=dev)
    scale = D**-0.5
    # reference: the whole batch on one GPU, unsplit
    ref_k, ref_v = caches[0].clone(), caches[1].clone()
    ops.reshape_and_cache_flash(k, v, ref_k, ref_v, slots, "auto", one, one)
    cu = torch.tensor([0] + list(torch.tensor(num_new).cumsum(0)), dtype=torch.int32, device=dev)
    used = torch.tensor([c + n for c, n in zip(num_computed, num_new)], dtype=torch.int32, device=dev)
    ref = torch.empty_like(q)
    fa.flash_attn_varlen_func(q=q, k=ref_k, v=ref_v, out=ref, cu_seqlens_q=cu, max_seqlen_q=max(num_new),
                              seqused_k=used, max_seqlen_k=int(used.max()), softmax_scale=scale, causal=True,
                              block_table=table, fa_version=3)
    # split
    plan = PCPPlan(num_computed, num_new, group.world_size, rank, PCPConfig(layout=layout, min_split_tokens=64))
    ctx = PCPContext(plan, group, dev)
    idx = ctx.t.local_idx
    kc, vc = caches[0].clone(), caches[1].clone()
    k_all, v_all, gslots = gather_kv_for_cache(ctx, k[idx], v[idx], slots)
    ops.reshape_and_cache_flash(k_all, v_all, kc, vc, gslots, "auto", one, one)
    out = torch.empty(plan.t_pad, H, D, device=dev, dtype=torch.bfloat16)
    attend_local_flash(ctx, q[idx], kc, vc, table, out, softmax_scale=scale, fa_version=3)
    n = plan.num_local_tokens
    return {"output": errors(out[:n], ref[idx[:n]]), "cache_k": errors(kc, ref_k),
            "cache_v": errors(vc, ref_v), "bytes_sent": ctx.bytes_sent}


def gdn_case(rank, group, layout="zigzag"):
    dev = torch.device("cuda", rank)
    num_computed, num_new = BATCH
    inp, w = gdn_inputs(num_computed, num_new, dev)
    cu_cpu = torch.tensor([0] + list(torch.tensor(num_new).cumsum(0)), dtype=torch.int32)
    hv, dv = GDN["hv"], GDN["dv"]

    def full(qkv, b, a, out, conv, ssm):
        gdn_full_reference(VllmGDNKernels, qkv, b, a, out, w, conv, ssm, inp["state_idx"], num_computed, cu_cpu)

    ref_out = torch.zeros(sum(num_new), hv, dv, device=dev, dtype=torch.bfloat16)
    ref_conv, ref_ssm = inp["conv_state"].clone(), inp["ssm_state"].clone()
    full(inp["mixed_qkv"], inp["b"], inp["a"], ref_out, ref_conv, ref_ssm)
    plan = PCPPlan(num_computed, num_new, group.world_size, rank, PCPConfig(layout=layout, min_split_tokens=64))
    idx = plan.device_tensors(dev).local_idx
    n = plan.num_local_tokens
    res = {}
    for mode in ("relay", "state_passing", "island"):
        ctx = PCPContext(plan, group, dev)
        conv, ssm = inp["conv_state"].clone(), inp["ssm_state"].clone()
        out = torch.zeros(plan.t_pad, hv, dv, device=dev, dtype=torch.bfloat16)
        local = [inp[k][idx] for k in ("mixed_qkv", "b", "a")]
        if mode != "island":
            core = gdn_relay if mode == "relay" else gdn_state_passing
            core(ctx, VllmGDNKernels, *local, out, w, conv, ssm, inp["state_idx"])
        else:
            gdn_island(ctx, lambda q_, b_, a_, o_: full(q_, b_, a_, o_, conv, ssm), *local, out)
        res[mode] = {"output": errors(out[:n], ref_out[idx[:n]]), "ssm_state": errors(ssm, ref_ssm),
                     "conv_state": errors(conv, ref_conv), "bytes_sent": ctx.bytes_sent}
    return res


def all_cases(rank, group):
    torch.cuda.set_device(rank)
    return {f"{kind}_{layout}": fn(rank, group, layout)
            for layout in ("zigzag", "contiguous")
            for kind, fn in (("attention", attention_case), ("gdn", gdn_case))}
