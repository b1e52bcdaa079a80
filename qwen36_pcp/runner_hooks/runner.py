# SPDX-License-Identifier: Apache-2.0
"""The model runner at pcp > 1: vLLM's V1 ``GPUModelRunner`` with split steps and a replicated KV cache,
composed of parts with one job each, created in ``__init__``:

- ``StepPlanner`` (``planner.py``): the step's decision, once, at the end of ``_prepare_inputs`` (vLLM's,
  on the whole batch, the same on every rank): its drafts and its ``PCPPlan``, from what every rank
  already holds (no collective). The decision is one ``PCPStep`` (``step.py``) that every override
  below hands to the part that acts on it.
- ``SplitForward`` (``split_forward.py``): a split step's forward on the rank's rows with the step's
  ``PCPContext`` and its one output gather; an unsplit step's rows that get sampled taken from rank 0.
- ``DrafterPart`` (``drafter.py``): the MTP drafter's first pass on the rank's rows after a split step,
  and its drafts broadcast from rank 0.
- ``SpreadDecode`` (``qwen36_pcp/spread``, with ``decode="spread"`` only): decode rows on their owners,
  a step of owned rows run as vLLM's own batch of each rank's requests.
- the block tables (``block_tables.py``) and the collectives' warm-up (``warm_up.py``).

A split step runs without CUDA graphs (they were captured for whole-batch sizes; the torch.compile'd
graph still runs).
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.distributed import get_pcp_group
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from ..config import PCPConfig, pcp_config_of
from ..layers.classes import pcp_model_build
from ..layers.pcp_gdn import PCPGatedDeltaNetAttention
from ..spread import SpreadDecode
from .block_tables import pcp1_block_tables, replicate_block_tables
from .drafter import DrafterPart
from .planner import StepPlanner
from .split_forward import SplitForward
from .step import PCPStep
from .warm_up import warm_pcp_collectives


class PCPModelRunner(GPUModelRunner):
    """``GPUModelRunner`` for our model at pcp > 1 (built by ``worker.PCPWorker``)."""

    def __init__(self, vllm_config, device: torch.device):
        with pcp1_block_tables():
            super().__init__(vllm_config, device)
        replicate_block_tables(self.input_batch)
        self.build_parts(pcp_config_of(vllm_config), get_pcp_group())

    def build_parts(self, config: PCPConfig, group) -> None:
        """The runner's PCP parts (after vLLM's ``__init__``; the CPU stand-ins call it too)."""
        self.pcp_config, self.pcp_group = config, group
        self.pcp_step: PCPStep | None = None  # this step's decision, from _prepare_inputs to its forward
        self.spread = SpreadDecode(self) if config.decode == "spread" else None
        self.planner = StepPlanner(self, self.spread)
        self.drafter_part = DrafterPart(self)
        self.split_forward = SplitForward(self, self.drafter_part)

    def vllm(self, name: str):
        """vLLM's ``name`` of this runner: the method the next class after ``PCPModelRunner`` in the
        runner's MRO defines (``GPUModelRunner``'s, or a subclass's between them), which the parts call
        where the runner would call ``super()``."""
        return getattr(super(), name)

    def may_reinitialize_input_batch(self, kv_cache_config, kernel_block_sizes) -> None:
        with pcp1_block_tables():
            super().may_reinitialize_input_batch(kv_cache_config, kernel_block_sizes)
        replicate_block_tables(self.input_batch)

    # ------------------------------------------------------------------------- the step
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens: np.ndarray):
        logits_indices, spec_decode_metadata = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self.drafter_part.first_pass_ctx = None  # set again by a split step whose drafter splits
        drafts = self.planner.drafts(scheduler_output, num_scheduled_tokens)
        plan, owned = self.planner.plan(num_scheduled_tokens, drafts)
        drafter_metadata = (self.spread.prepare(owned, scheduler_output, num_scheduled_tokens)
                            if owned is not None else None)
        self.pcp_step = PCPStep(plan, logits_indices, owned, drafter_metadata)
        return logits_indices, spec_decode_metadata

    def _determine_batch_execution_and_padding(self, *args, force_eager: bool = False, **kwargs):
        # vLLM dispatches the whole batch; a split step runs a local slice (through the compiled graph
        # where there is one: force_eager only skips the whole batch's graphs); a spread decode step
        # dispatches the batch of the rank's own requests, a decode batch of that size at pcp == 1
        step = self.pcp_step
        if step is not None and step.owned is not None:
            return self.spread.dispatch(step, force_eager, kwargs)
        split = step is not None and step.split
        return super()._determine_batch_execution_and_padding(*args, force_eager=force_eager or split, **kwargs)

    def _get_slot_mappings(self, num_tokens_padded: int, num_reqs_padded: int, num_tokens_unpadded: int,
                           ubatch_slices=None):
        step = self.pcp_step
        if step is not None and step.owned is not None:
            return self.spread.slot_mappings(step, ubatch_slices)
        return super()._get_slot_mappings(num_tokens_padded, num_reqs_padded, num_tokens_unpadded, ubatch_slices)

    def _build_attention_metadata(self, *args, **kwargs):
        step = self.pcp_step
        if step is None or step.owned is None:
            return super()._build_attention_metadata(*args, **kwargs)
        return self.spread.attention_metadata(step, kwargs)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self.pcp_step = None

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        step = self.pcp_step
        if step is None:  # outside a step: profiling, CUDA-graph capture
            return super()._model_forward(input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs)
        if step.plan is None:
            return self.split_forward.unsplit(step, input_ids, positions, intermediate_tensors, inputs_embeds,
                                              **model_kwargs)
        forward = self.spread.forward if step.owned is not None else self.split_forward.split
        out = forward(step, input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs)
        if self.spread is not None:
            self.spread.share_filled_state_blocks(step.plan)
        return out

    def propose_draft_token_ids(self, *args, **kwargs):
        return self.drafter_part.propose(super().propose_draft_token_ids, *args, **kwargs)

    # ------------------------------------------------------------------- model, profiling
    def load_model(self, *args, **kwargs) -> None:
        """Our model, and the MTP drafter when speculative decoding is on, with the PCP layers: vLLM
        builds the drafter (``Qwen3_5MoeMTP``, one full-attention layer with experts) right after the
        target, so both are built while the PCP layer classes are registered: the drafter's experts
        are whole on every rank (it runs every row on every rank) and its attention takes the PCP impl
        (vLLM checks ``supports_pcp`` on every attention layer)."""
        with pcp_model_build(self.vllm_config) as replacements:
            super().load_model(*args, **kwargs)
        if self.spread is not None:
            self.spread.attach_kv_stage()
        self.drafter_part.adopt(replacements)

    def profile_run(self) -> None:
        super().profile_run()
        warm_pcp_collectives(self.pcp_group, self.pcp_config, self.device)
        if self.spread is not None:
            self.spread.warm_up()
        if self.pcp_config.gdn_mode == "state_passing":
            layer = next((m for m in self.model.modules() if isinstance(m, PCPGatedDeltaNetAttention)), None)
            if layer is not None:  # its kernels are shared by every GDN layer of the model
                layer.warm_augmented_scan(self.device, self.dtype)
                torch.accelerator.empty_cache()
