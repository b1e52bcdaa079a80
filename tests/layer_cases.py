# SPDX-License-Identifier: Apache-2.0
"""Shared random cases for the layer tests: a batch of unequal requests, some continuing from a cache."""

from __future__ import annotations

import math

import numpy as np
import torch

from qwen36_pcp.layers.gdn_kernels import GDNWeights

# (num_computed, num_new): fresh prefill, continuation, decode rows, prompts too short to split (a
# request is split from 64 tokens per block on: 256 tokens at pcp=2, 512 at pcp=4, zigzag)
BATCHES = [
    ([0], [300]),
    ([0, 0, 5, 9, 0], [23, 1, 1, 600, 3]),
    ([13, 0, 7], [290, 1100, 2]),
]


def kv_layout(num_computed, num_new, block_size):
    """A block table (rows per request) and the full slot mapping of this step's new tokens."""
    total = [c + n for c, n in zip(num_computed, num_new)]
    max_blocks = max(-(-t // block_size) for t in total)
    block_table = torch.zeros(len(total), max_blocks, dtype=torch.int32)
    next_block = 1  # block 0 unused, like vLLM's null block
    for i, t in enumerate(total):
        nb = -(-t // block_size)
        block_table[i, :nb] = torch.arange(next_block, next_block + nb)
        next_block += nb
    slots = []
    for i, (c, n) in enumerate(zip(num_computed, num_new)):
        pos = torch.arange(c, c + n)
        slots.append(block_table[i, pos // block_size].long() * block_size + pos % block_size)
    return block_table, torch.cat(slots), next_block


def gdn_case(seed, num_computed, num_new, hk=2, hv=4, dk=8, dv=8, width=4):
    """Random fp32 GDN layer inputs and cache for a batch -> (inputs, GDNWeights)."""
    g = torch.Generator().manual_seed(seed)
    D = 2 * hk * dk + hv * dv
    T = int(sum(num_new))
    R = len(num_new)
    lines = R + 3
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    case = dict(
        mixed_qkv=rnd(T, D), a=rnd(T, hv), b=rnd(T, hv),
        conv_weight=rnd(D, width) * 0.5, conv_bias=rnd(D) * 0.1,
        # decay rates from 0.02 to 8 per token: the slow heads carry a block's state across the
        # whole request, so a wrong hand-off shows in every later output
        A_log=torch.linspace(math.log(0.02), math.log(8.0), hv), dt_bias=rnd(hv) * 0.1,
        conv_state=rnd(lines, D, width - 1), ssm_state=rnd(lines, hv, dv, dk) * 0.3,
        state_idx=torch.randperm(lines, generator=g)[:R],
    )
    weights = GDNWeights(case.pop("conv_weight"), case.pop("conv_bias"), case.pop("A_log"),
                         case.pop("dt_bias"), num_k_heads=hk, head_k_dim=dk, head_v_dim=dv)
    return case, weights


def cu_of(num_new):
    return torch.from_numpy(np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32))
