# SPDX-License-Identifier: Apache-2.0
"""A decoding request's GDN states in the prefix cache under ``decode="spread"``.

With prefix caching, vLLM 0.20.2 keeps a hybrid model's GDN states block by block
(``mamba_cache_mode="align"``): a request's running state lives in the state slot of the block its
last computed token is in. The step that computes a block's last token leaves that slot with the state
after it, and the next step that runs the request copies the state on into the next block's slot
(``mamba_utils.preprocess_mamba``), so the full block's slot keeps it: what a later request that hits
the prefix up to that block starts from, on every rank (the block is cached whether or not its
request runs again: it may finish or be preempted right there). A spread decode row is computed by its
owner alone, so only the owner's slot holds that state. After the forward of a step in which owned
rows fill their blocks, those blocks' states go from each owner to every rank: one broadcast per owner
with such rows, every GDN layer's conv and SSM states of its blocks packed together, before any later
step can read them. A request fills a block once every ``block_size`` decode steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..layers.device_copy import to_device_all

MAX_PAYLOAD_BYTES = 128 << 20


def largest_payload_bytes(state_layers, max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> int:
    """The largest payload a state broadcast sends with these GDN layers (vLLM's ``MambaBase``: their
    state shapes and dtypes): the bound, or one block column (a block of every layer: the least a
    payload holds) where that is larger; known before the KV cache is allocated."""
    column = sum(math.prod(shape) * dtype.itemsize for layer in state_layers
                 for shape, dtype in zip(layer.get_state_shape(), layer.get_state_dtype()))
    return max(max_payload_bytes, column)


def completed_blocks(owner: np.ndarray, num_tokens: np.ndarray, block_size: int) -> np.ndarray:
    """The requests whose owned decode row fills its block this step (``num_tokens``: each request's
    computed tokens after the step; an owned row computes one, the block's last), by index; the block
    is ``num_tokens // block_size - 1``."""
    owner, num_tokens = np.asarray(owner), np.asarray(num_tokens)
    return np.flatnonzero((owner >= 0) & (num_tokens > 0) & (num_tokens % block_size == 0))


def share_completed_state_blocks(group, owner: np.ndarray, num_tokens: np.ndarray, block_size: int,
                                 block_ids: Callable[[int], Sequence[Sequence[int]]],
                                 caches: Sequence[Sequence[torch.Tensor]],
                                 max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> int:
    """Every rank's copy of the state slots that owned decode rows filled this step, from their owners
    (see the module); called after the step's forward. The same host data on every rank gives every
    rank the same calls.

    owner, num_tokens: per request of the step (``DecodeOwners``' owners, -1: not an owned row; its
    computed tokens after the step); ``block_ids(i)``: request i's block ids, one list per state group
    (vLLM's ``CachedRequestState.block_ids`` of the GDN groups); ``caches``: per state group, every
    state tensor of its layers ([blocks, ...]: each GDN layer's conv and SSM states). A payload holds
    at most ``max_payload_bytes`` (at least one block: about 63 MiB at Qwen3.6-35B-A3B's shape, whose
    config keeps SSM states in fp32), so
    many requests filling blocks at once take a few broadcasts, not one buffer as large as all their
    states. Returns the number of broadcasts."""
    reqs = completed_blocks(owner, num_tokens, block_size)
    return broadcast_state_blocks(
        group, [int(owner[i]) for i in reqs],
        [[[block_ids(i)[g][int(num_tokens[i]) // block_size - 1]] for g in range(len(caches))] for i in reqs],
        caches, max_payload_bytes)


def hand_over_request_states(group, handover: np.ndarray, block_ids: Callable[[int], Sequence[Sequence[int]]],
                             caches: Sequence[Sequence[torch.Tensor]],
                             max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> int:
    """Every state block of the requests ``handover`` names (per request of the step: the rank whose
    states every rank needs now, -1: none), from that rank to every rank, before the step reads them.

    With speculative decoding vLLM keeps a decoding request's GDN states in 1 + K blocks (without prefix
    caching: ``mamba_cache_mode="none"``): the conv window in the first, the SSM state after each
    verified position in the others, read at the accepted-token offset that every rank holds alike
    (``num_accepted_tokens``); all of them go, so every rank reads what the owner would. A payload
    holds whole block columns (at least one: a block of every GDN layer), never a request's 1 + K at
    once unless they fit the bound."""
    items = []  # one per request and block column (every group's block there): payloads stay bounded
    for i in np.flatnonzero(np.asarray(handover) >= 0):
        ids = [list(block_ids(int(i))[g]) for g in range(len(caches))]
        items += [(int(handover[i]), [b[j: j + 1] for b in ids]) for j in range(max(map(len, ids), default=0))]
    return broadcast_state_blocks(group, [src for src, _ in items], [blocks for _, blocks in items], caches,
                                  max_payload_bytes)


def broadcast_state_blocks(group, sources: Sequence[int], blocks: Sequence[Sequence[Sequence[int]]],
                           caches: Sequence[Sequence[torch.Tensor]],
                           max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> int:
    """Item j's state blocks (``blocks[j][g]``: its block ids in state group g) from rank ``sources[j]``
    into every rank's ``caches``: one broadcast per source and bounded payload (at least one item),
    every layer's states of its items packed together. Returns the number of broadcasts."""
    if len(sources) == 0:
        return 0
    device = caches[0][0].device
    # the widest dtypes first: every part of a payload then starts at a multiple of its element size
    states = sorted(((g, state) for g, group_states in enumerate(caches) for state in group_states),
                    key=lambda gs: -gs[1].element_size())
    per_block = [sum(state[0].numel() * state.element_size() for h, state in states if h == g)
                 for g in range(len(caches))]
    size = [sum(len(blocks[j][g]) * per_block[g] for g in range(len(caches))) for j in range(len(sources))]
    sent = 0
    for src in sorted(set(sources)):
        chunks, nbytes = [[]], 0
        for j in (j for j, s in enumerate(sources) if s == src):  # bounded payloads
            if chunks[-1] and nbytes + size[j] > max_payload_bytes:
                chunks.append([])
                nbytes = 0
            chunks[-1].append(j)
            nbytes += size[j]
        for chunk in chunks:
            slots = to_device_all(device, *(np.array([b for j in chunk for b in blocks[j][g]], dtype=np.int64)
                                            for g in range(len(caches))))
            _broadcast_slots(group, src, [(state, slots[g]) for g, state in states], sum(size[j] for j in chunk),
                             device)
            sent += 1
    return sent


def _broadcast_slots(group, src: int, parts, nbytes: int, device) -> None:
    """Rank ``src``'s rows ``idx`` of each state tensor, packed in one payload, into every rank's."""
    if group.rank_in_group == src:
        payload = torch.cat([state.index_select(0, idx).reshape(-1).view(torch.uint8) for state, idx in parts])
    else:
        payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
    payload = group.broadcast(payload, src)
    if group.rank_in_group == src:
        return
    offset = 0
    for state, idx in parts:
        n = len(idx) * state[0].numel() * state.element_size()
        state.index_copy_(0, idx, payload[offset: offset + n].view(state.dtype).view(len(idx), *state.shape[1:]))
        offset += n
