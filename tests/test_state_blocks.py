# SPDX-License-Identifier: Apache-2.0
"""State blocks that spread decode rows fill (``state_blocks``) on 2 and 4 gloo ranks: every rank's
slots of the blocks that owned rows fill this step hold their owner's states afterwards, in one
broadcast per owner; every other slot stays as it was. With MTP, a hand-over sends every block of
the requests handed over (the drafts' SSM states too), from each one's owner."""

import numpy as np
import pytest
import torch

from harness.dist import run_distributed

BS, BLOCKS = 4, 40


def _caches(rank):
    """Two state groups as vLLM lays GDN layers out: per layer a bf16 conv state of an odd element
    count (a transposed view, as vLLM's conv state is) and an fp32 SSM state; every rank's values its own."""
    def conv():
        return (torch.arange(BLOCKS * 15, dtype=torch.float32).view(BLOCKS, 5, 3) + 1000 * rank).bfloat16() \
            .transpose(1, 2)

    def ssm():
        return torch.arange(BLOCKS * 32, dtype=torch.float32).view(BLOCKS, 2, 4, 4) * 0.5 + 1000 * rank

    return [[conv(), ssm(), conv(), ssm()], [conv(), ssm()]]


def _block_ids(i):
    # request i's blocks, one list per state group, distinct across requests and groups
    return [[2 * i + 20 * g, 2 * i + 20 * g + 1, 30 + i + g] for g in (0, 1)]


def _case(world_size):
    # computed tokens after the step. Request 0: owned by the last rank, fills its second block
    # (block 1); 1: fills a block, not owned; 2: owned by rank 0, fills block 0; 3: owned, mid-block;
    # 4: owned by rank 1, fills block 2
    owner = np.array([world_size - 1, -1, 0, 1, 1])
    num_tokens = np.array([2 * BS, 2 * BS, BS, BS + 1, 3 * BS])
    return owner, num_tokens


def _step(rank, group):
    """The same step twice on fresh caches: payloads as large as need be, and of one block each."""
    from qwen36_pcp.spread.state_blocks import share_completed_state_blocks

    owner, num_tokens = _case(group.world_size)
    out = []
    for max_payload_bytes in (128 << 20, 1):
        caches = _caches(rank)
        sent = share_completed_state_blocks(group, owner, num_tokens, BS, _block_ids, caches, max_payload_bytes)
        out.append((sent, [[s.contiguous() for s in states] for states in caches]))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_filled_blocks_hold_their_owners_states_on_every_rank(world_size):
    owner, _ = _case(world_size)
    completed = {0: 1, 2: 0, 4: 2}  # request -> the block it fills
    results = run_distributed(_step, world_size)
    for rank, runs in enumerate(results):
        for (sent, caches), one_block_payloads in zip(runs, (False, True)):
            # one payload per owner, or (payloads of one block) one per filled block
            assert sent == (len(completed) if one_block_payloads else len({int(owner[i]) for i in completed}))
            for g, states in enumerate(caches):
                expected = [s.contiguous().clone() for s in _caches(rank)[g]]
                for i, b in completed.items():
                    slot = _block_ids(i)[g][b]
                    for e, src in zip(expected, _caches(int(owner[i]))[g]):
                        e[slot] = src[slot]
                for got, want in zip(states, expected):
                    assert torch.equal(got, want), (rank, g, one_block_payloads)


def test_no_completed_block_no_collective():
    from qwen36_pcp.spread.state_blocks import completed_blocks, share_completed_state_blocks

    assert completed_blocks([0, -1, 1], [BS, 2 * BS, BS + 3], BS).tolist() == [0]
    assert share_completed_state_blocks(None, np.array([0, -1]), np.array([BS + 1, BS]), BS, _block_ids,
                                        _caches(0)) == 0


def _hand_over(rank, group):
    """Requests 1 and 3 handed over from the last rank and from rank 0, request 2 not; payloads as large
    as need be, and of one request each."""
    from qwen36_pcp.spread.state_blocks import hand_over_request_states

    handover = np.array([-1, group.world_size - 1, -1, 0])
    out = []
    for max_payload_bytes in (128 << 20, 1):
        caches = _caches(rank)
        sent = hand_over_request_states(group, handover, _block_ids, caches, max_payload_bytes)
        out.append((sent, [[s.contiguous() for s in states] for states in caches]))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_hand_over_sends_every_block_of_the_request_from_its_owner(world_size):
    moved = {1: world_size - 1, 3: 0}
    for rank, runs in enumerate(run_distributed(_hand_over, world_size)):
        for (sent, caches), one_block_payloads in zip(runs, (False, True)):
            assert sent == (6 if one_block_payloads else 2)  # one per owner, or per block of each request
            for g, states in enumerate(caches):
                expected = [s.contiguous().clone() for s in _caches(rank)[g]]
                for i, src in moved.items():
                    for slot in _block_ids(i)[g]:  # all three blocks of the request
                        for e, s in zip(expected, _caches(src)[g]):
                            e[slot] = s[slot]
                for got, want in zip(states, expected):
                    assert torch.equal(got, want), (rank, g)
    assert run_distributed(_no_hand_over, 2) == [0, 0]


def _no_hand_over(rank, group):
    from qwen36_pcp.spread.state_blocks import hand_over_request_states

    return hand_over_request_states(group, np.array([-1, -1]), _block_ids, _caches(rank))
