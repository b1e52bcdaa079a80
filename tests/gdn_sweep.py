# SPDX-License-Identifier: Apache-2.0
"""The GDN split sweep: every GDN mode on every rank against the unsplit core, over batches whose
lengths straddle every boundary the chunked kernels and the plan have.

Shared by the CPU test (gloo ranks, ``gdn_reference.TorchGDNKernels``) and the GPU test (ranks replayed
in one process, vLLM's Triton kernels). Boundaries: prompts shorter than one chunk, shorter than one
chunk per block (not split), exactly the split threshold and one past it, lengths that are no multiple
of 64, chunked continuations whose cached length is no multiple of 64, and several requests per step
(decode rows, short prompts and two split prompts together).
"""

from __future__ import annotations

import numpy as np
import torch

from harness.gdn_unsplit import gdn_unsplit_core
from qwen36_pcp.config import GDN_CHUNK, PCPConfig
from qwen36_pcp.layers.context import PCPContext
from qwen36_pcp.layers.gdn_cp import gdn_island, gdn_relay, gdn_state_passing
from qwen36_pcp.plan import PCPPlan

from .layer_cases import cu_of

MODES = ("relay", "state_passing", "island")


def sweep_configs() -> list[PCPConfig]:
    """The smallest split threshold of each layout (``min_split_tokens=1``), and one above the floor."""
    return [PCPConfig(layout="zigzag", min_split_tokens=1),
            PCPConfig(layout="contiguous", min_split_tokens=1), PCPConfig(min_split_tokens=512)]


def sweep_batches(world_size: int, config: PCPConfig) -> list[tuple[list[int], list[int]]]:
    """(num_computed, num_new) batches around this layout's and world size's boundaries."""
    floor = GDN_CHUNK * config.num_blocks(world_size)
    thr = config.split_threshold(world_size)
    lengths = sorted({1, 17, 63, 65, 200, floor - 1, thr - 1, thr, thr + 1, thr + 37, 2 * thr + 3 * 64 + 5})
    batches = [([0], [n]) for n in lengths]
    batches += [([100], [thr + 50]), ([3 * 64 + 1], [thr])]  # continuations off the chunk grid
    batches += [([0, 5, 0, 130, 0], [thr + 37, 1, 40, thr + 64, 3])]  # several requests per step
    return batches


def full_core(kernels, inp, w, num_computed, num_new, out_shape, dtype):
    """The unsplit GDN core of the batch -> (out, conv_state, ssm_state)."""
    conv, ssm = inp["conv_state"].clone(), inp["ssm_state"].clone()
    out = torch.zeros(out_shape, dtype=dtype, device=inp["mixed_qkv"].device)
    gdn_unsplit_core(kernels, inp["mixed_qkv"], inp["b"], inp["a"], out, w, conv, ssm,
                       inp["state_idx"], num_computed, cu_of(num_new))
    return out, conv, ssm


def rank_modes(rank, group, kernels, inp, w, num_computed, num_new, config, device, owner=None):
    """This rank's GDN core in every mode -> (full index of each local row, {mode: (out, conv, ssm)});
    ``owner``: the rank that alone computes each request (decode="spread"), -1 elsewhere."""
    plan = PCPPlan(num_computed, num_new, group.world_size, rank, config, owner)
    T = plan.num_local_tokens
    rows = torch.from_numpy(plan.local_full_idx[rank][:T]).to(device)
    hv, dv = inp["a"].shape[1], w.head_v_dim
    dtype = inp["mixed_qkv"].dtype
    local = [inp[k].index_select(0, rows) for k in ("mixed_qkv", "b", "a")]
    pad = plan.t_pad - T
    local = [torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) for x in local]
    got = {}
    for mode in MODES:
        ctx = PCPContext(plan, group, device)
        conv, ssm = inp["conv_state"].clone(), inp["ssm_state"].clone()
        out = torch.full((plan.t_pad, hv, dv), 7.0, dtype=dtype, device=device)
        if mode == "island":
            def core(qkv, b, a, o, conv=conv, ssm=ssm):
                gdn_unsplit_core(kernels, qkv, b, a, o, w, conv, ssm, inp["state_idx"], num_computed,
                                   cu_of(num_new))
            gdn_island(ctx, core, *local, out)
        else:
            core = gdn_relay if mode == "relay" else gdn_state_passing
            core(ctx, kernels, *local, out, w, conv, ssm, inp["state_idx"])
        assert (out[T:] == 7.0).all(), f"{mode}: padding rows must be left alone"
        got[mode] = (out[:T], conv, ssm)
    return rows, got


def errors(got, ref) -> dict:
    """Max abs error, and the largest |ref| it is relative to; NaN/Inf anywhere reads as inf."""
    got, ref = got.float(), ref.float()
    finite = bool(torch.isfinite(got).all())
    return {"max_abs": (got - ref).abs().max().item() if finite and got.numel() else
            (float("inf") if not finite else 0.0),
            "ref_max": ref.abs().max().item() if ref.numel() else 0.0, "finite": finite}


def compare(rows, got, ref) -> dict:
    """{mode: {"out": errors, "conv": errors, "ssm": errors}} of one rank against the unsplit core."""
    ref_out, ref_conv, ref_ssm = ref
    return {mode: {"out": errors(out, ref_out.index_select(0, rows)), "conv": errors(conv, ref_conv),
                   "ssm": errors(ssm, ref_ssm)} for mode, (out, conv, ssm) in got.items()}


def case_name(config: PCPConfig, world_size: int, num_computed, num_new) -> str:
    return (f"pcp{world_size} {config.layout} min_split={config.min_split_tokens} "
            f"computed={list(num_computed)} new={list(num_new)}")


def worst_of(reports: list[dict]) -> dict:
    """The largest error per mode and tensor over many ``compare`` reports."""
    worst: dict = {}
    for report in reports:
        for mode, tensors in report.items():
            for name, e in tensors.items():
                w = worst.setdefault(mode, {}).setdefault(name, {"max_abs": 0.0, "finite": True})
                w["max_abs"] = max(w["max_abs"], e["max_abs"])
                w["finite"] &= e["finite"]
    return worst


def unaligned_blocks(patch=setattr) -> None:
    """The split rule before the split floor (negative control): any request of at least 2N tokens
    split into near-equal blocks, most of them off the 64-token chunk grid. ``patch(obj, name, value)``
    (default ``setattr``; pytest's ``monkeypatch.setattr`` to undo it)."""
    from qwen36_pcp import plan as plan_module

    patch(plan_module, "block_bounds", lambda n, nb: np.arange(nb + 1, dtype=np.int64) * n // nb)
    patch(PCPConfig, "split_threshold", lambda self, n: max(self.min_split_tokens, self.num_blocks(n)))
