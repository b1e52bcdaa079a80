# SPDX-License-Identifier: Apache-2.0
"""The model runner at pcp > 1: vLLM's V1 ``GPUModelRunner`` with split steps and a replicated KV cache.

Each step: ``_prepare_inputs`` (vLLM's, on the whole batch, the same on every rank) ends with the
step's plan, built once on the host from what every rank already holds (tokens in the cache, tokens
scheduled now: no collective). A step that splits a prompt runs without CUDA graphs (they were
captured for whole-batch sizes; the torch.compile'd graph still runs), each rank runs the model on its
rows with the step's ``PCPContext`` in vLLM's forward context, and one all-gather brings every rank
the rows vLLM reads next (each request's logits rows: its last row, and with MTP drafts every
verification row; every row when a request wants prompt logprobs), so sampling, logprobs and prompt
logprobs see what they see at pcp == 1. With MTP a split step also carries the requests verifying
drafts, computed whole (``PCPPlan(verify=...)``). An unsplit step (decode, short
prompts) runs on every rank as at pcp == 1 and takes the rows that get sampled from rank 0; with
``decode="spread"`` a step's decode rows go each to its request's owner instead, planned as a split
step is; at a step of decode rows alone each rank runs vLLM's own decode of the requests it owns
(``owned_batch``), through vLLM's CUDA graph of that batch.

KV cache: vLLM 0.20.2 would shard it over the PCP ranks (and rejects hybrid models); here every rank
holds the whole cache and every request's GDN states, so the block tables and slot mapping are
pcp == 1's (``pcp1_block_tables``), as the engine core's block accounting is (``patches``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import vllm.v1.worker.block_table as block_table_module
import vllm.v1.worker.gpu_model_runner as gpu_model_runner_module
from vllm.distributed import get_pcp_group
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.worker import mamba_utils
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from .config import PCPConfig, pcp_config_of
from .decode_owners import DecodeOwners
from .draft_first_pass import split_first_pass
from .layers.classes import adopt_pcp_attention, pcp_model_build
from .layers.context import PCPContext, running_step
from .layers.pcp_attention import PCPFlashAttentionImpl
from .layers.pcp_gdn import PCPGatedDeltaNetAttention
from .owned_batch import KVStage, OwnedBatch, defer_staged_kv
from .plan import PCPPlan
from .plan_records import spread_decode_step
from .state_blocks import (
    MAX_PAYLOAD_BYTES,
    hand_over_request_states,
    largest_payload_bytes,
    share_completed_state_blocks,
)


@contextlib.contextmanager
def pcp1_block_tables():
    """Block tables built while this runs have pcp == 1's rows: vLLM sizes a request's block-table row
    for 1/pcp of ``max_model_len`` (``get_total_cp_world_size``, read in the block-table and runner
    modules); a replicated cache needs the whole sequence's blocks. Reverts when the block ends (a
    worker process builds its runner on one thread)."""
    originals = {m: m.get_total_cp_world_size for m in (block_table_module, gpu_model_runner_module)}
    pcp = get_pcp_group().world_size

    def dcp_only() -> int:
        return originals[block_table_module]() // pcp

    try:
        for module in originals:
            module.get_total_cp_world_size = dcp_only
        yield
    finally:
        for module, fn in originals.items():
            module.get_total_cp_world_size = fn


@dataclass(frozen=True)
class StepDrafts:
    """A step's speculative drafts as the plan needs them (``PCPModelRunner._step_drafts``)."""

    # per request: vLLM's GDN layers verify it (None: they verify none, as vLLM's builder rules where no
    # request past its prompt has drafts)
    verify: np.ndarray | None
    num_read: np.ndarray  # per request: the rows vLLM reads (1 + its drafts)
    uniform: bool  # vLLM's uniform batch of verifications (a spread step with decode="spread")


