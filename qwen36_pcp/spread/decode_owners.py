# SPDX-License-Identifier: Apache-2.0
"""Which PCP rank computes each decoding request (``decode="spread"``).

A request is given an owner at its first decode row and keeps it until it finishes: only the owner
computes its rows and holds its true GDN states (conv and SSM), which leave it only at a hand-over
(below). Its K/V is still written on every rank (split attention gathers every new row's K/V), so the
attention cache stays whole. A new owner is the rank with the fewest decoding requests this step, then
the least context among them, then the lowest rank: the host data every rank holds alike (the
scheduler's output), so every rank computes the same owners with no collective.

Where another rank could read a decoding request's state, and what happens there:
- preemption: vLLM frees the request's blocks and recomputes it from token 0, prompt and outputs,
  which is replicated or split (every rank holds its states again); a step that starts a request at
  token 0 ends its ownership and records where the recompute ends, and its next owner comes at the
  first one-token step past that point (a one-token leftover of the recompute is no decode row).
  With prefix caching it resumes after its longest prefix hit instead, whose block holds the same
  states on every rank (``state_blocks``): a step of more than one of its tokens hands it over (below;
  the broadcast is then redundant), a one-token step (its last token, or a one-token chunk a token
  budget cut) leaves it with its owner, which computes that token from the block's state;
- a request left out of a step keeps its states where its owner wrote them, and its owner;
- a request with an owner that comes back with more than one new token past token 0 (its prompt grew:
  streaming input) is *handed over*: before that step its owner broadcasts its GDN states to every
  rank (``gdn_cp.hand_over_states``), then it is computed like any prompt;
- hybrid prefix caching (``mamba_cache_mode="align"``) keeps states block by block on every rank,
  and a later request hitting the prefix reads a full block's state on every rank: after the step in
  which an owned row fills its block, the owner broadcasts that block's states (``state_blocks``);
- speculative decoding (MTP): a request's decode rows are its verification rows (its last token and
  its drafts, a request vLLM's GDN layers verify). A step of such rows alone, as many per request, is
  spread: each owner runs vLLM's own verification of its requests (``owned_batch``), their states and
  accepted-token offsets on it alone. At any other step (a prompt beside them, other draft counts) each
  verifying request stays with its owner, which verifies it in the step's plan; an owned request that
  is not verifying at a step (a recompute's leftover, a step with no drafts at all) is handed over first
  (every state block of its, the drafts' too: ``state_blocks.hand_over_request_states``) and gets an
  owner again when it verifies. With prefix caching this is refused at startup (``checks``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


class DecodeOwners:
    def __init__(self, world_size: int):
        self.world_size = int(world_size)
        self.owner: dict[str, int] = {}
        self.prefill_end: dict[str, int] = {}  # tokens the latest start from token 0 covers

    def step(self, req_ids: Sequence[str], num_computed: np.ndarray, num_new: np.ndarray,
             num_prompt: np.ndarray, requests: Mapping,
             decode_rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Per request of the step: its owner (-1: not a decode row, computed as before) and, for a
        request whose owner alone holds its states but which every rank computes now, that owner
        (-1 elsewhere). ``requests``: the runner's live requests by id (their ``num_tokens``: the
        prompt and output tokens it holds). ``decode_rows``: which requests' rows are decode rows
        (default: one new token; with speculative decoding the caller's verification rows, none
        where the step is not spread).

        Array operations over the batch, with a Python loop only over the requests whose ownership
        changes (rare: a restart, a hand-over, a first decode row): it runs every step, on every rank,
        before the step is launched, and a step can hold hundreds of requests."""
        # (an id aborted and added again between two steps keeps the old entries: its start from token 0
        # clears them; after a prefix hit they only delay its ownership or hand over identical states)
        for table in (self.owner, self.prefill_end):
            for req_id in [r for r in table if r not in requests]:
                del table[req_id]
        num_computed, num_new = np.asarray(num_computed, dtype=np.int64), np.asarray(num_new)
        for i in np.flatnonzero(num_computed == 0):  # (re)started from its first token: every rank
            req_id = req_ids[i]                        # computes its states
            self.owner.pop(req_id, None)
            self.prefill_end[req_id] = int(requests[req_id].num_tokens)
        owner = np.array([self.owner.get(r, -1) for r in req_ids], dtype=np.int64)
        ends = np.maximum(np.asarray(num_prompt, dtype=np.int64),
                          np.array([self.prefill_end.get(r, 0) for r in req_ids], dtype=np.int64))
        decode_row = num_new == 1 if decode_rows is None else np.asarray(decode_rows, dtype=bool)
        decoding = decode_row & (num_computed >= ends)
        handover = np.where(decoding, -1, owner)
        for i in np.flatnonzero(handover >= 0):  # owned, but every rank computes it now
            del self.owner[req_ids[i]]
        owner[~decoding] = -1
        kept = owner >= 0
        rows = np.bincount(owner[kept], minlength=self.world_size)
        # (float sums of integers below 2**53: exact)
        context = np.bincount(owner[kept], weights=num_computed[kept], minlength=self.world_size).astype(np.int64)
        for i in np.flatnonzero(decoding & ~kept):  # a first decode row: the least loaded rank
            r = min(range(self.world_size), key=lambda r: (rows[r], context[r], r))
            self.owner[req_ids[i]] = owner[i] = r
            rows[r] += 1
            context[r] += num_computed[i]
        return owner, handover
