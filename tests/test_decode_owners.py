# SPDX-License-Identifier: Apache-2.0
"""Which rank decodes each request (decode="spread"): stable while a request decodes, balanced by rows
then context, the same on every rank, ended by a recompute from token 0."""

from types import SimpleNamespace

import numpy as np

from qwen36_pcp.spread.decode_owners import DecodeOwners


def _step(owners, batch, live=None, handover=None):
    """batch: [(req_id, num_computed, num_new, num_prompt[, num_tokens])] -> owners of the step's
    requests (``handover``: a list that gets the step's hand-overs)."""
    ids = [b[0] for b in batch]
    cols = [np.array([b[k] for b in batch]) for k in (1, 2, 3)]
    tokens = {b[0]: SimpleNamespace(num_tokens=b[4] if len(b) > 4 else b[3]) for b in batch}
    requests = tokens if live is None else {r: tokens.get(r) for r in live}
    owner, moved = owners.step(ids, *cols, requests)
    if handover is not None:
        handover[:] = moved.tolist()
    return owner.tolist()


def test_owners_stable_balanced_and_forgotten():
    owners = DecodeOwners(2)
    # a prompt (not decoding), its last prompt token alone (not decoding), three decode rows
    first = _step(owners, [("p", 0, 900, 900), ("last", 99, 1, 100), ("a", 5000, 1, 10),
                           ("b", 20, 1, 10), ("c", 70, 1, 10)])
    assert first == [-1, -1, 0, 1, 1]  # c: one row each, then less context (20 against 5000)
    # the same requests later, in another order and with grown contexts: the same owners; the new
    # request goes where fewer rows are (rank 0)
    again = _step(owners, [("c", 71, 1, 10), ("d", 9, 1, 9), ("b", 21, 1, 10), ("a", 5001, 1, 10)])
    assert again == [1, 0, 1, 0]
    more = _step(owners, [("a", 5002, 1, 10), ("b", 22, 1, 10), ("c", 72, 1, 10), ("d", 10, 1, 9),
                          ("e", 30, 1, 30)])
    assert more == [0, 1, 1, 0, 1]  # e: two rows each, then context 94 against 5012
    # a request left out of a step keeps its owner; a finished one (not live) is forgotten
    assert _step(owners, [("b", 23, 1, 10)], live={"a", "b", "c", "d", "e"}) == [1]
    assert "a" in owners.owner
    _step(owners, [("b", 24, 1, 10)], live={"b"})
    assert set(owners.owner) == {"b"}


def test_recompute_ends_ownership_and_prompt_rows_after_it_hand_over():
    owners = DecodeOwners(4)
    assert _step(owners, [("a", 50, 1, 40)]) == [0]
    # preempted and recomputed from token 0 (its 40 prompt and 70 output tokens) in chunks: replicated
    # or split, every rank holds its states again; a one-token chunk of it is no decode row
    assert _step(owners, [("b", 7, 1, 5), ("a", 0, 60, 40, 110)]) == [0, -1]
    assert "a" not in owners.owner
    assert _step(owners, [("b", 8, 1, 5), ("a", 60, 49, 40, 110)]) == [0, -1]
    assert _step(owners, [("b", 9, 1, 5), ("a", 109, 1, 40, 110)]) == [0, -1]
    assert _step(owners, [("b", 10, 1, 5), ("a", 110, 1, 40, 111)]) == [0, 1]  # decoding again
    # more than one new token past token 0 of a request decoded on rank 1 alone (its prompt grew):
    # handed over from rank 1, computed as a prompt, owned again when it decodes
    moved = []
    assert _step(owners, [("a", 111, 3, 114), ("b", 11, 1, 5)], handover=moved) == [-1, 0]
    assert moved == [1, -1] and "a" not in owners.owner
    assert _step(owners, [("a", 114, 1, 114), ("b", 12, 1, 5)], handover=moved) == [1, 0]
    assert moved == [-1, -1]