@dataclass(frozen=True)
class PCPStep:
    """What the runner decided for this step, once, after ``_prepare_inputs``."""

    plan: PCPPlan | None  # None: an unsplit step
    logits_indices: torch.Tensor  # the rows vLLM samples from
    owned: OwnedBatch | None = None  # a spread decode step: the batch of this rank's own requests
    # a spread decode step with a drafter: the whole batch's metadata the drafter reads (its heads put
    # back after the forward)
    drafter_metadata: object = None


class PCPModelRunner(GPUModelRunner):
    """``GPUModelRunner`` for our model at pcp > 1 (built by ``worker.PCPWorker``)."""

    def __init__(self, vllm_config, device: torch.device):
        with pcp1_block_tables():
            super().__init__(vllm_config, device)
        self._replicate_block_tables()
        self.pcp_config: PCPConfig = pcp_config_of(vllm_config)
        self.pcp_group = get_pcp_group()
        self.pcp_step: PCPStep | None = None
        self.draft_ctx: PCPContext | None = None  # a split step's context, for the MTP drafter's first pass
        self.decode_owners = (DecodeOwners(self.pcp_group.world_size)
                              if self.pcp_config.decode == "spread" else None)
        # the latest spread decode step's (owners and rows, plan, batch): the next step of the same
        # batch reuses them (``_plan``)
        self._owned_batch: tuple[tuple, PCPPlan, OwnedBatch] | None = None

    # ------------------------------------------------------------------ replicated KV cache
    def _replicate_block_tables(self) -> None:
        """Every rank computes the slot of every new token (vLLM's kernel would give other ranks'
        tokens the pad slot): the tables see pcp == 1 (DCP, refused with PCP, stays vLLM's)."""
        for table in self.input_batch.block_table.block_tables:
            table.pcp_world_size, table.pcp_rank = 1, 0

    def may_reinitialize_input_batch(self, kv_cache_config, kernel_block_sizes) -> None:
        with pcp1_block_tables():
            super().may_reinitialize_input_batch(kv_cache_config, kernel_block_sizes)
        self._replicate_block_tables()

    # ------------------------------------------------------------------------- the step
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens: np.ndarray):
        logits_indices, spec_decode_metadata = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self.draft_ctx = None  # set again by a split step whose drafter splits (_model_forward)
        drafts = (self._step_drafts(scheduler_output, num_scheduled_tokens)
                  if self.speculative_config is not None else None)
        plan, owned = self._plan(num_scheduled_tokens, drafts)
        drafter_metadata = None
        if owned is not None:
            keep = ()
            if self.speculative_config is not None:  # read by the drafter after the forward
                drafter_metadata = self._drafter_metadata(scheduler_output, num_scheduled_tokens)
                keep = self._model_input_heads(owned.num_rows)
            owned.write_heads(self, attention_groups=[g for g, _ in self._attention_layers_by_group()], keep=keep)
        self.pcp_step = PCPStep(plan, logits_indices, owned, drafter_metadata)
        return logits_indices, spec_decode_metadata

    def _step_drafts(self, scheduler_output, num_new: np.ndarray) -> StepDrafts:
        """The step's drafts as vLLM's runner and GDN layers see them: each request's logits rows (its
        last token and its drafts), which requests the GDN layers verify (vLLM's builder's rule: past
        the prompt with drafts scheduled, ``num_decode_draft_tokens >= 0``, where any has drafts), and
        (``decode="spread"``) whether the step is vLLM's uniform decode batch of verifications (every
        request 1 + K rows)."""
        num_reqs = len(num_new)
        num_read = np.ones(num_reqs, dtype=np.int64)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        verify = None
        if drafts:
            index = self.input_batch.req_id_to_index
            num_read[[index[r] for r in drafts]] += [len(d) for d in drafts.values()]
            decode_drafts = self.num_decode_draft_tokens.np[:num_reqs]  # written by vLLM's _prepare_inputs
            if decode_drafts[decode_drafts >= 0].sum() > 0:
                verify = decode_drafts >= 0
        uniform = (self.decode_owners is not None and verify is not None and bool(verify.all())
                   and bool((num_new == self.uniform_decode_query_len).all()) and bool((num_read == num_new).all()))
        return StepDrafts(verify, num_read, uniform)

    def _drafter_metadata(self, scheduler_output, num_new: np.ndarray):
        """The whole batch's common metadata for the drafter's KV-cache group, built by vLLM's own
        ``_build_attention_metadata`` with no layer's metadata (its attention groups left out while it
        runs): what vLLM hands the drafter at pcp == 1, its tensors views of the runner's buffers, whose
        heads the spread step writes and puts back after its forward (``OwnedBatch.keep_heads``)."""
        num_reqs, num_tokens = len(num_new), int(num_new.sum())
        tables = self.input_batch.block_table.block_tables
        groups, self.attn_groups = self.attn_groups, [[] for _ in self.attn_groups]
        try:
            return super()._build_attention_metadata(
                num_tokens=num_tokens, num_reqs=num_reqs, max_query_len=int(num_new.max()), use_spec_decode=True,
                num_scheduled_tokens=scheduler_output.num_scheduled_tokens,
                slot_mappings={g: t.slot_mapping.gpu[:num_tokens] for g, t in enumerate(tables)})[1]
        finally:
            self.attn_groups = groups

    def _model_input_heads(self, rows: int) -> list[torch.Tensor]:
        """The heads of the model's input buffers a spread step writes (``_owned_forward``) that the
        drafter reads after it (the target's ids and positions; vLLM 0.20.2's drafter reads no
        embeddings of the runner's, which ``_preprocess`` writes after this is kept)."""
        positions = self.mrope_positions.gpu[:, :rows] if self.uses_mrope else self.positions[:rows]
        return [self.input_ids.gpu[:rows], positions]

    def _plan(self, num_new: np.ndarray, drafts: StepDrafts | None = None) -> tuple[PCPPlan | None, OwnedBatch | None]:
        """The step's plan (None when the step stays whole: no request has enough new tokens to
        split and (``decode="spread"``) none decodes). With ``decode="spread"`` each decode row goes
        to its request's owner (``decode_owners``), and a step that hands a request's states over from
        its owner is planned (the GDN layers broadcast them first) even when nothing splits. A spread
        decode step (every row owned) runs each rank's own requests as vLLM's batch (``owned_batch``),
        every rank's plan padded to the size of the batch the busiest rank runs (``_owned_rows``). Such
        a plan and batch depend on the owners and that size alone (every row one token: its request's
        position), so the next spread decode step with the same ones reuses them at its own
        computed-token counts (``PCPPlan.with_computed``; the batch's device rows and step tensors built
        once).

        With speculative decoding (``drafts``) the requests vLLM's GDN layers verify are computed whole
        beside the split ones (``PCPPlan(verify=...)``), replicated or (spread) on their owners, and the
        rows vLLM reads are each request's logits rows. Under async scheduling the host's
        ``num_computed_tokens`` of a request that had drafts counts them as accepted until vLLM corrects
        it on the GPU: the plan's own use of it is exact (such a request is never split, its keys come
        from vLLM's device lengths, ``StepTensors.build``; its GDN state is read by vLLM's kernels at the
        accepted offset on the device). A step whose requests past their prompt have no drafts anywhere
        in it (vLLM's non-speculative decode path, with the widened conv state) stays whole. With
        ``decode="spread"`` owned requests' states go to every rank before any step that computes them
        whole (``_hand_over_states``), as at a step of decode rows without drafts."""
        world = self.pcp_group.world_size
        num_reqs = len(num_new)
        num_computed = self.input_batch.num_computed_tokens_cpu[:num_reqs]
        verify = None if drafts is None else drafts.verify
        owner = handover = None
        if self.decode_owners is not None:
            decode_rows = None if drafts is None else (np.zeros(num_reqs, dtype=bool) if verify is None else verify)
            owner, handover = self.decode_owners.step(
                self.input_batch.req_ids[:num_reqs], num_computed, num_new,
                self.input_batch.num_prompt_tokens[:num_reqs], self.requests, decode_rows)
            if drafts is not None:  # every state block of theirs, before the step; no plan reads it
                self._hand_over_states(handover)
                handover = np.full(num_reqs, -1, dtype=np.int64)
        splits = self.pcp_config.step_splits(num_new if verify is None else num_new[~verify], world)
        if not splits and (owner is None or not ((owner >= 0).any() or (handover >= 0).any())):
            return None, None
        if drafts is not None and verify is None and np.any(
                num_computed + num_new > self.input_batch.num_prompt_tokens[:num_reqs]):
            return None, None
        spread = spread_decode_step(owner, num_new) and (drafts is None or drafts.uniform)
        rows = self._owned_rows(owner, num_new) if spread else 0
        key = (owner.tobytes(), rows, int(num_new[0])) if rows else None
        if key is not None and self._owned_batch is not None and self._owned_batch[0] == key:
            _, plan, owned = self._owned_batch
            return plan.with_computed(num_computed), owned
        plan = PCPPlan(num_computed, num_new, world, self.pcp_group.rank_in_group, self.pcp_config, owner,
                       handover, min_rows=abs(rows), verify=verify,
                       num_read=None if drafts is None else drafts.num_read)
        if key is None:
            return plan, None
        owned = OwnedBatch.of(plan, plan.t_pad, eager=rows < 0, device_lens=self.speculative_config is not None)
        self._owned_batch = key, plan, owned
        return plan, owned

    def _hand_over_states(self, handover: np.ndarray) -> None:
        """With speculative decoding: every GDN state block of the requests ``handover`` names, from
        their owners to every rank (``state_blocks.hand_over_request_states``)."""
        if not (handover >= 0).any():
            return
        _, block_ids, caches = self._gdn_states()
        hand_over_request_states(self.pcp_group, handover, block_ids, caches)

    def _owned_rows(self, owner: np.ndarray, num_new: np.ndarray) -> int:
        """The batch every rank runs at a spread decode step, in rows: the most requests any rank owns
        (each ``num_new`` rows: one, or 1 + K verification rows), padded as vLLM's dispatcher pads a
        uniform decode batch of that size (to its CUDA graph's size). Negative (the unpadded size, run
        eagerly) where the padded batch exceeds the runner's request buffers: the capture sizes reach
        twice ``max_num_seqs``."""
        q = int(num_new[0])
        rows = int(np.bincount(owner, minlength=self.pcp_group.world_size).max()) * q
        padded = self.cudagraph_dispatcher.dispatch(rows, uniform_decode=True)[1].num_tokens
        fits = padded % q == 0 and padded // q <= self.max_num_reqs
        return padded if fits else -rows  # past the request buffers: eager

    def _determine_batch_execution_and_padding(self, *args, force_eager: bool = False, **kwargs):
        # vLLM dispatches the whole batch; a split step runs a local slice (through the compiled graph
        # where there is one: force_eager only skips the whole batch's graphs); a spread decode step
        # dispatches the batch of the rank's own requests, a decode batch of that size at pcp == 1
        step = self.pcp_step
        if step is not None and step.owned is not None:
            rows, q = step.owned.num_rows, step.owned.query_len
            kwargs.update(num_tokens=rows, num_reqs=rows // q, num_scheduled_tokens_np=np.full(rows // q, q, np.int32),
                          max_num_scheduled_tokens=q, use_cascade_attn=False)
            result = super()._determine_batch_execution_and_padding(force_eager=force_eager or step.owned.eager,
                                                                     **kwargs)
            if result[1].num_tokens != rows:  # the heads, slots and metadata are written for ``rows``
                raise RuntimeError(
                    f"qwen36_pcp: vLLM dispatched a spread decode step of {rows} rows as a batch of "
                    f"{result[1].num_tokens} (its padding no longer matches the plan's); run with "
                    "decode='replicated'")
            return result
        split = step is not None and step.plan is not None
        return super()._determine_batch_execution_and_padding(*args, force_eager=force_eager or split, **kwargs)

    def _get_slot_mappings(self, num_tokens_padded: int, num_reqs_padded: int, num_tokens_unpadded: int,
                           ubatch_slices=None):
        # a spread decode step: the owned rows' slots at the head, -1 past them to the batch's size
        owned = self.pcp_step.owned if self.pcp_step is not None else None
        if owned is not None:
            num_tokens_padded, num_reqs_padded = owned.num_rows, owned.num_reqs_padded
            num_tokens_unpadded = owned.num_tokens
        return super()._get_slot_mappings(num_tokens_padded, num_reqs_padded, num_tokens_unpadded, ubatch_slices)

    def _build_attention_metadata(self, *args, **kwargs):
        # a spread decode step: vLLM's metadata of a decode batch of the owned requests (at the
        # buffers' heads), padded to the batch every rank runs; with speculative decoding their
        # accepted-token counts and drafts in place of the whole batch's, and the drafter's metadata
        # the whole batch's (``_drafter_metadata``)
        step = self.pcp_step
        owned = step.owned if step is not None else None
        if owned is None:
            return super()._build_attention_metadata(*args, **kwargs)
        if owned.num_reqs == 0:  # this rank owns no request: the model does not run
            return {}, step.drafter_metadata
        kwargs.update(num_tokens=owned.num_tokens, num_reqs=owned.num_reqs, num_tokens_padded=owned.num_rows,
                      num_reqs_padded=owned.num_reqs_padded, max_query_len=owned.query_len, logits_indices=None,
                      cascade_attn_prefix_lens=None)
        swapped = {"query_start_loc": owned.query_starts(self.query_start_loc)}
        if self.speculative_config is not None:
            swapped.update(owned.verification_inputs(self.num_accepted_tokens, self.num_decode_draft_tokens))
        whole = {name: getattr(self, name) for name in swapped}
        try:
            for name, value in swapped.items():
                setattr(self, name, value)
            attn_metadata, common = super()._build_attention_metadata(**kwargs)
        finally:
            for name, value in whole.items():
                setattr(self, name, value)
        return attn_metadata, (common if self.speculative_config is None else step.drafter_metadata)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self.pcp_step = None

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        step = self.pcp_step
        if step is None:
            return super()._model_forward(input_ids, positions, intermediate_tensors, inputs_embeds,
                                          **model_kwargs)
        if step.plan is None:
            hidden = super()._model_forward(input_ids, positions, intermediate_tensors, inputs_embeds,
                                            **model_kwargs)
            return rank0_rows(self.pcp_group, hidden, step.logits_indices.long())
        if step.owned is not None:
            return self._owned_forward(step, input_ids, positions, intermediate_tensors, inputs_embeds,
                                       **model_kwargs)
        full = input_ids if input_ids is not None else inputs_embeds
        # with drafts every segment's key count comes from vLLM's device lengths (StepTensors.build)
        seq_lens = self.seq_lens[: step.plan.num_reqs] if self.speculative_config is not None else None
        ctx = PCPContext(step.plan, self.pcp_group, full.device, num_tokens_padded=full.shape[0], seq_lens=seq_lens)
        idx = ctx.t.local_idx
        with running_step(ctx):
            hidden = super()._model_forward(local_rows(input_ids, idx, 0), local_rows(positions, idx, -1),
                                            intermediate_tensors, local_rows(inputs_embeds, idx, 0), **model_kwargs)
        split_drafter = self._split_drafter_enabled()
        self.draft_ctx = ctx if split_drafter else None
        out = ctx.gather_output(hidden, all_rows=self._reads_every_row(split_drafter), keep_local=split_drafter)
        self._share_filled_state_blocks(step.plan)
        return out

    def _owned_forward(self, step: PCPStep, input_ids, positions, intermediate_tensors, inputs_embeds,
                       **model_kwargs):
        """A spread decode step: vLLM's forward of the batch of this rank's own requests (no PCP
        context: the layers run as at pcp == 1, in vLLM's CUDA graph of that batch), then one
        all-gather of every rank's sampled rows and new K/V (at the whole batch's slots, taken by
        ``OwnedBatch.write_heads``).

        vLLM hands the model the head of its input buffers (``num_rows`` rows: a graph replays what
        it read at capture, those heads); the owned requests' ids, positions and embeddings are
        written there from the whole batch's rows."""
        plan, owned = step.plan, step.owned
        num_tokens = plan.num_tokens
        ctx = PCPContext(plan, self.pcp_group, self.device, num_tokens_padded=num_tokens,
                         tensors=owned.step_tensors(plan, self.device))
        idx = ctx.t.local_idx
        try:
            if owned.num_reqs:
                n = max(num_tokens, owned.num_rows)  # the batch's rows, and the heads the model reads
                whole = (self.input_ids.gpu[:n] if input_ids is not None else None,
                         self.mrope_positions.gpu[:, :n] if positions.dim() == 2 else self.positions[:n],
                         self.inputs_embeds.gpu[:n] if inputs_embeds is not None else None)
                hidden = super()._model_forward(
                    local_rows(whole[0], idx, 0, in_place=True), local_rows(whole[1], idx, -1, in_place=True),
                    intermediate_tensors, local_rows(whole[2], idx, 0, in_place=True), **model_kwargs)
            else:  # no request of its own: nothing to compute
                hidden = torch.zeros(owned.num_rows, self.model_config.get_hidden_size(), dtype=self.dtype,
                                     device=self.device)
            for gid, layers in self._attention_layers_by_group():
                defer_staged_kv(ctx, layers, owned.exchange_slots[gid])
            out = ctx.gather_output(hidden, all_rows=self._reads_every_row(False))
        finally:
            owned.restore_heads()  # (kept for the drafter only)
        self._share_filled_state_blocks(plan)
        return out

    def _share_filled_state_blocks(self, plan: PCPPlan) -> None:
        """With prefix caching (vLLM's ``mamba_cache_mode="align"``): the GDN states of the blocks this
        step's owned decode rows filled, from their owners to every rank (``state_blocks``)."""
        if self.decode_owners is None or self.cache_config.mamba_cache_mode != "align" or (plan.owner < 0).all():
            return
        block_size, block_ids, caches = self._gdn_states()
        share_completed_state_blocks(self.pcp_group, plan.owner, plan.num_computed + plan.num_new, block_size,
                                     block_ids, caches)

    def _gdn_states(self):
        """What ``state_blocks`` sends GDN states with: the GDN KV-cache groups' block size, request i's
        block ids in each of them (of this step's batch), and per group every state tensor of its layers
        (the groups and layers found once)."""
        if not hasattr(self, "_state_groups"):
            group_ids, spec = mamba_utils.get_mamba_groups(self.kv_cache_config)
            self._state_groups = group_ids, spec.block_size, [self._layers_of_group(g) for g in group_ids]
        group_ids, block_size, layers = self._state_groups
        req_ids = self.input_batch.req_ids
        return (block_size, lambda i: [self.requests[req_ids[i]].block_ids[g] for g in group_ids],
                [[state for layer in group for state in layer.kv_cache] for group in layers])

    def _attention_layers_by_group(self) -> list[tuple[int, list[Attention]]]:
        """The model's attention layers per KV-cache group (the MTP drafter's left out), once."""
        if not hasattr(self, "_attention_groups"):
            ours = {id(m) for m in self._model_attention_layers()}
            groups = [(gid, [layer for layer in self._layers_of_group(gid) if id(layer) in ours])
                      for gid in range(len(self.kv_cache_config.kv_cache_groups))]
            self._attention_groups = [(gid, found) for gid, found in groups if found]
        return self._attention_groups

    def _model_attention_layers(self) -> list[Attention]:
        """The model's attention layers (the MTP drafter, a model of its own, left out)."""
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def _layers_of_group(self, gid: int) -> list:
        """The layers of KV-cache group ``gid``, as vLLM's forward context holds them."""
        layers = self.compilation_config.static_forward_context
        return [layers[name] for name in self.kv_cache_config.kv_cache_groups[gid].layer_names]

    def _split_drafter_enabled(self) -> bool:
        """Whether the MTP drafter's first pass at a split step runs this rank's rows
        (``mtp_first_pass="split"``, ``draft_first_pass``): not where vLLM's drafter reshapes its
        first pass's rows (``needs_extra_input_slots``: parallel drafting), which then runs whole."""
        drafter = getattr(self, "drafter", None) if self.speculative_config is not None else None
        # vLLM's unpadded drafter batch (``disable_padded_drafter_batch``) drops the rejected drafts' rows
        # from its first pass: not the plan's rows
        unpadded = getattr(self.speculative_config, "disable_padded_drafter_batch", False)
        return (drafter is not None and self.pcp_config.mtp_first_pass == "split" and not unpadded
                and not getattr(drafter, "needs_extra_input_slots", True))

    def _reads_every_row(self, split_drafter: bool) -> bool:
        """Whether vLLM reads more of this step's hidden states than ``hidden_states[logits_indices]``
        (each request's last row at a split step): prompt logprobs (``_get_prompt_logprobs_dict``) and
        an MTP drafter whose first pass runs whole (over ``hidden_states[:num_tokens]``, every row, to
        write its K/V of the whole prompt) read every row; pooling, which would too, is refused at
        startup. A split first pass reads the rank's own rows, kept in place by the gather."""
        whole_drafter = self.speculative_config is not None and not split_drafter
        return bool(self.num_prompt_logprobs) or whole_drafter

    def propose_draft_token_ids(self, *args, **kwargs):
        """The drafter's tokens, rank 0's on every rank.

        After a split step the drafter's first pass runs this rank's rows of the step's plan
        (``split_first_pass``); its other passes run on every rank over the same rows. Every rank feeds
        its own drafts into its next step (under async scheduling, from the GPU), so they must be the
        same bits everywhere; as with the sampled rows (``rank0_rows``), nothing proves that every
        process picks the same kernel configs, so rank 0's drafts are broadcast ([num_reqs, K] token
        ids, one call)."""
        ctx, self.draft_ctx = self.draft_ctx, None
        with split_first_pass(self.drafter if ctx is not None else None, ctx):
            drafts = super().propose_draft_token_ids(*args, **kwargs)
        if isinstance(drafts, torch.Tensor):
            drafts = self.pcp_group.broadcast(drafts.contiguous(), src=0)
        return drafts

    # ------------------------------------------------------------------- model, profiling
    def load_model(self, *args, **kwargs) -> None:
        """Our model, and the MTP drafter when speculative decoding is on, with the PCP layers: vLLM
        builds the drafter (``Qwen3_5MoeMTP``, one full-attention layer with experts) right after the
        target, so both are built while the PCP layer classes are registered: the drafter's experts
        are whole on every rank (it runs every row on every rank) and its attention takes the PCP impl
        (vLLM checks ``supports_pcp`` on every attention layer)."""
        with pcp_model_build(self.vllm_config) as replacements:
            super().load_model(*args, **kwargs)
        if self.decode_owners is not None:
            self._attach_kv_stage(self._model_attention_layers())
        drafter = getattr(getattr(self, "drafter", None), "model", None)
        if drafter is not None:
            adopt_pcp_attention(drafter)
            whole = replacements.get(FusedMoE)
            sharded = [n for n, m in drafter.named_modules()
                       if whole is not None and isinstance(m, FusedMoE) and not isinstance(m, whole)]
            if sharded:  # built outside load_model: its experts would be sharded over the PCP ranks
                raise RuntimeError(f"qwen36_pcp: the MTP drafter's experts {sharded} were not built whole on "
                                   "every PCP rank (vLLM built the drafter outside the model runner's load_model)")

    def _attach_kv_stage(self, layers: list) -> None:
        """With ``decode="spread"``: the model's attention layers keep the new K/V rows they write in
        one ``KVStage`` of ``max_num_reqs`` x (1 + K) rows (the most a spread decode step runs), attached before
        vLLM captures its CUDA graphs so that they hold the copies (``load_model``; vLLM captures in
        ``capture_model``, after it)."""
        other = [type(layer.impl).__name__ for layer in layers if not isinstance(layer.impl, PCPFlashAttentionImpl)]
        if other:
            raise RuntimeError(f"qwen36_pcp: decode=\"spread\" needs the PCP attention impl on every attention "
                               f"layer, found {sorted(set(other))}")
        if layers:
            self._kv_stage = KVStage(layers, self.max_num_reqs * self.uniform_decode_query_len, self.dtype,
                                     self.device)

    def profile_run(self) -> None:
        super().profile_run()
        self._warm_pcp_collectives()
        if self.pcp_config.gdn_mode == "state_passing":
            layer = next((m for m in self.model.modules() if isinstance(m, PCPGatedDeltaNetAttention)), None)
            if layer is not None:  # its kernels are shared by every GDN layer of the model
                layer.warm_augmented_scan(self.device, self.dtype)
                torch.accelerator.empty_cache()


    def _warm_pcp_collectives(self) -> None:
        """Every kind of call a split step makes on the PCP group, once, while vLLM profiles memory:
        the communicators (NCCL's, and vLLM's point-to-point connections between each pair of
        consecutive run owners) are set up here, their buffers inside the profile and their setup time
        outside the first request's; with ``decode="spread"`` and GDN states to send (MTP's hand-overs,
        prefix caching's filled blocks), a state broadcast at its largest."""
        group, world = self.pcp_group, self.pcp_group.world_size
        rank = group.rank_in_group
        x = torch.zeros(1, device=self.device)
        group.all_gather(x, dim=0)
        group.broadcast(x, 0)
        if self.decode_owners is not None and (self.speculative_config is not None
                                               or self.cache_config.mamba_cache_mode == "align"):
            # a GDN state-block broadcast at its largest (``state_blocks``): its sender holds the blocks
            # and the packed payload at once, so the profile counts twice that, not the KV cache
            largest = largest_payload_bytes([m for m in self.model.modules() if isinstance(m, MambaBase)],
                                            MAX_PAYLOAD_BYTES)
            held = torch.zeros(2 * largest, dtype=torch.uint8, device=self.device)
            group.broadcast(held[:largest], 0)
            del held
        chain = PCPPlan([0], [self.pcp_config.split_threshold(world)], world, rank, self.pcp_config).summary_runs
        for (src, _, _), (dst, _, _) in zip(chain, chain[1:]):
            if rank == src:
                group.send(x, dst)
            elif rank == dst:
                group.recv(x.shape, x.dtype, src)


def local_rows(x: torch.Tensor | None, idx: torch.Tensor, dim: int, in_place: bool = False) -> torch.Tensor | None:
    """The rank's rows of one of the step's inputs (``idx`` along ``dim``). ``in_place``: written into
    the head of ``x`` and returned as that view: vLLM passes views of its persistent input buffers
    from their start, and a CUDA graph replays what it read at capture, those buffers' heads."""
    if x is None:
        return None
    rows = x.index_select(dim, idx)
    if not in_place:
        return rows
    head = x.narrow(dim, 0, idx.numel())
    head.copy_(rows)
    return head


def rank0_rows(group, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``hidden`` with its ``rows`` replaced in place by rank 0's (one all-gather of those rows).

    Unsplit steps run the same batch on every rank; each rank feeds its own sample into its next step,
    so the rows that get sampled must be the same bits everywhere, and nothing else proves that every
    kernel picks the same autotune config in every process (with ``moe_experts="sharded"`` and more than
    two ranks vLLM's MoE reduce-scatter may also sum in a different order per rank).
    """
    rank0 = group.all_gather(hidden.index_select(0, rows).contiguous(), dim=0)[: rows.shape[0]]
    hidden.index_copy_(0, rows, rank0)
    return hidden
