# SPDX-License-Identifier: Apache-2.0
"""Gated DeltaNet context parallel: each rank scans only its own segments.

``relay`` (default, exact): blocks lie on whole 64-token chunks, and each run of adjacent blocks is
scanned from the true end state of the run before it (sent to the next run's owner alone; the last
owner broadcasts the final states), so every output and state is bit for bit the one-GPU scan's. Only the state
recurrence is serial along the
chain; the chunk-local steps (cumsum, K K^T, its solve, the WY factors) run for all local tokens at
once, and the outputs after the state is sent.

``state_passing`` (one all-gather per layer, nothing serial, a bf16 correction: not bitwise). State
layout is vLLM's (V-first): a value head's state X is [V, K],
X_t = a_t X_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T,  o_t = X_t (scale q_t).
A segment is affine in its initial state: X_end = X_0 P + L and o_t = o_t^loc + X_0 c_t with
P = prod_t a_t (I - b_t k_t k_t^T) and c_t = P_{<=t} scale q_t. One chunk-kernel call per rank gets all
of it: append K zero columns to v and K identity rows to the initial state ([X_0 | I] stacked as
[V+K, K]); the extra rows of the final state are P, the extra output columns are c_t. The [V+K, K] fp32
summaries of the split segments are all-gathered once per layer, folded in order on every rank
(X_in(b) = X_end(b-1), X_end(b) = X_in(b) P_b + L_b, block 0 started from the cached state), and each
output gets its correction with one small GEMM. Every rank ends with each request's final recurrent
state and conv state, so decode runs replicated.

Short conv halo: a segment's first width-1 inputs come from the previous segment (another rank's tail,
all-gathered), from the cached conv state (continuation), or are zeros (true sequence start).

``island`` mode gathers the whole batch instead and runs the plain GDN core (reference and fallback).
Kernels are passed in: ``gdn_kernels.VllmGDNKernels`` (vLLM's Triton kernels) or any object with the same contract
(the tests' fp32 torch reference with the same 64-token chunk structure). Sequences reach the kernels
as ``context.Varlen``, which keeps their launch metadata for the step.
"""

from __future__ import annotations

import torch

from .context import PCPContext
from .gdn_kernels import GDNWeights, augmented_values


# ------------------------------------------------------------------------------ conv halo
def conv_with_halo(ctx: PCPContext, kernels, mixed_qkv, w: GDNWeights, conv_state, state_idx):
    """Short conv of this rank's segments; writes each request's new conv state on every rank.

    conv_state: [lines, D, W-1] view of the cache (oldest input first); state_idx: [R] cache lines.
    """
    T = ctx.t.num_local_tokens
    width = w.conv_weight.shape[1]
    w1 = width - 1
    index = ctx.conv_index(width)
    D = mixed_qkv.shape[1]
    tails = ctx.all_gather(mixed_qkv.index_select(0, index.tail_rows.reshape(-1)))  # [N*S*w1, D]
    cached = conv_state.index_select(0, state_idx).transpose(1, 2).reshape(-1, D)  # [R*w1, D]
    table = torch.cat([tails, cached.to(tails.dtype), tails.new_zeros(1, D)], 0)
    # [S, W-1, D] storage viewed as [S, D, W-1]: the layout of vLLM's default ("SD") conv-state cache
    halo = table.index_select(0, index.halo.reshape(-1)).view(-1, w1, D).to(mixed_qkv.dtype)
    new_state = table.index_select(0, index.final.reshape(-1)).view(-1, w1, D).transpose(1, 2)
    conv_state[state_idx] = new_state.to(conv_state.dtype)
    return kernels.conv(mixed_qkv[:T], w.conv_weight, w.conv_bias, halo.transpose(1, 2), ctx.t.segments,
                        w.activation)


# ------------------------------------------------------------------------------ hand-over
def hand_over_states(ctx: PCPContext, caches, state_idx) -> None:
    """The GDN states of the requests the plan hands over (``PCPPlan.handovers``: decoded on one rank
    alone, computed by every rank now) from that rank to every rank, before the step reads them.

    caches: the layer's state tensors (conv, SSM), one cache line per request (``state_idx`` [R])."""
    for req, src in ctx.plan.handovers:
        line = state_idx[req : req + 1]
        for cache in caches:
            cache.index_copy_(0, line, ctx.broadcast(cache.index_select(0, line), src))


