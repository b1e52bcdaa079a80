"""A spread decode step run as vLLM's own decode of the requests this rank owns.

At a step of decode rows alone (``decode="spread"``, every row owned) each rank runs vLLM's decode
path on its own requests as if they were the whole batch. Before vLLM builds the step's attention
metadata, their values are written to the head of the runner's persistent buffers that metadata is
built from (query starts, sequence lengths on the device and the host, every KV-cache group's
block-table rows and slot mapping); vLLM's dispatcher then picks the CUDA graph of that batch (FULL
where vLLM captured it: the whole forward one graph, which replays what it read at capture, those
buffers' heads) and the layers run without a PCP context, as at pcp == 1: each GDN layer updates the
owned requests' states, each attention layer writes their new K/V into this rank's cache. The heads
stay as written (vLLM rewrites them before it reads them again: ``OwnedBatch.write_heads``). The
other ranks' caches get that K/V with the step's output gather (``defer_cached_kv``): one collective
per step.

Consecutive spread decode steps of the same owners in the same order (a batch decoding on) share one
``OwnedBatch``: its rows, query starts, exchange rows and step tensors reach the device once, and
each step moves only its sequence lengths (``write_heads``, ``step_tensors``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from .layers.context import DeferredKV, PCPContext, StepTensors, to_device_all
from .plan import PCPPlan


@dataclass
class OwnedBatch:
    """This rank's requests at a spread decode step, as the batch its model call runs."""

    reqs: np.ndarray  # [n] the owned requests' batch indices, in the plan's local order
    tokens: np.ndarray  # [n] their rows (one new token each) in the whole batch
    num_rows: int  # the batch every rank runs: the most any rank owns, padded to a graph size
    eager: bool = False  # no graph: the padded batch would exceed the runner's request buffers
    exchange_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # ``kv_exchange_rows``
    query_start_cpu: torch.Tensor | None = None  # the owned batch's query starts on the host
    # per step: group -> ``kv_exchange_slots``; the owned sequence lengths on the device; the longest of them
    exchange_slots: dict[int, torch.Tensor] = field(default_factory=dict)
    lens: torch.Tensor | None = None
    max_len: int = 0
    # on the device, once per batch: (reqs, tokens, query starts, exchange rows clipped at 0, rows valid)
    _device: tuple | None = field(default=None, repr=False)
    _tensors: StepTensors | None = field(default=None, repr=False)  # ``step_tensors``

    @classmethod
    def of(cls, plan: PCPPlan, num_rows: int, eager: bool = False) -> OwnedBatch:
        local = plan.local_segments
        return cls(np.array([s.req for s in local], dtype=np.int64),
                   np.asarray(plan.local_full_idx[plan.rank][: len(local)], dtype=np.int64), int(num_rows), eager,
                   kv_exchange_rows(plan))

    @property
    def num_reqs(self) -> int:
        return len(self.reqs)

    def write_heads(self, runner, keep_slots: Iterable[int] = ()) -> None:
        """The owned requests' rows at the head of the runner's metadata buffers (``num_rows`` of
        them; the rows past ``num_reqs`` are padding: vLLM's metadata build fills their block-table
        rows with the null block, ``_get_slot_mappings`` their slots with -1).

        Nothing is put back: in 0.20.2 the next ``_prepare_inputs`` rewrites each of these buffers
        before anything reads it (query starts and sequence lengths whole, block-table rows up to its
        batch's size: rows past it are stale in vLLM too, the slot mapping whole), and after the
        forward only pooling and speculative decoding read them, both refused with
        ``decode="spread"`` (prompt logprobs read the host's query starts, which stay the whole
        batch's). The one whole-batch value read after the forward, the slots of the groups in
        ``keep_slots`` where ``defer_cached_kv`` reads and writes the step's new K/V, is taken first
        (``exchange_slots``). A step's sequence lengths are the host's (``num_computed_tokens`` plus
        one: without speculative decoding vLLM's device copy is the host's); they are all that a later
        step of the same batch moves to the device."""
        n, rows = self.num_reqs, self.num_rows
        device = runner.seq_lens.device
        tables = runner.input_batch.block_table.block_tables
        host = runner.optimistic_seq_lens_cpu.numpy()
        lens = np.zeros(rows, dtype=np.int32)
        lens[:n] = host[self.reqs]
        if self._device is None:
            # the host buffer of vLLM's query starts may still be read by its copy to the device (queued
            # without blocking): the owned starts are written on the device, in stream order after that
            # copy, and handed to the metadata build on the host as a tensor of their own
            # (``query_starts``)
            starts = np.minimum(np.arange(rows + 1), n).astype(np.int32)
            self.query_start_cpu = torch.from_numpy(starts)
            *device_rows, self.lens = to_device_all(
                device, self.reqs, self.tokens, (starts, torch.int32), self.exchange_rows.clip(min=0),
                (self.exchange_rows >= 0, torch.bool), (lens, torch.int32))
            self._device = tuple(device_rows)
        else:
            (self.lens,) = to_device_all(device, (lens, torch.int32))
        self.max_len = int(lens.max(initial=0))
        reqs, tokens, starts_dev, rows_dev, valid = self._device
        self.exchange_slots = {g: kv_exchange_slots(tables[g].slot_mapping.gpu, rows_dev, valid) for g in keep_slots}
        runner.query_start_loc.gpu[: rows + 1].copy_(starts_dev)
        runner.seq_lens[:rows].copy_(self.lens)
        host[:rows] = lens
        if n:
            for table in tables:  # each selected before its head is written
                table.block_table.gpu[:n].copy_(table.block_table.gpu.index_select(0, reqs))
                table.slot_mapping.gpu[:n].copy_(table.slot_mapping.gpu.index_select(0, tokens))

    def step_tensors(self, plan: PCPPlan, device: torch.device) -> StepTensors:
        """``plan``'s step tensors (``PCPContext``'s), built at the batch's first step: they depend on the
        owners and rows alone but for the keys each row sees (``seqused_k``, ``max_k``: the owned rows'
        sequence lengths, this step's from ``write_heads``)."""
        if self._tensors is None:
            self._tensors = StepTensors.build(plan, device)
        return dataclasses.replace(self._tensors, seqused_k=self.lens[: self.num_reqs], max_k=self.max_len)

    def query_starts(self, buffer):
        """vLLM's query-start buffer as the metadata build reads it: its device tensor (the owned
        starts at its head) and the owned starts on the host."""
        return SimpleNamespace(gpu=buffer.gpu, cpu=self.query_start_cpu, np=self.query_start_cpu.numpy())


