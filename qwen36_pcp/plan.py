# SPDX-License-Identifier: Apache-2.0
"""The per-step Prefill Context Parallel plan.

Built on the host from what every PCP rank already knows (per request: tokens already in the cache and
tokens scheduled this step), so every rank computes the same plan without any collective. Layers read it
from vLLM's forward context; nothing in a layer exchanges metadata.

Token layouts used throughout:
- *full*: the runner's batch layout, requests back to back (request i at ``req_start[i]``).
- *local* (rank r): rank r's segments back to back, then padding up to ``t_pad`` rows. Every rank has
  ``t_pad`` rows so that one all-gather assembles the batch (and vLLM's MoE, where its experts are
  sharded over the PCP group, all-gathers too and needs equal counts).
- *gathered*: ``all_gather`` of the local layouts, rank-major (``rank * t_pad + row``).

A request with at least ``PCPConfig.split_threshold`` new tokens (``min_split_tokens``, and never fewer
than one 64-token GDN chunk per block) is *split*: its new tokens are cut into blocks on whole chunks
(zigzag: 2N blocks, rank r owns blocks r and 2N-1-r, which balances causal attention work; contiguous:
N blocks, rank r owns block r). Every other request (decode rows, short prompts) is *replicated*: each
rank computes it in full, and rank 0's copy is the primary one: its K/V, conv and SSM states and its
hidden state are the ones kept on every rank, so a split step leaves the same caches on every rank.
With ``decode="spread"`` a decoding request is *owned* instead (``owner``, from ``decode_owners``):
only its owner computes its row; its K/V is still written on every rank, its GDN states only on the
owner, where they stay while it decodes.

With speculative decoding a request vLLM's GDN layers *verify* (``verify``: past its prompt, drafts
scheduled in the step) is never split: its 1 + K rows are computed whole (replicated, or on its owner)
and come first in the rank's local layout, where the GDN layers run vLLM's own verification kernels on
them; the other requests' GDN work is the plan of those requests alone (``gdn_plan``). vLLM reads the
last 1 + K rows of such a request (``num_read``: its logits rows), the last row of any other.
"""

from __future__ import annotations

import copy
from functools import cached_property

import numpy as np

from .config import PCPConfig
from .plan_records import (
    AttentionSeqs,
    ConvSources,
    SampleRows,
    Segment,
    block_bounds,
    block_owner,
    spread_decode_step,
)


