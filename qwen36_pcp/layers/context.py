# SPDX-License-Identifier: Apache-2.0
"""The PCP context: one object per split step, passed to every PCP layer.

It holds the host plan, the step's device index tensors (built once per step from the plan: the
step's below, the GDN modes' in ``gdn_index``) and the PCP process group (vLLM's GroupCoordinator, the object
``vllm.distributed.get_pcp_group()`` returns). All PCP communication of a split step goes through
the four collectives here (``all_gather``, ``broadcast``, ``send``, ``recv``), so what a split step
sends is counted in one place: ``collectives`` lists each call with its payload, ``bytes_sent`` sums
what this rank sent. Not counted here, because they run outside a split step's context: an unsplit
step's sampled rows taken from rank 0 (``step_rows.rank0_rows``), the drafter's drafts broadcast
(``runner_hooks.drafter``), the vision tower's gather of each rank's frames (``vision_split``), spread
decode's state-block broadcasts (``spread.state_blocks``) and the collectives' warm-up.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from vllm.forward_context import get_forward_context, is_forward_context_available

from ..config import PCPConfig
from ..plan import PCPPlan
from .device_copy import Varlen, to_device_all
from .gdn_index import ConvIndex, RelayIndex, StatePassingIndex, conv_index, relay_index, state_passing_index

FORWARD_CONTEXT_KEY = "qwen36_pcp"


@dataclass(frozen=True)
class Collective:
    """One collective call as this rank issued it: its kind (``all_gather``, ``broadcast``, ``send``,
    ``recv``), the bytes of its payload (one rank's input for a gather) and the peer rank (the source
    of a broadcast or a recv, the destination of a send; -1 for a gather)."""

    kind: str
    nbytes: int
    peer: int = -1


@dataclass(frozen=True)
class DeferredKV:
    """A KV-cache group's new K/V at a spread decode step (``owned_batch.defer_staged_kv``): this rank's
    rows are in its caches already; the other ranks' rows reach them with the step's output gather."""

    kv: torch.Tensor  # [t_pad, ...]: this rank's rows (a row's K/V of every layer of the group)
    slots: torch.Tensor  # [N x t_pad]: the slot of each gathered row, -1 for this rank's rows and padding
    write: Callable[[torch.Tensor, torch.Tensor], None]  # (every rank's rows [N x t_pad, ...], slots)


@dataclass(frozen=True)
class SampleRowIndex:
    """``plan.SampleRows`` on the device."""

    full: torch.Tensor
    send: torch.Tensor
    pick: torch.Tensor


@dataclass(frozen=True)
class StepTensors:
    """The plan's per-step index tensors every layer reads, on the device."""

    local_idx: torch.Tensor  # [t_pad] full index per local row (padding -> 0)
    gathered_full_idx: torch.Tensor  # [N*t_pad] full index to write to the KV cache, -1 to skip
    gathered_of_full: torch.Tensor  # [num_tokens] gathered row of each full token's primary copy
    segments: Varlen  # this rank's segments as sequences
    seqused_k: torch.Tensor  # [S] int32, keys each segment's queries see
    seg_req: torch.Tensor  # [S] int64, request of each segment
    sample: SampleRowIndex  # where the output gather takes each request's sampled row from
    max_q: int
    max_k: int
    num_local_tokens: int

    @property
    def num_segments(self) -> int:
        return int(self.seg_req.shape[0])

    @classmethod
    def build(cls, plan: PCPPlan, device: torch.device, seq_lens: torch.Tensor | None = None) -> StepTensors:
        """``seq_lens``: each request's sequence length after the step on the device (vLLM's, which it
        corrects there under async scheduling with drafts, where the host's count runs ahead by the
        previous step's rejected drafts): a segment ending ``d`` tokens before its request's new tokens
        end sees ``seq_lens[request] - d`` keys. None: the host's counts (exact without drafts)."""
        seqs = plan.attention_seqs()
        local = plan.local_full_idx[plan.rank].copy()
        local[local < 0] = 0
        lens = np.diff(seqs.cu_q)
        rows = plan.sample_rows()
        short = np.array([plan.num_new[s.req] - s.end for s in plan.local_segments], dtype=np.int32)
        segments, local_idx, gathered_full_idx, gathered_of_full, seqused_k, seg_req, short, *sample = Varlen.of_all(
            [seqs.cu_q], device, local, plan.gathered_full_idx(), plan.gathered_of_full,
            (seqs.seqused_k, torch.int32), seqs.reqs, (short, torch.int32), rows.full, rows.send, rows.pick)
        if seq_lens is not None and len(seqs.reqs):
            seqused_k = seq_lens.index_select(0, seg_req).to(torch.int32) - short
        return cls(
            local_idx=local_idx,
            gathered_full_idx=gathered_full_idx,
            gathered_of_full=gathered_of_full,
            segments=segments,
            seqused_k=seqused_k,
            seg_req=seg_req,
            sample=SampleRowIndex(*sample),
            max_q=int(lens.max()) if len(lens) else 0,
            max_k=int(seqs.seqused_k.max()) if len(seqs.seqused_k) else 0,
            num_local_tokens=plan.num_local_tokens,
        )


