# SPDX-License-Identifier: Apache-2.0
"""A spread decode step run as vLLM's own decode of the requests this rank owns.

At a step of decode rows alone (``decode="spread"``, every row owned) each rank runs vLLM's decode
path on its own requests as if they were the whole batch. Before vLLM builds the step's attention
metadata, their values are written to the head of the runner's persistent buffers that metadata is
built from (query starts, sequence lengths on the device and the host, every KV-cache group's
block-table rows, the attention groups' slot mapping); vLLM's dispatcher then picks the CUDA graph
of that batch (FULL where vLLM captured it: the whole forward one graph, which replays what it read
at capture, those buffers' heads) and the layers run without a PCP context, as at pcp == 1: each GDN layer updates the
owned requests' states, each attention layer writes their new K/V into this rank's cache. The heads
stay as written (vLLM rewrites them before it reads them again: ``OwnedBatch.write_heads``). The
other ranks' caches get that K/V with the step's output gather (``defer_staged_kv``: the layers keep
their new rows in one ``KVStage`` as they write them, inside the graph): one collective per step.

Consecutive spread decode steps of the same owners in the same order (a batch decoding on) share one
``OwnedBatch``: its rows, query starts, exchange rows and step tensors reach the device once, and
each step moves only its sequence lengths (``write_heads``, ``step_tensors``).

With speculative decoding a request's rows are its verification rows (``query_len``: its last token
and its K drafts), the batch is vLLM's uniform verification batch of the owned requests, and the
drafter, which runs after the forward over the whole batch on every rank, reads the heads again: their
whole-batch values are kept when written and put back after the forward (``restore_heads``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from ..layers.context import DeferredKV, PCPContext, StepTensors
from ..layers.device_copy import to_device_all
from ..plan import PCPPlan


@dataclass
class OwnedBatch:
    """This rank's requests at a spread decode step, as the batch its model call runs."""

    reqs: np.ndarray  # [n] the owned requests' batch indices, in the plan's local order
    tokens: np.ndarray  # [n x query_len] their rows in the whole batch
    num_rows: int  # the batch every rank runs, in rows: the most any rank owns, padded to a graph size
    eager: bool = False  # no graph: the padded batch would exceed the runner's request buffers
    query_len: int = 1  # rows per request: one, or with speculative decoding 1 + K
    device_lens: bool = False  # sequence lengths from vLLM's device copy (speculative decoding)
    exchange_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # ``kv_exchange_rows``
    query_start_cpu: torch.Tensor | None = None  # the owned batch's query starts on the host
    # per step: group -> ``kv_exchange_slots``; the owned sequence lengths on the device; the longest of them
    exchange_slots: dict[int, torch.Tensor] = field(default_factory=dict)
    lens: torch.Tensor | None = None
    max_len: int = 0
    # on the device, once per batch: (query starts, the slot rows: owned then exchange rows clipped at 0,
    # those rows valid)
    _device: tuple | None = field(default=None, repr=False)
    _tensors: StepTensors | None = field(default=None, repr=False)  # ``step_tensors``
    _kept: tuple | None = field(default=None, repr=False)  # ``keep_heads``: (heads, their whole-batch values)

    @classmethod
    def of(cls, plan: PCPPlan, num_rows: int, eager: bool = False, device_lens: bool = False) -> OwnedBatch:
        local = plan.local_segments
        query_len = int(plan.num_new[0])
        return cls(np.array([s.req for s in local], dtype=np.int64),
                   np.asarray(plan.local_full_idx[plan.rank][: len(local) * query_len], dtype=np.int64),
                   int(num_rows), eager, query_len, device_lens, kv_exchange_rows(plan))

    @property
    def num_reqs(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        """The owned rows (``num_rows`` pads them)."""
        return len(self.tokens)

    @property
    def num_reqs_padded(self) -> int:
        """The requests of the batch every rank runs (``num_rows / query_len``)."""
        return self.num_rows // self.query_len

    def keep_heads(self, views: Iterable[torch.Tensor]) -> None:
        """The whole batch's values of buffers a spread step writes at their heads (``views``: those
        heads), to be put back after the forward (``restore_heads``) for what reads the whole batch
        then (the MTP drafter)."""
        views = [v for v in views if v.numel()]
        self._kept = views, [v.clone() for v in views]

    def restore_heads(self) -> None:
        if self._kept is not None:
            for view, value in zip(*self._kept):  # (host and device tensors)
                view.copy_(value)
            self._kept = None

    def write_heads(self, runner, attention_groups: Iterable[int] = (), keep: Iterable[torch.Tensor] = ()) -> None:
        """The owned requests' rows at the head of the runner's metadata buffers (``num_rows`` of
        them; the rows past ``num_reqs`` are padding: vLLM's metadata build fills their block-table
        rows with the null block, ``_get_slot_mappings`` their slots with -1).

        Without a drafter nothing is put back: in 0.20.2 the next ``_prepare_inputs`` rewrites each of
        these buffers before anything reads it (query starts and sequence lengths whole, block-table
        rows up to its batch's size: rows past it are stale in vLLM too, the slot mapping whole), and
        after the forward only pooling (refused with ``decode="spread"``) and the drafter read them
        (prompt logprobs read the host's query starts, which stay the whole batch's). Slots are read by attention
        layers alone (vLLM 0.20.2's GDN metadata takes
        block-table rows, not slots), so only ``attention_groups``' slot heads are written; the one
        whole-batch value read after the forward, those groups' slots where ``defer_staged_kv`` writes
        the step's new K/V, is taken first (``exchange_slots``). A step's sequence lengths are the
        host's (``num_computed_tokens`` plus one: without speculative decoding vLLM's device copy is
        the host's).

        The block-table rows come from vLLM's host copy (``BlockTable.np``: what ``commit_block_table``
        copied to the device for the whole batch this step), each table's columns up to the most
        blocks an owned request holds (``num_blocks_per_row``: a row's columns past its blocks are not
        read, by attention past its sequence length nor by the GDN metadata), and reach the device in
        the step's one copy beside the sequence lengths. One ``torch._foreach_copy_`` call then writes
        every head (the device still copies head by head: mixed dtypes and strided heads): a step's
        host work is a few tensor calls whatever the number of KV-cache groups, not two per group.

        With speculative decoding (``query_len`` rows per request) the sequence lengths are vLLM's
        device copy's (``device_lens``: the host's count drafts not yet verified under async
        scheduling; the host heads get the host's, an upper bound, as vLLM's own), and ``keep``: other
        heads the step writes (the model's inputs), kept with these (``keep_heads``) for the drafter."""
        n, rows, q = self.num_reqs, self.num_reqs_padded, self.query_len
        tokens = self.num_tokens
        device = runner.seq_lens.device
        tables = runner.input_batch.block_table.block_tables
        host = runner.optimistic_seq_lens_cpu.numpy()
        lens = np.zeros(rows, dtype=np.int32)
        lens[:n] = host[self.reqs]
        if self._device is None:
            # the host buffer of vLLM's query starts may still be read by its copy to the device (queued
            # without blocking): the owned starts are written on the device, in stream order after that
            # copy, and handed to the metadata build on the host as a tensor of their own
            # (``query_starts``). One index for the slots: the owned rows', then the exchange rows'.
            starts = (np.minimum(np.arange(rows + 1), n) * q).astype(np.int32)
            self.query_start_cpu = torch.from_numpy(starts)
            self._device = tuple(to_device_all(
                device, (starts, torch.int32), np.concatenate([self.tokens, self.exchange_rows.clip(min=0)]),
                (np.concatenate([np.ones(tokens, dtype=bool), self.exchange_rows >= 0]), torch.bool), self.reqs))
        blocks = [table.block_table.np[self.reqs, : max(1, int(table.num_blocks_per_row[self.reqs].max()))]
                  for table in tables] if n else []
        self.lens, *blocks_dev = to_device_all(device, (lens, torch.int32), *((b, torch.int32) for b in blocks))
        self.max_len = int(lens.max(initial=0))
        starts_dev, slot_rows, slot_valid, reqs_dev = self._device
        if self.device_lens:  # vLLM's device lengths of the owned requests, zero past them
            self.lens = torch.cat([runner.seq_lens.index_select(0, reqs_dev), self.lens[n:]])
        heads = [runner.query_start_loc.gpu[: rows + 1], runner.seq_lens[:rows]]
        values = [starts_dev, self.lens]
        self.exchange_slots = {}
        for g in attention_groups:  # the whole batch's slots, selected before their head is written
            slots = kv_exchange_slots(tables[g].slot_mapping.gpu, slot_rows, slot_valid)
            self.exchange_slots[g] = slots[tokens:]
            heads.append(tables[g].slot_mapping.gpu[:tokens])
            values.append(slots[:tokens])
        for table, b in zip(tables, blocks_dev):
            heads.append(table.block_table.gpu[:n, : b.shape[1]])
            values.append(b)
        keep = list(keep)
        if keep:  # what vLLM's metadata build and slots also write: padding rows' blocks and slots
            cols = max((int(t.num_blocks_per_row.max(initial=1)) for t in tables), default=1)
            self.keep_heads([*heads[:2], *keep, runner.optimistic_seq_lens_cpu[:rows],
                             *(t.slot_mapping.gpu[: self.num_rows] for t in tables),
                             *(t.block_table.gpu[:rows, :cols] for t in tables)])
        torch._foreach_copy_(heads, values)
        host[:rows] = lens

    def step_tensors(self, plan: PCPPlan, device: torch.device) -> StepTensors:
        """``plan``'s step tensors (``PCPContext``'s), built at the batch's first step: they depend on the
        owners and rows alone but for the keys each row sees (``seqused_k``, ``max_k``: the owned rows'
        sequence lengths, this step's from ``write_heads``)."""
        if self._tensors is None:
            self._tensors = StepTensors.build(plan, device)
        return dataclasses.replace(self._tensors, seqused_k=self.lens[: self.num_reqs], max_k=self.max_len)

    def verification_inputs(self, accepted, drafts) -> dict[str, SimpleNamespace]:
        """vLLM's buffers of accepted-token counts (``num_accepted_tokens``, read on the device) and of
        drafts per verifying request (``num_decode_draft_tokens``, read on the host) as the metadata
        build reads them for the owned requests: theirs at the head, the padding rows' as vLLM pads a
        batch (one accepted token, -1 drafts: no verification row)."""
        n, rows = self.num_reqs, self.num_reqs_padded
        reqs_dev = self._device[3]
        owned_accepted = torch.ones(rows, dtype=accepted.gpu.dtype, device=accepted.gpu.device)
        owned_accepted[:n] = accepted.gpu.index_select(0, reqs_dev)
        owned_drafts = torch.full((rows,), -1, dtype=drafts.cpu.dtype)
        owned_drafts[:n] = drafts.cpu[torch.from_numpy(self.reqs)]
        return {"num_accepted_tokens": SimpleNamespace(gpu=owned_accepted),
                "num_decode_draft_tokens": SimpleNamespace(cpu=owned_drafts)}

    def query_starts(self, buffer):
        """vLLM's query-start buffer as the metadata build reads it: its device tensor (the owned
        starts at its head) and the owned starts on the host."""
        return SimpleNamespace(gpu=buffer.gpu, cpu=self.query_start_cpu, np=self.query_start_cpu.numpy())


def kv_exchange_rows(plan: PCPPlan) -> np.ndarray:
    """[(N + 1) x t_pad] batch rows of a spread decode step's K/V exchange: first this rank's rows
    (their K/V kept by its model call: ``KVStage``; -1: padding), then every gathered row whose K/V
    this rank writes (rank-major; -1: padding and this rank's own rows, which its model call wrote)."""
    gathered = plan.gathered_full_idx()
    own = slice(plan.rank * plan.t_pad, (plan.rank + 1) * plan.t_pad)
    others = gathered.copy()
    others[own] = -1
    return np.concatenate([gathered[own], others])


def kv_exchange_slots(slot_mapping: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The cache slots of ``kv_exchange_rows`` (``rows``: clipped at 0, ``valid``: not -1) in the whole
    batch's ``slot_mapping``, -1 where there is no row."""
    return torch.where(valid, slot_mapping.index_select(0, rows), -1)


class KVStage:
    """Every attention layer's new K/V rows at the latest step without a PCP context, as the layer wrote
    them to its cache (``PCPFlashAttentionImpl.do_kv_cache_update`` keeps them here), so that a spread
    decode step sends the K/V its model call wrote with no call per layer: [rows, layers, 2, kv_heads,
    head_dim], a row's K and V of every layer side by side (``defer_staged_kv``).

    Kept by the layers' cache write itself, the copies are part of vLLM's CUDA graphs (captured after the
    stage is attached: ``PCPModelRunner.load_model``) and cost the host nothing where a graph replays;
    elsewhere they are two calls per layer. Every step without a PCP context keeps its first rows
    (at most the stage's): only a spread decode step's are read, at most ``max_num_reqs``."""

    def __init__(self, layers: list, rows: int, dtype: torch.dtype, device: torch.device | str):
        shapes = {(layer.impl.num_kv_heads, layer.impl.head_size) for layer in layers}
        if len(shapes) != 1:
            raise ValueError(f"one K/V stage for attention layers of different shapes {sorted(shapes)}")
        (heads, dim), = shapes
        self.rows = torch.zeros(rows, len(layers), 2, heads, dim, dtype=dtype, device=device)
        for index, layer in enumerate(layers):
            layer.impl.kv_stage = (self, index)

    def keep(self, index: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Layer ``index``'s K and V ([n, kv_heads, head_dim]) of a step's first rows."""
        if key.dtype != self.rows.dtype:
            raise TypeError(f"K/V of {key.dtype} for a K/V stage of {self.rows.dtype}")
        n = min(key.shape[0], self.rows.shape[0])
        self.rows[:n, index, 0].copy_(key[:n])
        self.rows[:n, index, 1].copy_(value[:n])


def defer_staged_kv(ctx: PCPContext, layers: list, slots: torch.Tensor) -> None:
    """A KV-cache group's new K/V of this rank's rows (the step's model call kept them in the layers'
    ``KVStage``), to be written into the other ranks' caches by the step's output gather.

    ``layers``: vLLM ``Attention`` modules of one group, their impls attached to one stage (their
    ``kv_cache`` and the impl's ``write_kv``); ``slots``: the step's ``kv_exchange_slots``."""
    t_pad = ctx.plan.t_pad
    if slots.numel() != (ctx.world_size + 1) * t_pad:
        raise ValueError(f"{slots.numel()} slots for a K/V exchange of (N + 1) x t_pad = "
                         f"{(ctx.world_size + 1) * t_pad} rows (kv_exchange_slots)")
    stage = layers[0].impl.kv_stage[0]
    if t_pad > stage.rows.shape[0]:
        raise ValueError(f"a spread decode step of {t_pad} rows; the K/V stage holds {stage.rows.shape[0]}")
    index = [layer.impl.kv_stage[1] for layer in layers]
    # this rank's rows: [t_pad, layers, 2, kv_heads, head_dim], a view where the group's layers are adjacent
    kv = (stage.rows[:t_pad, index[0]:index[-1] + 1] if index == list(range(index[0], index[-1] + 1))
          else stage.rows[:t_pad, index])

    def write(rows, slots):
        # K and V of each layer: views with a row stride of their own and each row's heads contiguous,
        # what vLLM's cache write reads (its own K and V are views of the QKV projection's rows)
        for j, layer in enumerate(layers):
            layer.impl.write_kv(layer, rows[:, j, 0], rows[:, j, 1], layer.kv_cache, slots)

    ctx.defer_kv(DeferredKV(kv, slots[t_pad:], write))
