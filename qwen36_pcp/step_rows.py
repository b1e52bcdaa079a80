# SPDX-License-Identifier: Apache-2.0
"""A step's rows across the PCP ranks: the rank's rows of the step's inputs, and the rows that get
sampled made rank 0's bits on every rank."""

from __future__ import annotations

import torch


def local_rows(x: torch.Tensor | None, idx: torch.Tensor, dim: int, in_place: bool = False) -> torch.Tensor | None:
    """The rank's rows of one of the step's inputs (``idx`` along ``dim``). ``in_place``: written into
    the head of ``x`` and returned as that view: vLLM passes views of its persistent input buffers
    from their start, and a CUDA graph replays what it read at capture, those buffers' heads."""
    if x is None:
        return None
    rows = x.index_select(dim, idx)
    if not in_place:
        return rows
    head = x.narrow(dim, 0, idx.numel())
    head.copy_(rows)
    return head


def rank0_rows(group, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``hidden`` with its ``rows`` replaced in place by rank 0's (one all-gather of those rows).

    Unsplit steps run the same batch on every rank; each rank feeds its own sample into its next step,
    so the rows that get sampled must be the same bits everywhere, and nothing else proves that every
    kernel picks the same autotune config in every process (with ``moe_experts="sharded"`` and more than
    two ranks vLLM's MoE reduce-scatter may also sum in a different order per rank).
    """
    rank0 = group.all_gather(hidden.index_select(0, rows).contiguous(), dim=0)[: rows.shape[0]]
    hidden.index_copy_(0, rows, rank0)
    return hidden
