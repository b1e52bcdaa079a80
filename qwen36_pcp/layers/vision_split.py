# SPDX-License-Identifier: Apache-2.0
"""The vision encoder split over the PCP ranks: each rank encodes a contiguous share of the step's
frames, and one all-gather gives every rank every embedding.

vLLM's runner encodes a step's images and videos before the language model runs, so at pcp > 1
every rank would encode all of them: for a 64-frame video of 61k tokens that is 1.0 s of an H200,
against 0.28 s predicted for the language model's split prefill at pcp=8
(``benchmarks/bench_vision_encoder.py``). Split, each rank encodes about 1/pcp of the frames.

Why frames can be encoded apart: the Qwen3-VL vision tower attends within a frame (one attention
sequence per temporal patch of a video, ``cu_seqlens``), its position embeddings and rotary angles
depend on a frame's height and width and not on its place in time, and its patch merger merges
within a frame; a video's patches are stored frame after frame. So a video of grid [t, h, w] is the
videos [t1, h, w] and [t - t1, h, w] back to back, as far as the math goes (the kernels see other row
counts, so not necessarily the same bits: ``vision_encoder="replicated"`` keeps pcp=1's). An image is
one frame and goes whole to one rank.

The split is a function of the items' grids alone, which every rank holds (the scheduler gives every
rank the same encoder inputs), so it needs no collective besides the embeddings' all-gather.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch


def frame_bounds(grid_thw: Sequence[Sequence[int]], world: int) -> np.ndarray:
    """[world + 1] frame indices: rank r encodes frames ``bounds[r]:bounds[r + 1]`` of the step's frames
    in order (every item's temporal patches, item after item), contiguous shares of about equal patch
    counts (a frame goes to the earlier rank when its midpoint falls at or before the share's end)."""
    weights = np.array([h * w for t, h, w in grid_thw for _ in range(t)], dtype=np.int64)
    ends = np.cumsum(weights)
    mids = ends - weights / 2
    targets = ends[-1] * np.arange(1, world) / world if len(weights) else np.zeros(world - 1)
    inner = np.searchsorted(mids, targets, side="right")
    return np.concatenate([[0], inner, [len(weights)]]).astype(np.int64)


def sub_grids(grid_thw: Sequence[Sequence[int]], lo: int, hi: int) -> list[list[int]]:
    """The grids of frames ``lo:hi``: each item's frames in the range as one item [t', h, w]."""
    out, start = [], 0
    for t, h, w in grid_thw:
        a, b = max(lo, start), min(hi, start + t)
        if a < b:
            out.append([b - a, h, w])
        start += t
    return out


def frame_shares(grid_thw: Sequence[Sequence[int]], world: int) -> list[tuple[slice, list[list[int]]]]:
    """Per rank: its rows of the batch's pixel patches and the grids of its frames."""
    grid = [list(map(int, g)) for g in grid_thw]
    bounds = frame_bounds(grid, world)
    patch_ends = np.concatenate([[0], np.cumsum([h * w for t, h, w in grid for _ in range(t)])]).astype(int)
    return [(slice(int(patch_ends[lo]), int(patch_ends[hi])), sub_grids(grid, lo, hi))
            for lo, hi in zip(bounds[:-1], bounds[1:])]


def encode_split(encode: Callable[[torch.Tensor, list[list[int]]], torch.Tensor], pixels: torch.Tensor,
                 grid_thw: Sequence[Sequence[int]], merge: int, out_dim: int, group) -> tuple[torch.Tensor, ...]:
    """Every item's embeddings (as the tower gives them for the whole batch), each rank encoding its
    share of the frames with ``encode(pixels, grids) -> [rows, out_dim]``; ``merge``: patches per
    output row (the spatial merge squared); ``group``: the PCP group (vLLM's GroupCoordinator)."""
    shares = frame_shares(grid_thw, group.world_size)
    rows = [(patches.stop - patches.start) // merge for patches, _ in shares]
    patches, grids = shares[group.rank_in_group]
    width = max(max(rows), 1)  # the all-gather takes equal shapes: every share padded to the largest
    local = pixels.new_zeros((width, out_dim))
    if grids:
        local[: rows[group.rank_in_group]] = encode(pixels[patches], grids)
    gathered = group.all_gather(local, dim=0)
    full = torch.cat([gathered[r * width: r * width + n] for r, n in enumerate(rows)])
    return full.split([int(t) * int(h) * int(w) // merge for t, h, w in grid_thw])