# --------------------------------------------------------------------------- state passing
def gdn_state_passing(ctx: PCPContext, kernels, mixed_qkv, b, a, core_attn_out, w: GDNWeights,
                      conv_state, ssm_state, state_idx):
    """GDN core (conv + gated delta rule) of this rank's tokens, exact up to kernel rounding.

    mixed_qkv [t_pad, D] (pre-conv), b/a [t_pad, HV], core_attn_out [t_pad, HV, V] (rows past the local
    tokens are left as they are), ssm_state [lines, HV, V, K], state_idx [R] cache line per request.
    """
    plan = ctx.plan
    T = ctx.t.num_local_tokens
    y = conv_with_halo(ctx, kernels, mixed_qkv, w, conv_state, state_idx)
    q, k, v, g, beta = kernels.prep(y, a[:T], b[:T], w)
    HV, V = v.shape[1], v.shape[2]
    K = k.shape[2]
    idx = ctx.state_passing
    seg_req = ctx.t.seg_req

    # [X_0 | I] initial states; X_0 from the cache for a request's first segment on continuation
    num_segs = seg_req.shape[0]
    init = torch.zeros(num_segs, HV, V + K, K, dtype=torch.float32, device=v.device)
    init[:, :, V:, :] = torch.eye(K, dtype=torch.float32, device=v.device)
    cached = ssm_state.index_select(0, state_idx.index_select(0, seg_req)).float()
    init[:, :, :V, :] = torch.where(idx.starts_from_cache[:, None, None, None], cached, 0.0)

    v_aug = augmented_values(v, K)
    o, final = kernels.chunk(q, k, v_aug, g, beta, init, ctx.t.segments)

    core_attn_out[:T] = o[:, :, :V]
    if len(plan.split_reqs):  # every rank takes part in the gather, corrections or not
        x_end = _fold_split_states(ctx, o, final, core_attn_out, V)
        ssm_state[state_idx.index_select(0, idx.split_reqs)] = x_end.to(ssm_state.dtype)
    if idx.replicated_slots.numel():
        _keep_whole_states(ctx, ssm_state, state_idx, idx.replicated_reqs, idx.num_replicated,
                           final.index_select(0, idx.replicated_slots)[:, :, :V, :])


def _keep_whole_states(ctx: PCPContext, ssm_state, state_idx, reqs, num_replicated: int, final):
    """Write the final SSM states of the requests computed whole: the replicated ones (the first
    ``num_replicated``) as rank 0 computed them, on every rank; the ones this rank owns (decode
    spread) on this rank alone, which holds their true state while they decode."""
    if num_replicated:
        rep = ctx.broadcast_primary(final[:num_replicated])
        ssm_state[state_idx.index_select(0, reqs[:num_replicated])] = rep.to(ssm_state.dtype)
    if reqs.shape[0] > num_replicated:
        ssm_state[state_idx.index_select(0, reqs[num_replicated:])] = final[num_replicated:].to(ssm_state.dtype)


def _compose(s, nxt, V):
    """Summary of two consecutive blocks: X -> (X P_a + L_a) P_b + L_b; s, nxt [.., V+K, K] (or s [.., V, K])."""
    out = s @ nxt[..., V:, :]
    out[..., :V, :] += nxt[..., :V, :]
    return out


def _fold_split_states(ctx: PCPContext, o, final, core_attn_out, V):
    """Exchange the split requests' block summaries, fold them in chain order, correct this rank's
    outputs (o = o_local + X_in c_t) and return every split request's end state [Rs, HV, V, K] (fp32).

    A rank sends one summary per run of consecutive blocks it owns ([V+K, K] per head), only the end
    state ([V, K]) for the run holding block 0; payloads are padded to the largest rank's.
    """
    plan = ctx.plan
    idx = ctx.state_passing
    slots, slots_dev = idx.block_slots, idx.block_slots_dev
    num_split, HV, VK, K = len(plan.split_reqs), final.shape[1], final.shape[2], final.shape[3]

    def numel(first):
        return num_split * HV * (V if first == 0 else VK) * K

    sizes = [sum(numel(f) for own, f, _ in plan.summary_runs if own == r) for r in range(plan.world_size)]
    local = {blk: final.index_select(0, dev) for blk, dev in slots_dev.items()}  # [Rs, HV, V+K, K]
    payload = final.new_zeros(max(sizes))
    offset = 0
    for own, first, last in plan.summary_runs:
        if own != plan.rank:
            continue
        s = local[first]
        for blk in range(first + 1, last + 1):
            s = _compose(s, local[blk], V)
        s = s[:, :, :V] if first == 0 else s
        payload[offset : offset + s.numel()] = s.reshape(-1)
        offset += s.numel()
    gathered = ctx.all_gather(payload).view(plan.world_size, -1)

    # fold in chain order: x is the state after the last run folded
    offsets, x, x_in_run = [0] * plan.world_size, None, {}
    for own, first, last in plan.summary_runs:
        n = numel(first)
        s = gathered[own, offsets[own] : offsets[own] + n].view(num_split, HV, -1, K)
        offsets[own] += n
        if first == 0:
            x = s
        else:
            x_in_run[first] = x
            x = _compose(x, s, V)

    # this rank's blocks: X_in of each block, then o += c_t X_in^T per segment (bf16 GEMM, fp32 acc.)
    cu = ctx.t.segments.cu_cpu.tolist()
    for own, first, last in plan.summary_runs:
        if own != plan.rank:
            continue
        x_in = x_in_run.get(first)
        for blk in range(first, last + 1):
            if x_in is not None:
                x_t = x_in.transpose(-1, -2).to(o.dtype)  # [Rs, HV, K, V]
                for k, j in enumerate(slots[blk]):
                    r0, r1 = cu[j], cu[j + 1]
                    delta = torch.bmm(o[r0:r1, :, V:].transpose(0, 1), x_t[k])  # [HV, t, V]
                    core_attn_out[r0:r1] += delta.transpose(0, 1).to(core_attn_out.dtype)
            s = local[blk]
            x_in = s[:, :, :V] if x_in is None else _compose(x_in, s, V)
    return x