class PCPPlan:
    """Which rank computes which tokens this step, and every index map the layers need.

    All fields are numpy (host); ``layers.context.PCPContext`` copies what the GPU needs, once per step.
    """

    def __init__(
        self,
        num_computed: np.ndarray,
        num_new: np.ndarray,
        world_size: int,
        rank: int,
        config: PCPConfig = PCPConfig(),
        owner: np.ndarray | None = None,
        handover: np.ndarray | None = None,
        min_rows: int = 1,
        verify: np.ndarray | None = None,
        num_read: np.ndarray | None = None,
    ):
        self.num_computed = np.asarray(num_computed, dtype=np.int64)
        self.num_new = np.asarray(num_new, dtype=np.int64)
        if self.num_computed.shape != self.num_new.shape or self.num_new.ndim != 1:
            raise ValueError("num_computed and num_new must be 1-D arrays of equal length")
        if (self.num_new < 1).any():
            raise ValueError("every scheduled request must have at least one new token")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world size {world_size}")
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.config = config
        self.num_reqs = len(self.num_new)
        self.req_start = np.concatenate([[0], np.cumsum(self.num_new)]).astype(np.int64)
        self.num_tokens = int(self.req_start[-1])
        self.num_blocks = config.num_blocks(self.world_size)
        threshold = config.split_threshold(self.world_size)
        # the requests vLLM's GDN layers verify (its spec path): computed whole, never split
        self.verify = (np.zeros(self.num_reqs, dtype=bool) if verify is None
                       else np.asarray(verify, dtype=bool).reshape(-1))
        # rows vLLM reads at the end of each request's new tokens (its logits rows)
        self.num_read = (np.ones(self.num_reqs, dtype=np.int64) if num_read is None
                         else np.asarray(num_read, dtype=np.int64).reshape(-1))
        if self.verify.shape != self.num_new.shape or self.num_read.shape != self.num_new.shape:
            raise ValueError("verify and num_read must give one value per request")
        if ((self.num_read < 1) | (self.num_read > self.num_new)).any():
            raise ValueError("num_read must be between 1 and each request's new tokens")
        self.split = (self.num_new >= threshold) & (self.world_size > 1) & ~self.verify
        self.split_reqs = np.flatnonzero(self.split)
        # the rank that alone computes each request (decode="spread"), -1: replicated or split
        self.owner = self._request_ranks(owner, self.split, "owner must give each request a rank, or -1 "
                                                           "(replicated or split)")
        # the rank holding the primary copy of an unsplit request: its owner, else rank 0
        self.whole_rank = np.maximum(self.owner, 0)
        # the rank whose GDN states of a request every rank needs first (``DecodeOwners``), -1: none
        self.handover = self._request_ranks(handover, (self.owner >= 0) | self.verify,
                                            "handover must name a rank only for requests without an owner "
                                            "that are not verified")
        self.handovers = [(int(i), int(self.handover[i])) for i in np.flatnonzero(self.handover >= 0)]
        self.block_bounds = {
            int(i): block_bounds(int(self.num_new[i]), self.num_blocks) for i in self.split_reqs
        }
        self.segments = [self._segments_of(r) for r in range(self.world_size)]
        self.slot_of = [
            {(s.req, s.block): j for j, s in enumerate(segs)} for segs in self.segments
        ]
        # ``min_rows``: a spread decode step pads to the row count of the CUDA graph it replays
        self.t_pad = max(1, int(min_rows), max(sum(s.length for s in segs) for segs in self.segments))
        self._build_row_maps()

    def with_computed(self, num_computed: np.ndarray) -> PCPPlan:
        """This plan at other computed-token counts (a spread decode step of the same requests and owners,
        a token later): nothing a plan builds or caches depends on ``num_computed``; what does
        (``attention_seqs``, ``conv_sources``, the state indices) is derived from it on each call."""
        other = copy.copy(self)
        other.__dict__.pop("_unverified", None)  # built from the counts
        other.num_computed = np.asarray(num_computed, dtype=np.int64)
        if other.num_computed.shape != self.num_new.shape:
            raise ValueError("num_computed must give one count per request of the plan")
        return other

    def _request_ranks(self, ranks, excluded: np.ndarray, message: str) -> np.ndarray:
        """A rank (or -1) per request, -1 where ``excluded``; all -1 when ``ranks`` is None."""
        ranks = np.full(self.num_reqs, -1, dtype=np.int64) if ranks is None else np.asarray(ranks, np.int64)
        if ranks.shape != self.num_new.shape or (ranks >= self.world_size).any() or ((ranks >= 0) & excluded).any():
            raise ValueError(message)
        return ranks

    # ------------------------------------------------------------------ layout
    def _segments_of(self, r: int) -> list[Segment]:
        """The verified requests rank r computes first (``verified_on``), then the other replicated
        requests, then the others rank r owns, then rank r's runs of blocks in chain order, each run
        request by request (``run_rows``: a run's rows are contiguous, a request's blocks in it
        adjacent)."""
        rest = ~self.verify
        whole = (self.verified_on(r).tolist() + np.flatnonzero(rest & ~self.split & (self.owner < 0)).tolist()
                 + np.flatnonzero(rest & (self.owner == r)).tolist())
        segs = [Segment(int(i), 0, int(self.num_new[i]), -1) for i in whole]
        for owner, first, last in self.summary_runs:
            if owner != r:
                continue
            for i in self.split_reqs:
                bounds = self.block_bounds[int(i)]
                segs += [Segment(int(i), int(bounds[b]), int(bounds[b + 1]), b) for b in range(first, last + 1)]
        return segs

    def _build_row_maps(self) -> None:
        n, t = self.world_size, self.t_pad
        self.local_full_idx = np.full((n, t), -1, dtype=np.int64)
        self.primary = np.zeros((n, t), dtype=bool)
        self.seg_offsets = []  # per rank: local row where each segment starts (+ total)
        for r, segs in enumerate(self.segments):
            req, start, end, block = np.array([(s.req, s.start, s.end, s.block) for s in segs],
                                              dtype=np.int64).reshape(-1, 4).T
            lens = end - start
            offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            rows = int(offs[-1])
            # each local row's full token: its segment's first, plus the row's place in the segment
            self.local_full_idx[r, :rows] = np.repeat(self.req_start[req] + start - offs[:-1], lens) + np.arange(rows)
            self.primary[r, :rows] = np.repeat((block >= 0) | (self.whole_rank[req] == r), lens)
            self.seg_offsets.append(offs)
        # gathered row of the primary copy of every full token
        flat_full = self.local_full_idx.reshape(-1)
        flat_primary = self.primary.reshape(-1)
        self.gathered_of_full = np.full(self.num_tokens, -1, dtype=np.int64)
        self.gathered_of_full[flat_full[flat_primary]] = np.flatnonzero(flat_primary)
        assert (self.gathered_of_full >= 0).all(), "a scheduled token has no primary copy"

    def verified_on(self, r: int | None = None) -> np.ndarray:
        """The verified requests rank r computes, in batch order: every replicated one, and the ones
        it owns."""
        r = self.rank if r is None else r
        return np.flatnonzero(self.verify & ((self.owner < 0) | (self.owner == r)))

    def verify_rows(self, r: int | None = None) -> int:
        """Rank r's leading local rows that are verification rows (``verified_on``)."""
        return int(self.num_new[self.verified_on(r)].sum())

    @property
    def gdn_plan(self) -> PCPPlan | None:
        """The plan of the requests whose GDN work the PCP layers do (all but the verified ones, in
        batch order, numbered as vLLM's GDN metadata numbers its non-speculative requests): on rank r
        its local rows are the full plan's after ``verify_rows(r)``. This plan itself where no request
        is verified; None where every one is."""
        return self._unverified if self.verify.any() else self

    @cached_property
    def _unverified(self) -> PCPPlan | None:
        """``gdn_plan`` where a request is verified (built once; None where none is, or all are)."""
        keep = np.flatnonzero(~self.verify)
        if not self.verify.any() or not len(keep):
            return None
        return PCPPlan(self.num_computed[keep], self.num_new[keep], self.world_size, self.rank, self.config,
                       self.owner[keep], self.handover[keep])

    # ------------------------------------------------------------ convenience
    @property
    def splits_any(self) -> bool:
        return bool(self.split.any())

    @cached_property
    def num_replicated(self) -> int:
        """Requests every rank computes whole, verified ones left out (first in every rank's local
        layout after the verified ones)."""
        return int((~self.split & (self.owner < 0) & ~self.verify).sum())

    @cached_property
    def decode_spread_only(self) -> bool:
        """Every request owned, each as many rows (a spread decode step): each rank runs vLLM's decode
        kernels on its own rows, with no collective but the K/V and output gathers."""
        return spread_decode_step(self.owner, self.num_new)

    @property
    def local_segments(self) -> list[Segment]:
        return self.segments[self.rank]

    @property
    def num_local_tokens(self) -> int:
        return int(self.seg_offsets[self.rank][-1])

    def tokens_per_rank(self) -> np.ndarray:
        return np.array([int(o[-1]) for o in self.seg_offsets], dtype=np.int64)

    def last_token_owner(self) -> np.ndarray:
        """Rank holding the primary copy of each request's last new token."""
        last_full = self.req_start[1:] - 1
        return self.gathered_of_full[last_full] // self.t_pad

    def sample_rows(self) -> SampleRows:
        """The rows vLLM samples from (each request's last ``num_read`` new tokens) and where they are
        gathered from."""
        offsets = np.concatenate([[0], np.cumsum(self.num_read)])  # each request's rows among the read ones
        within = np.arange(offsets[-1]) - np.repeat(offsets[:-1], self.num_read)
        full = (np.repeat(self.req_start[1:] - self.num_read, self.num_read) + within).astype(np.int64)
        owner = self.gathered_of_full[full] // self.t_pad
        send = np.where(owner == self.rank, self.gathered_of_full[full] % self.t_pad, 0)
        pick = owner * len(full) + np.arange(len(full))
        return SampleRows(full, send, pick)

    # -------------------------------------------------- attention (per rank)
    def attention_seqs(self, r: int | None = None) -> AttentionSeqs:
        """Virtual sequences of rank r for end-aligned causal attention.

        Segment [start, end) of request i with c cached tokens attends keys [0, c + start + q] for its
        q-th query: flash-attention's bottom-right causal mask with seqused_k = c + end gives exactly that.
        """
        r = self.rank if r is None else r
        segs = self.segments[r]
        cu_q = self.seg_offsets[r].astype(np.int32)
        seqused_k = np.array([self.num_computed[s.req] + s.end for s in segs], dtype=np.int32)
        reqs = np.array([s.req for s in segs], dtype=np.int64)
        return AttentionSeqs(cu_q, seqused_k, reqs)

    def gathered_full_idx(self) -> np.ndarray:
        """Full index of each gathered row that must be written to the KV cache, else -1."""
        flat = self.local_full_idx.reshape(-1).copy()
        flat[~self.primary.reshape(-1)] = -1
        return flat

    # ------------------------------------------------------- GDN (per rank)
    @cached_property
    def summary_runs(self) -> list[tuple[int, int, int]]:
        """Maximal runs of consecutive blocks on one rank, in chain order: (owner, first, last block).

        The owner composes each run into one summary before the gather; the run holding block 0 sends
        only its end state (its start state is known). Owners depend on the block index alone, so the
        runs are the same for every split request.
        """
        runs: list[tuple[int, int, int]] = []
        for b in range(self.num_blocks):
            owner = block_owner(b, self.world_size, self.config.layout)
            if runs and runs[-1][0] == owner:
                runs[-1] = (owner, runs[-1][1], b)
            else:
                runs.append((owner, b, b))
        return runs

    def run_rows(self, r: int | None = None) -> list[np.ndarray]:
        """Rank r's runs in chain order: the local row bounds [Rs + 1] of each run's sequences, one per
        split request (its blocks of the run back to back; ``_segments_of`` lays them out so)."""
        r = self.rank if r is None else r
        if not self.splits_any:
            return []
        out = []
        for owner, first, last in self.summary_runs:
            if owner == r:
                starts = [self.slot_of[r][(int(i), first)] for i in self.split_reqs]
                out.append(self.seg_offsets[r][np.asarray(starts + [starts[-1] + last - first + 1])])
        return out

    def split_block_slots(self, r: int | None = None) -> dict[int, list[int]]:
        """Rank r's blocks of the split requests: block -> local segment position of each request."""
        r = self.rank if r is None else r
        return {
            b: [self.slot_of[r][(int(i), b)] for i in self.split_reqs]
            for owner, first, last in self.summary_runs if owner == r
            for b in range(first, last + 1)
        }

    def conv_sources(self, width: int, r: int | None = None) -> ConvSources:
        """Where each conv input needed across segment boundaries comes from.

        Index space (rows of [D]-vectors): ``tails`` of every rank's segments first (rank-major,
        ``max_segments`` slots of width-1 rows each: a segment's last width-1 inputs), then the cached
        conv state of every request (width-1 rows each, oldest first), then one zero row.
        """
        r = self.rank if r is None else r
        w1 = width - 1
        num_segs = self.max_segments
        tails_rows = self.world_size * num_segs * w1
        zero_row = tails_rows + self.num_reqs * w1

        # where the primary copy of (request, position) lives: (rank, segment slot)
        def locate(i: int, p: int) -> int:
            if p < 0:
                if self.num_computed[i] > 0:
                    return tails_rows + i * w1 + (w1 + p)
                return zero_row
            if self.split[i]:
                bounds = self.block_bounds[i]
                b = int(np.searchsorted(bounds, p, side="right") - 1)
                owner = block_owner(b, self.world_size, self.config.layout)
                end = int(bounds[b + 1])
            else:
                b, owner, end = -1, int(self.whole_rank[i]), int(self.num_new[i])
            slot = self.slot_of[owner][(i, b)]
            off = p - (end - w1)
            assert 0 <= off < w1, "conv halo reaches past the tail of its segment"
            return (owner * num_segs + slot) * w1 + off

        halo = np.array(
            [[locate(s.req, s.start - w1 + w) for w in range(w1)] for s in self.segments[r]],
            dtype=np.int64,
        ).reshape(-1, w1)
        final = np.array(
            [[locate(i, int(self.num_new[i]) - w1 + w) for w in range(w1)] for i in range(self.num_reqs)],
            dtype=np.int64,
        ).reshape(-1, w1)
        return ConvSources(halo, final)

    @cached_property
    def max_segments(self) -> int:
        """Segments of the rank that has the most (ranks own different numbers of requests)."""
        return max(len(segs) for segs in self.segments)

    def tail_rows(self, width: int, r: int | None = None) -> np.ndarray:
        """[max_segments, width-1] local rows holding each segment's last width-1 inputs (clamped in
        range; slots past rank r's segments repeat row 0, so that every rank gathers as many)."""
        r = self.rank if r is None else r
        w1 = width - 1
        ends = self.seg_offsets[r][1:]
        rows = ends[:, None] - w1 + np.arange(w1)[None, :]
        rows = np.concatenate([rows, np.zeros((self.max_segments - len(ends), w1), dtype=rows.dtype)])
        return np.clip(rows, 0, max(self.t_pad - 1, 0)).astype(np.int64)