def test_every_rank_computes_the_same_owners():
    rng = np.random.default_rng(0)
    ranks = [DecodeOwners(4) for _ in range(3)]
    live = set()
    for step in range(40):
        live |= {f"r{step}"}
        live -= {r for r in sorted(live) if rng.random() < 0.1}
        if not live:
            continue
        batch = [(r, int(rng.integers(10, 1000)), 1, 5) for r in sorted(live)]
        got = [_step(o, batch) for o in ranks]
        assert got[0] == got[1] == got[2]
        counts = np.bincount(np.array(got[0], dtype=np.int64), minlength=4)
        assert counts.max() - counts.min() <= max(3, len(batch) // 2)  # new requests fill the gaps


def _reference_step(owner: dict, prefill_end: dict, world: int, batch, live):
    """The ownership rule request by request (``DecodeOwners.step``'s, stated plainly): ``batch`` as
    ``_step``'s, ``live``: {req_id: num_tokens}; updates ``owner`` and ``prefill_end``."""
    for table in (owner, prefill_end):
        for r in [r for r in table if r not in live]:
            del table[r]
    for r, computed, *_ in batch:
        if computed == 0:
            owner.pop(r, None)
            prefill_end[r] = live[r]
    decoding = [new == 1 and computed >= max(prompt, prefill_end.get(r, 0)) for r, computed, new, prompt, *_ in batch]
    rows, context, handover = [0] * world, [0] * world, []
    for (r, computed, *_), dec in zip(batch, decoding):
        handover.append(-1)
        if r in owner and dec:
            rows[owner[r]] += 1
            context[owner[r]] += computed
        elif r in owner:
            handover[-1] = owner.pop(r)
    result = []
    for (r, computed, *_), dec in zip(batch, decoding):
        if dec and r not in owner:
            owner[r] = min(range(world), key=lambda k: (rows[k], context[k], k))
            rows[owner[r]] += 1
            context[owner[r]] += computed
        result.append(owner[r] if dec else -1)
    return result, handover


def test_owners_follow_the_rule_request_by_request():
    """Long random runs (arrivals, decoding, chunked prompts, restarts from token 0, prompts that grow,
    requests left out and finished) at 2, 4 and 8 ranks: the same owners, hand-overs and tables as
    the rule applied one request at a time."""
    rng = np.random.default_rng(1)
    for world in (2, 4, 8):
        owners, owner, prefill_end = DecodeOwners(world), {}, {}
        state = {}  # req_id -> [computed, prompt, tokens]
        for step in range(300):
            for _ in range(int(rng.integers(0, 4))):
                state[f"s{step}_{_}"] = [0, int(rng.integers(1, 400)), 0]
            for r in [r for r in state if rng.random() < 0.03]:
                del state[r]
            batch = []
            for r, (computed, prompt, tokens) in state.items():
                if rng.random() < 0.15:
                    continue  # left out of this step
                kind = rng.random()
                if kind < 0.05 and computed:  # preempted: recomputed from token 0
                    computed = 0
                elif kind < 0.08 and computed >= prompt:  # streaming input: its prompt grew
                    prompt = computed + int(rng.integers(2, 50))
                left = max(prompt, tokens) - computed
                new = 1 if left <= 0 else int(min(left, rng.integers(1, 300)))
                tokens = max(tokens, prompt, computed + new)
                batch.append((r, computed, new, prompt, tokens))
                state[r] = [computed + new, prompt, tokens]
            if not batch:
                continue
            live = {r: s[2] for r, s in state.items()}
            for r, *_, tokens in batch:
                live[r] = tokens
            want = _reference_step(owner, prefill_end, world, batch, live)
            ids = [b[0] for b in batch]
            cols = [np.array([b[k] for b in batch]) for k in (1, 2, 3)]
            got, moved = owners.step(ids, *cols, {r: SimpleNamespace(num_tokens=t) for r, t in live.items()})
            assert (got.tolist(), moved.tolist()) == want, (world, step)
            assert owners.owner == owner and owners.prefill_end == prefill_end


def test_a_resumed_requests_one_token_chunk_stays_owned_then_hands_over():
    """Resumed after a prefix hit (not from token 0) with 14 tokens left: a one-token chunk (a token
    budget's cut) is a decode row of its owner, which computes it from the hit block's state (the same
    on every rank); the next, longer chunk hands it over from that owner; its decode is owned again."""
    owners = DecodeOwners(4)
    assert _step(owners, [("a", 50, 1, 40)]) == [0]
    moved = []
    assert _step(owners, [("a", 96, 1, 40, 110)], handover=moved) == [0] and moved == [-1]
    assert _step(owners, [("a", 97, 13, 40, 110)], handover=moved) == [-1] and moved == [0]
    assert "a" not in owners.owner
    assert _step(owners, [("a", 110, 1, 40, 111)], handover=moved) == [0] and moved == [-1]


def test_verification_rows_owned_at_spread_steps_and_handed_over_at_others():
    """With MTP the caller names the decode rows: a step of verification rows alone (4 rows each at
    K = 3) gives every request an owner; at a step beside a prompt none is a decode row, so the owned
    requests in it are handed over and lose their owner, the one left out keeps it, and the next
    spread step gives owners again."""
    owners = DecodeOwners(2)

    def step(batch, decode_rows, live=None):
        ids = [b[0] for b in batch]
        cols = [np.array([b[k] for b in batch]) for k in (1, 2, 3)]
        requests = {r: SimpleNamespace(num_tokens=10) for r in (live or ids)}
        owner, handover = owners.step(ids, *cols, requests, np.full(len(batch), decode_rows))
        return owner.tolist(), handover.tolist()

    verify = [("a", 40, 4, 10), ("b", 30, 4, 10), ("c", 20, 4, 10)]
    assert step(verify, True) == ([0, 1, 1], [-1, -1, -1])  # c: one row each, then less context
    # four rows each but not decode rows (the caller's rule: a prompt beside them): a and c hand over
    assert step([("a", 44, 4, 10), ("c", 24, 4, 10), ("p", 0, 900, 900)], False,
                live={"a", "b", "c", "p"}) == ([-1, -1, -1], [0, 1, -1])
    assert owners.owner == {"b": 1}
    assert step([("a", 48, 4, 10), ("b", 34, 4, 10), ("c", 28, 4, 10), ("p", 900, 4, 900)], True) == \
        ([0, 1, 1, 0], [-1, -1, -1, -1])
    # the caller's rule is applied as given: a recompute from token 0 still ends ownership first
    assert step([("b", 0, 4, 10)], True, live={"a", "b", "c", "p"}) == ([-1], [-1])
