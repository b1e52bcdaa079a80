# SPDX-License-Identifier: Apache-2.0
"""``decode="spread"``'s part of the model runner.

Each decode row goes to its request's owner (``decode_owners``), and a step that hands a request's
states over from its owner is planned (the GDN layers broadcast them first) even when nothing splits. A
spread decode step (every row owned) runs each rank's own requests as vLLM's batch (``owned_batch``),
every rank's plan padded to the size of the batch the busiest rank runs (``owned_rows``). Such a plan
and batch depend on the owners and that size alone (every row one token: its request's position), so
the next spread decode step with the same ones reuses them at its own computed-token counts
(``PCPPlan.with_computed``; the batch's device rows and step tensors built once). With speculative
decoding owned requests' states go to every rank before any step that computes them whole
(``hand_over_states``), as at a step of decode rows without drafts.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.worker import mamba_utils

from ..layers.context import PCPContext
from ..layers.pcp_attention import PCPFlashAttentionImpl
from ..plan import PCPPlan
from ..plan_records import spread_decode_step
from ..step_rows import local_rows
from .decode_owners import DecodeOwners
from .owned_batch import KVStage, OwnedBatch, defer_staged_kv
from .state_blocks import (
    MAX_PAYLOAD_BYTES,
    hand_over_request_states,
    largest_payload_bytes,
    share_completed_state_blocks,
)


class SpreadDecode:
    """The runner's part with ``decode="spread"``: it owns the decode owners, the latest owned batch and
    the K/V stage, and runs the steps of owned rows (created in the runner's ``__init__``).

    The model's layer lists (``attention_groups``, ``state_groups``) are found once, after vLLM set up
    the KV cache: vLLM 0.20.2 replaces ``kv_cache_config`` before the first step only, with the same
    groups and layer names."""

    def __init__(self, runner):
        self.runner = runner
        self.group = runner.pcp_group
        self.owners = DecodeOwners(self.group.world_size)
        # the latest spread decode step's (owners and rows, plan, batch): the next step of the same
        # batch reuses them (``reuse``)
        self.latest: tuple[tuple, PCPPlan, OwnedBatch] | None = None
        self.kv_stage: KVStage | None = None

    # ------------------------------------------------------------------------ the plan
    def assign(self, num_new: np.ndarray, num_computed: np.ndarray, drafts):
        """(each request's owner, or -1; the rank handing each request's states over, or -1)."""
        batch, n = self.runner.input_batch, len(num_new)
        verify = None if drafts is None else drafts.verify
        decode_rows = None if drafts is None else (np.zeros(n, dtype=bool) if verify is None else verify)
        owner, handover = self.owners.step(batch.req_ids[:n], num_computed, num_new, batch.num_prompt_tokens[:n],
                                           self.runner.requests, decode_rows)
        if drafts is not None:  # every state block of theirs, before the step; no plan reads it
            self.hand_over_states(handover)
            handover = np.full(n, -1, dtype=np.int64)
        return owner, handover

    def reuse(self, owner: np.ndarray, num_new: np.ndarray, drafts, num_computed: np.ndarray):
        """(the latest spread decode step's plan and batch at this step's counts where this step is the
        same one, else None; the rows the step's batch runs: 0 where it is no spread decode step,
        negative where it runs eagerly, ``owned_rows``)."""
        spread = spread_decode_step(owner, num_new) and (drafts is None or drafts.uniform)
        rows = self.owned_rows(owner, num_new) if spread else 0
        if rows and self.latest is not None and self.latest[0] == self._key(owner, rows, num_new):
            _, plan, owned = self.latest
            return (plan.with_computed(num_computed), owned), rows
        return None, rows

    def batch(self, plan: PCPPlan, rows: int) -> OwnedBatch:
        """The batch of this rank's own requests of a spread decode step's ``plan`` (``rows``:
        ``reuse``'s), kept for the next steps of the same owners and size."""
        owned = OwnedBatch.of(plan, plan.t_pad, eager=rows < 0,
                              device_lens=self.runner.speculative_config is not None)
        self.latest = self._key(plan.owner, rows, plan.num_new), plan, owned
        return owned

    @staticmethod
    def _key(owner: np.ndarray, rows: int, num_new: np.ndarray) -> tuple:
        """What a spread decode step's plan and batch depend on: the owners, the batch's rows and the
        rows per request."""
        return owner.tobytes(), rows, int(num_new[0])

    def owned_rows(self, owner: np.ndarray, num_new: np.ndarray) -> int:
        """The batch every rank runs at a spread decode step, in rows: the most requests any rank owns
        (each ``num_new`` rows: one, or 1 + K verification rows), padded as vLLM's dispatcher pads a
        uniform decode batch of that size (to its CUDA graph's size). Negative (the unpadded size, run
        eagerly) where the padded batch exceeds the runner's request buffers: the capture sizes reach
        twice ``max_num_seqs``."""
        q = int(num_new[0])
        rows = int(np.bincount(owner, minlength=self.group.world_size).max()) * q
        padded = self.runner.cudagraph_dispatcher.dispatch(rows, uniform_decode=True)[1].num_tokens
        fits = padded % q == 0 and padded // q <= self.runner.max_num_reqs
        return padded if fits else -rows  # past the request buffers: eager

    def hand_over_states(self, handover: np.ndarray) -> None:
        """With speculative decoding: every GDN state block of the requests ``handover`` names, from
        their owners to every rank (``state_blocks.hand_over_request_states``)."""
        if not (handover >= 0).any():
            return
        _, block_ids, caches = self.gdn_states()
        hand_over_request_states(self.group, handover, block_ids, caches)

    # ------------------------------------------------------------- vLLM's step of the owned batch
    def prepare(self, owned: OwnedBatch, scheduler_output, num_new: np.ndarray):
        """After ``_prepare_inputs``: the owned batch's values at the heads of the runner's buffers; with
        a drafter, the whole batch's metadata it reads after the forward (returned) and the heads it
        reads kept."""
        keep, drafter_metadata = (), None
        if self.runner.speculative_config is not None:  # read by the drafter after the forward
            drafter_metadata = self.drafter_metadata(scheduler_output, num_new)
            keep = self.model_input_heads(owned.num_rows)
        owned.write_heads(self.runner, attention_groups=[g for g, _ in self.attention_groups], keep=keep)
        return drafter_metadata

    def drafter_metadata(self, scheduler_output, num_new: np.ndarray):
        """The whole batch's common metadata for the drafter's KV-cache group, built by vLLM's own
        ``_build_attention_metadata`` with no layer's metadata (its attention groups left out while it
        runs): what vLLM hands the drafter at pcp == 1, its tensors views of the runner's buffers, whose
        heads the spread step writes and puts back after its forward (``OwnedBatch.keep_heads``)."""
        runner = self.runner
        num_reqs, num_tokens = len(num_new), int(num_new.sum())
        tables = runner.input_batch.block_table.block_tables
        groups, runner.attn_groups = runner.attn_groups, [[] for _ in runner.attn_groups]
        try:
            return runner.vllm("_build_attention_metadata")(
                num_tokens=num_tokens, num_reqs=num_reqs, max_query_len=int(num_new.max()),
                use_spec_decode=True, num_scheduled_tokens=scheduler_output.num_scheduled_tokens,
                slot_mappings={g: t.slot_mapping.gpu[:num_tokens] for g, t in enumerate(tables)})[1]
        finally:
            runner.attn_groups = groups

    def model_input_heads(self, rows: int) -> list[torch.Tensor]:
        """The heads of the model's input buffers a spread step writes (``forward``) that the drafter
        reads after it (the target's ids and positions; vLLM 0.20.2's drafter reads no embeddings of the
        runner's, which ``_preprocess`` writes after this is kept)."""
        runner = self.runner
        positions = runner.mrope_positions.gpu[:, :rows] if runner.uses_mrope else runner.positions[:rows]
        return [runner.input_ids.gpu[:rows], positions]

    def slot_mappings(self, step, ubatch_slices=None):
        """vLLM's slot mappings of the owned batch: the owned rows' slots at the head (written by
        ``OwnedBatch.write_heads``), -1 past them to the batch's size."""
        owned = step.owned
        return self.runner.vllm("_get_slot_mappings")(owned.num_rows, owned.num_reqs_padded, owned.num_tokens,
                                                      ubatch_slices)

    def dispatch(self, step, force_eager: bool, kwargs: dict):
        """vLLM's dispatch of a decode batch of the owned requests' size, as at pcp == 1."""
        rows, q = step.owned.num_rows, step.owned.query_len
        kwargs.update(num_tokens=rows, num_reqs=rows // q, num_scheduled_tokens_np=np.full(rows // q, q, np.int32),
                      max_num_scheduled_tokens=q, use_cascade_attn=False)
        result = self.runner.vllm("_determine_batch_execution_and_padding")(
            force_eager=force_eager or step.owned.eager, **kwargs)
        if result[1].num_tokens != rows:  # the heads, slots and metadata are written for ``rows``
            raise RuntimeError(
                f"qwen36_pcp: vLLM dispatched a spread decode step of {rows} rows as a batch of "
                f"{result[1].num_tokens} (its padding no longer matches the plan's); run with "
                "decode='replicated'")
        return result

    def attention_metadata(self, step, kwargs: dict):
        """vLLM's metadata of a decode batch of the owned requests (at the buffers' heads), padded to the
        batch every rank runs; with speculative decoding their accepted-token counts and drafts in place
        of the whole batch's, and the drafter's metadata the whole batch's (``drafter_metadata``)."""
        owned, runner = step.owned, self.runner
        if owned.num_reqs == 0:  # this rank owns no request: the model does not run
            return {}, step.drafter_metadata
        kwargs.update(num_tokens=owned.num_tokens, num_reqs=owned.num_reqs, num_tokens_padded=owned.num_rows,
                      num_reqs_padded=owned.num_reqs_padded, max_query_len=owned.query_len, logits_indices=None,
                      cascade_attn_prefix_lens=None)
        swapped = {"query_start_loc": owned.query_starts(runner.query_start_loc)}
        if runner.speculative_config is not None:
            swapped.update(owned.verification_inputs(runner.num_accepted_tokens, runner.num_decode_draft_tokens))
        whole = {name: getattr(runner, name) for name in swapped}
        try:
            for name, value in swapped.items():
                setattr(runner, name, value)
            attn_metadata, common = runner.vllm("_build_attention_metadata")(**kwargs)
        finally:
            for name, value in whole.items():
                setattr(runner, name, value)
        return attn_metadata, (common if runner.speculative_config is None else step.drafter_metadata)

    def forward(self, step, input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs):
        """A spread decode step: vLLM's forward of the batch of this rank's own requests (no PCP
        context: the layers run as at pcp == 1, in vLLM's CUDA graph of that batch), then one
        all-gather of every rank's sampled rows and new K/V (at the whole batch's slots, taken by
        ``OwnedBatch.write_heads``).

        vLLM hands the model the head of its input buffers (``num_rows`` rows: a graph replays what
        it read at capture, those heads); the owned requests' ids, positions and embeddings are
        written there from the whole batch's rows."""
        runner, plan, owned = self.runner, step.plan, step.owned
        num_tokens = plan.num_tokens
        ctx = PCPContext(plan, self.group, runner.device, num_tokens_padded=num_tokens,
                         tensors=owned.step_tensors(plan, runner.device))
        idx = ctx.t.local_idx
        try:
            if owned.num_reqs:
                n = max(num_tokens, owned.num_rows)  # the batch's rows, and the heads the model reads
                whole = (runner.input_ids.gpu[:n] if input_ids is not None else None,
                         runner.mrope_positions.gpu[:, :n] if positions.dim() == 2 else runner.positions[:n],
                         runner.inputs_embeds.gpu[:n] if inputs_embeds is not None else None)
                hidden = runner.vllm("_model_forward")(
                    local_rows(whole[0], idx, 0, in_place=True), local_rows(whole[1], idx, -1, in_place=True),
                    intermediate_tensors, local_rows(whole[2], idx, 0, in_place=True), **model_kwargs)
            else:  # no request of its own: nothing to compute
                hidden = torch.zeros(owned.num_rows, runner.model_config.get_hidden_size(), dtype=runner.dtype,
                                     device=runner.device)
            for gid, layers in self.attention_groups:
                defer_staged_kv(ctx, layers, owned.exchange_slots[gid])
            out = ctx.gather_output(hidden, all_rows=runner.drafter_part.reads_every_row(False))
        finally:
            owned.restore_heads()  # (kept for the drafter only)
        return out

    def share_filled_state_blocks(self, plan: PCPPlan) -> None:
        """After a planned step, with prefix caching (vLLM's ``mamba_cache_mode="align"``): the GDN
        states of the blocks this step's owned decode rows filled, from their owners to every rank
        (``state_blocks``)."""
        if self.runner.cache_config.mamba_cache_mode != "align" or (plan.owner < 0).all():
            return
        block_size, block_ids, caches = self.gdn_states()
        share_completed_state_blocks(self.group, plan.owner, plan.num_computed + plan.num_new, block_size,
                                     block_ids, caches)

    # ------------------------------------------------------------------ layers, warm-up
    @functools.cached_property
    def state_groups(self):
        """The GDN KV-cache groups, their block size and per group its layers (after the KV cache is
        set up)."""
        group_ids, spec = mamba_utils.get_mamba_groups(self.runner.kv_cache_config)
        return group_ids, spec.block_size, [self.layers_of_group(g) for g in group_ids]

    def gdn_states(self):
        """What ``state_blocks`` sends GDN states with: the GDN KV-cache groups' block size, request i's
        block ids in each of them (of this step's batch), and per group every state tensor of its
        layers."""
        runner = self.runner
        group_ids, block_size, layers = self.state_groups
        req_ids = runner.input_batch.req_ids
        return (block_size, lambda i: [runner.requests[req_ids[i]].block_ids[g] for g in group_ids],
                [[state for layer in group for state in layer.kv_cache] for group in layers])

    @functools.cached_property
    def attention_groups(self) -> list[tuple[int, list[Attention]]]:
        """The model's attention layers per KV-cache group (the MTP drafter's left out)."""
        ours = {id(m) for m in self.model_attention_layers()}
        groups = [(gid, [layer for layer in self.layers_of_group(gid) if id(layer) in ours])
                  for gid in range(len(self.runner.kv_cache_config.kv_cache_groups))]
        return [(gid, found) for gid, found in groups if found]

    def model_attention_layers(self) -> list[Attention]:
        """The model's attention layers (the MTP drafter, a model of its own, left out)."""
        return [m for m in self.runner.model.modules() if isinstance(m, Attention)]

    def layers_of_group(self, gid: int) -> list:
        """The layers of KV-cache group ``gid``, as vLLM's forward context holds them."""
        runner = self.runner
        layers = runner.compilation_config.static_forward_context
        return [layers[name] for name in runner.kv_cache_config.kv_cache_groups[gid].layer_names]

    def attach_kv_stage(self, layers: list | None = None) -> None:
        """After ``load_model``: the model's attention layers (or ``layers``) keep the new K/V rows they
        write in one ``KVStage`` of ``max_num_reqs`` x (1 + K) rows (the most a spread decode step runs), attached
        before vLLM captures its CUDA graphs so that they hold the copies (vLLM captures in
        ``capture_model``, after it)."""
        runner = self.runner
        layers = self.model_attention_layers() if layers is None else layers
        other = [type(layer.impl).__name__ for layer in layers if not isinstance(layer.impl, PCPFlashAttentionImpl)]
        if other:
            raise RuntimeError(f"qwen36_pcp: decode=\"spread\" needs the PCP attention impl on every attention "
                               f"layer, found {sorted(set(other))}")
        if layers:
            self.kv_stage = KVStage(layers, runner.max_num_reqs * runner.uniform_decode_query_len, runner.dtype,
                                    runner.device)

    def warm_up(self) -> None:
        """While vLLM profiles memory, with GDN states to send (MTP's hand-overs, prefix caching's filled
        blocks): a state broadcast at its largest. Its sender holds the blocks and the packed payload at
        once, so the profile counts twice that, not the KV cache."""
        runner = self.runner
        if runner.speculative_config is None and runner.cache_config.mamba_cache_mode != "align":
            return
        largest = largest_payload_bytes([m for m in runner.model.modules() if isinstance(m, MambaBase)],
                                        MAX_PAYLOAD_BYTES)
        held = torch.zeros(2 * largest, dtype=torch.uint8, device=runner.device)
        self.group.broadcast(held[:largest], 0)
        del held
