# SPDX-License-Identifier: Apache-2.0
"""What a ``plan.PCPPlan`` is built from and hands out: the block arithmetic of a split request (blocks
on whole GDN chunks, each block's rank under a layout), whether a step is a spread decode step, and the
records its layers read (a rank's segments, the rows vLLM samples from and where they are gathered
from, the attention's virtual sequences, the conv halo's sources)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import GDN_CHUNK


@dataclass(frozen=True)
class Segment:
    """A contiguous run of one request's new tokens [start, end) computed on one rank."""

    req: int
    start: int
    end: int
    block: int  # block index within a split request; -1 for a replicated or owned request

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SampleRows:
    """Where the rows vLLM samples from (each request's last ``num_read`` new tokens: its last token,
    and with drafts every verified one) are gathered from.

    ``full``: each such row in the runner's batch; ``send``: the local row this rank sends for it (its
    own copy where it holds the primary one, else row 0 as filler, so that every rank sends as many
    rows); ``pick``: the row of ``all_gather(local[send])`` that holds the primary copy
    (``owner * len(full) + j``)."""

    full: np.ndarray
    send: np.ndarray
    pick: np.ndarray


@dataclass(frozen=True)
class AttentionSeqs:
    """Rank r's virtual sequences for end-aligned causal attention, one per local segment: query
    bounds ``cu_q`` [S+1] (int32), keys used ``seqused_k`` [S] (int32) and the request ``reqs`` [S]."""

    cu_q: np.ndarray
    seqused_k: np.ndarray
    reqs: np.ndarray


@dataclass(frozen=True)
class ConvSources:
    """Rows of the conv-halo table (see ``PCPPlan.conv_sources``): ``halo`` [S_r, width-1] for rank
    r's segments, ``final`` [num_reqs, width-1] for each request's new conv state."""

    halo: np.ndarray
    final: np.ndarray


def block_bounds(num_tokens: int, num_blocks: int) -> np.ndarray:
    """Near-equal block boundaries on whole GDN chunks (the last block takes the remainder), so a
    block's scan cuts the same chunks as one GPU's scan of the whole step. Needs at least one chunk
    per block (``PCPConfig.split_threshold`` sees to it)."""
    chunks = num_tokens // GDN_CHUNK
    if chunks < num_blocks:
        raise ValueError(f"{num_tokens} tokens are fewer than one {GDN_CHUNK}-token chunk per block "
                         f"({num_blocks} blocks)")
    bounds = np.arange(num_blocks + 1, dtype=np.int64) * chunks // num_blocks * GDN_CHUNK
    bounds[-1] = num_tokens
    return bounds


def spread_decode_step(owner: np.ndarray | None, num_new: np.ndarray) -> bool:
    """Whether a step is a spread decode step: every request on its owner, each as many new tokens
    (one; with speculative decoding its last token and as many drafts as every other's)."""
    num_new = np.asarray(num_new)
    return (owner is not None and len(num_new) > 0 and bool((owner >= 0).all())
            and bool((num_new == num_new[0]).all()))


def block_owner(block: int, world_size: int, layout: str) -> int:
    if layout == "contiguous":
        return block
    return block if block < world_size else 2 * world_size - 1 - block