def kv_exchange_rows(plan: PCPPlan) -> np.ndarray:
    """[(N + 1) x t_pad] batch rows of a spread decode step's K/V exchange: first this rank's rows
    (their K/V read back from its cache; -1: padding), then every gathered row whose K/V this rank
    writes (rank-major; -1: padding and this rank's own rows, which its model call wrote)."""
    gathered = plan.gathered_full_idx()
    own = slice(plan.rank * plan.t_pad, (plan.rank + 1) * plan.t_pad)
    others = gathered.copy()
    others[own] = -1
    return np.concatenate([gathered[own], others])


def kv_exchange_slots(slot_mapping: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The cache slots of ``kv_exchange_rows`` (``rows``: clipped at 0, ``valid``: not -1) in the whole
    batch's ``slot_mapping``, -1 where there is no row."""
    return torch.where(valid, slot_mapping.index_select(0, rows), -1)


def defer_cached_kv(ctx: PCPContext, layers: Iterable, slots: torch.Tensor) -> None:
    """Each attention layer's new K/V of this rank's rows, read back from its cache (where the model
    call wrote it), to be written into the other ranks' caches by the step's output gather.

    ``layers``: vLLM ``Attention`` modules (their ``kv_cache``, [2, blocks, block_size, kv_heads,
    head_dim] in any stride order, and their impl's ``do_kv_cache_update``); ``slots``: the step's
    ``kv_exchange_slots``."""
    t_pad = ctx.plan.t_pad
    if slots.numel() != (ctx.world_size + 1) * t_pad:
        raise ValueError(f"{slots.numel()} slots for a K/V exchange of (N + 1) x t_pad = "
                         f"{(ctx.world_size + 1) * t_pad} rows (kv_exchange_slots)")
    mine = slots[:t_pad].clamp(min=0)  # padding rows read slot 0; nobody writes them
    others = slots[t_pad:]
    where: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # block size -> (block, offset) of ``mine``
    for layer in layers:
        block_size = layer.kv_cache.shape[2]
        if block_size not in where:
            where[block_size] = (mine // block_size, mine % block_size)
        # [rows, 2, kv_heads, head_dim], one gather: K and V of a row side by side, so that after the
        # output gather each is a [rows, kv_heads, head_dim] view the cache write reads as is
        kv = layer.kv_cache.permute(1, 2, 0, 3, 4)[where[block_size]]

        def write(k, v, slots, layer=layer):
            layer.impl.do_kv_cache_update(layer, k, v, layer.kv_cache, slots)

        ctx.defer_kv(DeferredKV(kv, others, write))