@dataclass(frozen=True)
class VerifiedRows:
    """The verification rows this rank computes (first in its local rows): ``num_reqs`` requests,
    ``rows`` rows; ``picks``: their places among the step's verified requests (None: all of them, in
    order), ``query_start`` [num_reqs + 1] their local bounds (device)."""

    rows: int
    num_reqs: int
    picks: torch.Tensor | None
    query_start: torch.Tensor | None  # None: no verification rows at this step


class PCPContext:
    """A split step: the plan, its device tensors and the PCP group, for every PCP layer.

    ``num_tokens_padded`` is the runner's row count for the step (pcp=1's batch with its padding): the
    rows the output gather returns and the row count narrow layers run at.
    """

    def __init__(self, plan: PCPPlan, group, device: torch.device | str, num_tokens_padded: int | None = None,
                 tensors: StepTensors | None = None, seq_lens: torch.Tensor | None = None):
        if group.world_size != plan.world_size or group.rank_in_group != plan.rank:
            raise ValueError(
                f"plan is for rank {plan.rank}/{plan.world_size}, group is "
                f"{group.rank_in_group}/{group.world_size}"
            )
        self.plan = plan
        self.group = group
        self.device = torch.device(device)
        self.num_tokens_padded = plan.num_tokens if num_tokens_padded is None else int(num_tokens_padded)
        if self.num_tokens_padded < plan.num_tokens:
            raise ValueError("num_tokens_padded is smaller than the number of scheduled tokens")
        # (a spread decode step's, built once per batch: ``OwnedBatch.step_tensors``)
        self.t = StepTensors.build(plan, self.device, seq_lens) if tensors is None else tensors
        self._conv: dict[int, ConvIndex] = {}
        self.collectives: list[Collective] = []
        self.deferred_kv: list[DeferredKV] = []  # written by gather_output
        # what a layer derives once per step from vLLM's metadata, by the metadata object's id (the
        # object kept beside it, so that the id stays its own)
        self.derived: dict[int, tuple] = {}

    def for_rows(self, num_tokens_padded: int) -> PCPContext:
        """This step's context for a call over ``num_tokens_padded`` rows (another model over the same
        step: the MTP drafter's first pass): the same plan and device tensors, built once per step."""
        if num_tokens_padded == self.num_tokens_padded:
            return self
        if num_tokens_padded < self.plan.num_tokens:
            raise ValueError("num_tokens_padded is smaller than the number of scheduled tokens")
        other = copy.copy(self)
        other.num_tokens_padded, other.collectives, other.deferred_kv = int(num_tokens_padded), [], []
        return other

    @property
    def config(self) -> PCPConfig:
        return self.plan.config

    @cached_property
    def gdn(self) -> PCPContext | None:
        """The context the GDN layers' PCP path runs with: this one where no request is verified, else
        one of ``plan.gdn_plan`` (the other requests; their rows follow this rank's ``verified.rows``
        verification rows), its collectives counted here. None: every request is verified."""
        sub = self.plan.gdn_plan
        if sub is self.plan or sub is None:
            return self if sub is not None else None
        other = PCPContext(sub, self.group, self.device)
        other.collectives = self.collectives
        return other

    @cached_property
    def verified(self) -> VerifiedRows:
        """The verification rows at the head of this rank's rows (``PCPPlan.verified_on``)."""
        plan = self.plan
        if not plan.verify.any():  # (no device copy at a step without drafts)
            return VerifiedRows(rows=0, num_reqs=0, picks=None, query_start=None)
        mine = plan.verified_on()
        order = np.cumsum(plan.verify) - 1  # each verified request's place among them (vLLM's spec order)
        starts = np.concatenate([[0], np.cumsum(plan.num_new[mine])])
        every = len(mine) == int(plan.verify.sum())
        picks, starts_dev = self.to_device_all(order[mine], (starts, torch.int32))
        return VerifiedRows(rows=int(starts[-1]), num_reqs=len(mine), picks=None if every else picks,
                            query_start=starts_dev)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def rank(self) -> int:
        return self.plan.rank

    def to_device_all(self, *arrays) -> list[torch.Tensor]:
        return to_device_all(self.device, *arrays)

    # ------------------------------------------------------------------ communication
    @property
    def bytes_sent(self) -> int:
        """Bytes this rank put on the wire this step (a gather's input, a broadcast it sourced, a send)."""
        return sum(c.nbytes for c in self.collectives
                   if c.kind in ("all_gather", "send") or (c.kind == "broadcast" and c.peer == self.rank))

    def _log(self, kind: str, x: torch.Tensor, peer: int = -1) -> None:
        self.collectives.append(Collective(kind, x.numel() * x.element_size(), peer))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along dim 0, rank-major."""
        x = x.contiguous()
        self._log("all_gather", x)
        return self.group.all_gather(x, dim=0)

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank (``x`` gives the shape and dtype on the others)."""
        x = x.contiguous()
        self._log("broadcast", x, src)
        return self.group.broadcast(x, src)

    def broadcast_primary(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank: what every rank computed for the replicated requests is kept
        from the primary copy only, so a split step cannot leave the ranks' caches apart bit by bit."""
        return self.broadcast(x, 0)

    def send(self, x: torch.Tensor, dst: int) -> None:
        """``x`` to rank ``dst`` alone (it calls ``recv``)."""
        x = x.contiguous()
        self._log("send", x, dst)
        self.group.send(x, dst)

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        """What rank ``src`` sends, shaped and typed as ``like``."""
        self._log("recv", like, src)
        return self.group.recv(like.shape, like.dtype, src)

    def defer_kv(self, layer_kv: DeferredKV) -> None:
        """Carry a KV-cache group's new K/V to the other ranks with the output gather."""
        self.deferred_kv.append(layer_kv)

    def _gather_with_deferred_kv(self, x: torch.Tensor) -> torch.Tensor:
        """``all_gather(x)``. The step's deferred K/V (``defer_kv``) rides in the same collective, as
        bytes after ``x``, and the other ranks' rows are written into this rank's caches."""
        pending, self.deferred_kv = self.deferred_kv, []
        if not pending:
            return self.all_gather(x)
        parts = [x.contiguous(), *(p.kv.contiguous() for p in pending)]
        sizes = [p.numel() * p.element_size() for p in parts]
        payload = torch.cat([p.reshape(-1).view(torch.uint8) for p in parts])
        gathered = self.all_gather(payload.view(1, -1)).split(sizes, dim=1)  # [N, bytes] each
        for p, part in zip(pending, gathered[1:]):
            p.write(part.contiguous().view(p.kv.dtype).view(-1, *p.kv.shape[1:]), p.slots)  # [N x t_pad, ...]
        return gathered[0].contiguous().view(x.dtype).view(-1, *x.shape[1:])

    def gather_output(self, hidden: torch.Tensor, all_rows: bool, keep_local: bool = False) -> torch.Tensor:
        """The step's hidden states in the runner's row order: ``num_tokens_padded`` rows, padding zero.

        vLLM reads only the row of each request's last new token (it samples from it) unless a request
        wants prompt logprobs, which read every row: ``all_rows=False`` gathers ``num_reqs`` rows per
        rank instead of ``t_pad`` and leaves the other rows zero; the rows vLLM reads are the same bits.
        ``keep_local``: this rank's own rows stay at their places too (no communication): a split MTP
        first pass reads them (``draft_first_pass``). The step's deferred K/V (a spread decode step's)
        travels in the same collective: the step's one collective.
        """
        out = hidden.new_zeros(self.num_tokens_padded, *hidden.shape[1:])
        if all_rows:
            gathered = self._gather_with_deferred_kv(hidden)
            out[: self.plan.num_tokens] = gathered.index_select(0, self.t.gathered_of_full)
            return out
        if keep_local:
            n = self.t.num_local_tokens
            out.index_copy_(0, self.t.local_idx[:n], hidden[:n])
        rows = self.sample_rows
        picked = self._gather_with_deferred_kv(hidden.index_select(0, rows.send))
        out.index_copy_(0, rows.full, picked.index_select(0, rows.pick))
        return out

    # ------------------------------------------------------------- per-step indices
    @property
    def sample_rows(self) -> SampleRowIndex:
        return self.t.sample

    def conv_index(self, width: int) -> ConvIndex:
        """The halo indices of a short conv of this width (once per step and width)."""
        if width not in self._conv:
            self._conv[width] = conv_index(self.plan, self.device, width)
        return self._conv[width]

    @cached_property
    def state_passing(self) -> StatePassingIndex:
        return state_passing_index(self.plan, self.device)

    @cached_property
    def relay(self) -> RelayIndex:
        return relay_index(self.plan, self.device)


@contextlib.contextmanager
def running_step(ctx: PCPContext, cudagraph: tuple | None = None):
    """vLLM's forward context while a model call runs this rank's rows of a planned step: ``ctx`` for
    the PCP layers (``current_pcp_context``) and, given ``(mode, batch descriptor)``, that CUDA graph
    dispatch instead of the whole batch's; all put back after."""
    forward_context = get_forward_context()
    saved = forward_context.cudagraph_runtime_mode, forward_context.batch_descriptor
    forward_context.additional_kwargs[FORWARD_CONTEXT_KEY] = ctx
    if cudagraph is not None:
        forward_context.cudagraph_runtime_mode, forward_context.batch_descriptor = cudagraph
    try:
        yield
    finally:
        forward_context.additional_kwargs.pop(FORWARD_CONTEXT_KEY, None)
        forward_context.cudagraph_runtime_mode, forward_context.batch_descriptor = saved


def current_pcp_context() -> PCPContext | None:
    """The PCP context of the running step (set by the runner on split steps), or None."""
    if not is_forward_context_available():
        return None
    return get_forward_context().additional_kwargs.get(FORWARD_CONTEXT_KEY)