# ----------------------------------------------------------------------------------- relay
def gdn_relay(ctx: PCPContext, kernels, mixed_qkv, b, a, core_attn_out, w: GDNWeights,
              conv_state, ssm_state, state_idx):
    """GDN core of this rank's tokens, bit for bit one GPU's scan (blocks on whole chunks).

    The split requests' runs of blocks are scanned in chain order, each from the true end state of
    the run before it, which its owner sends to the next run's owner alone (consecutive runs have
    different owners); the last run's owner then broadcasts the final states, which every rank writes
    into its cache. The chunk-local steps run for all local tokens at once and a run's outputs after
    its state is sent, so only the state recurrence is serial. Same arguments as ``gdn_state_passing``.
    """
    plan = ctx.plan
    T = ctx.t.num_local_tokens
    y = conv_with_halo(ctx, kernels, mixed_qkv, w, conv_state, state_idx)
    q, k, v, g, beta = kernels.prep(y, a[:T], b[:T], w)
    idx = ctx.relay
    prep = kernels.chunk_local(q, k, v, g, beta, ctx.t.segments)

    def start_states(reqs, from_cache):
        cached = ssm_state.index_select(0, state_idx.index_select(0, reqs)).float()
        return torch.where(from_cache[:, None, None, None], cached, 0.0)

    rows = idx.replicated_rows
    if rows:
        init = start_states(idx.replicated_reqs, idx.replicated_from_cache)
        final, pending = kernels.chunk_states(prep, 0, rows, init, idx.replicated)
        core_attn_out[:rows] = kernels.chunk_outputs(prep, 0, rows, pending, idx.replicated)
        _keep_whole_states(ctx, ssm_state, state_idx, idx.replicated_reqs, idx.num_replicated, final)
    if not len(plan.split_reqs):
        return
    x = start_states(idx.split_reqs, idx.split_from_cache)  # block 0's start state: on every rank
    chain = plan.summary_runs
    mine = iter(idx.runs)
    for j, (own, _, _) in enumerate(chain):
        if own != plan.rank:
            continue
        if j > 0:
            x = ctx.recv(x, src=chain[j - 1][0])
        run = next(mine)
        x, pending = kernels.chunk_states(prep, run.lo, run.hi, x, run.seqs)
        if j + 1 < len(chain):
            ctx.send(x, dst=chain[j + 1][0])
        core_attn_out[run.lo : run.hi] = kernels.chunk_outputs(prep, run.lo, run.hi, pending, run.seqs)
    x = ctx.broadcast(x, src=chain[-1][0])
    ssm_state[state_idx.index_select(0, idx.split_reqs)] = x.to(ssm_state.dtype)


# ---------------------------------------------------------------------------------- island
def gdn_island(ctx: PCPContext, full_core, mixed_qkv, b, a, core_attn_out):
    """Gather the whole batch, run the plain GDN core on it on every rank, keep the local rows.

    ``full_core(mixed_qkv, b, a, out)`` runs the unsplit core on the full batch layout and writes the
    cache states (in vLLM: ``GatedDeltaNetAttention._forward_core`` with the full-batch metadata).
    """
    t = ctx.t
    n_full = ctx.plan.num_tokens

    def to_full(x):
        return ctx.all_gather(x).index_select(0, t.gathered_of_full)

    full_qkv, full_b, full_a = to_full(mixed_qkv), to_full(b), to_full(a)
    full_out = core_attn_out.new_zeros(n_full, *core_attn_out.shape[1:])
    full_core(full_qkv, full_b, full_a, full_out)
    T = t.num_local_tokens
    core_attn_out[:T] = full_out.index_select(0, t.local_idx[:T])
