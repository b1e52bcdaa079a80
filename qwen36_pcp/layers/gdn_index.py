# SPDX-License-Identifier: Apache-2.0
"""The GDN context-parallel modes' per-step indices (the conv halo's, the relay's, state passing's),
built from a plan once per step on the host and copied to the device in one copy each; ``PCPContext``
builds them when a layer first asks. A plan with verified requests (MTP) has none: its GDN layers use
the plan of the other requests (``PCPContext.gdn``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..plan import PCPPlan
from .device_copy import Varlen, to_device_all


@dataclass(frozen=True)
class ConvIndex:
    """A short conv's halo indices (``PCPPlan.conv_sources`` and ``tail_rows``) on the device."""

    tail_rows: torch.Tensor  # [max_segments, w-1] local rows of each segment's last inputs
    halo: torch.Tensor  # [S, w-1] table rows of each segment's first inputs' predecessors
    final: torch.Tensor  # [R, w-1] table rows of each request's new conv state


@dataclass(frozen=True)
class StatePassingIndex:
    """GDN state passing: segments that start from the cache, the whole (replicated, then owned)
    segments, and this rank's blocks of the split requests (block -> local segment positions, on the
    host and the device)."""

    starts_from_cache: torch.Tensor  # [S] bool
    replicated_slots: torch.Tensor  # [S_rep + S_own]
    replicated_reqs: torch.Tensor  # [S_rep + S_own]
    num_replicated: int  # S_rep: the same on every rank
    split_reqs: torch.Tensor  # [R_split]
    block_slots: dict[int, list[int]]
    block_slots_dev: dict[int, torch.Tensor]


@dataclass(frozen=True)
class RelayRun:
    """One of this rank's runs of adjacent blocks: local rows [lo, hi), one sequence per split request."""

    lo: int
    hi: int
    seqs: Varlen  # bounds relative to lo


@dataclass(frozen=True)
class RelayIndex:
    """GDN relay: the whole requests (first in the local layout: the replicated ones, then the ones this
    rank owns) and this rank's runs."""

    replicated_rows: int
    replicated: Varlen
    replicated_reqs: torch.Tensor
    replicated_from_cache: torch.Tensor  # bool
    num_replicated: int  # replicated (not owned) requests: the same on every rank
    split_reqs: torch.Tensor
    split_from_cache: torch.Tensor  # bool
    runs: list[RelayRun]


def conv_index(plan: PCPPlan, device: torch.device, width: int) -> ConvIndex:
    """``ConvIndex`` of a short conv of this width, on the device."""
    sources = plan.conv_sources(width)
    return ConvIndex(*to_device_all(device, plan.tail_rows(width), sources.halo, sources.final))


def state_passing_index(plan: PCPPlan, device: torch.device) -> StatePassingIndex:
    """``StatePassingIndex`` of this rank's segments, on the device."""
    assert not plan.verify.any(), "GDN indices are built on ``gdn``'s plan (no verified requests)"
    segs = plan.local_segments
    starts_from_cache = np.array([s.block <= 0 and plan.num_computed[s.req] > 0 for s in segs], dtype=bool)
    replicated = [j for j, s in enumerate(segs) if s.block < 0]
    block_slots = plan.split_block_slots()
    starts, rep_slots, rep_reqs, split_reqs, *slots = to_device_all(
        device, (starts_from_cache, torch.bool), np.array(replicated, dtype=np.int64),
        np.array([segs[j].req for j in replicated], dtype=np.int64), plan.split_reqs.astype(np.int64),
        *(np.array(v, dtype=np.int64) for v in block_slots.values()))
    return StatePassingIndex(
        starts_from_cache=starts,
        replicated_slots=rep_slots,
        replicated_reqs=rep_reqs,
        num_replicated=plan.num_replicated,
        split_reqs=split_reqs,
        block_slots=block_slots,
        block_slots_dev=dict(zip(block_slots, slots)),
    )


def relay_index(plan: PCPPlan, device: torch.device) -> RelayIndex:
    """``RelayIndex`` of this rank's segments and runs, on the device."""
    assert not plan.verify.any(), "GDN indices are built on ``gdn``'s plan (no verified requests)"
    segs, offs = plan.local_segments, plan.seg_offsets[plan.rank]
    n_rep = sum(s.block < 0 for s in segs)
    rep_reqs = np.array([s.req for s in segs[:n_rep]], dtype=np.int64)
    run_rows = plan.run_rows()
    replicated, *seqs = Varlen.of_all(
        [offs[: n_rep + 1]] + [cu - cu[0] for cu in run_rows], device,
        rep_reqs, (plan.num_computed[rep_reqs] > 0, torch.bool), plan.split_reqs.astype(np.int64),
        (plan.num_computed[plan.split_reqs] > 0, torch.bool))
    runs_seqs, (replicated_reqs, replicated_from_cache, split_reqs, split_from_cache) = \
        seqs[: len(run_rows)], seqs[len(run_rows):]
    return RelayIndex(
        replicated_rows=int(offs[n_rep]),
        replicated=replicated,
        replicated_reqs=replicated_reqs,
        replicated_from_cache=replicated_from_cache,
        num_replicated=plan.num_replicated,
        split_reqs=split_reqs,
        split_from_cache=split_from_cache,
        runs=[RelayRun(int(cu[0]), int(cu[-1]), run) for cu, run in zip(run_rows, runs_seqs)],
    )
