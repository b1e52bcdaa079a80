# SPDX-License-Identifier: Apache-2.0
"""The forward of a planned step that splits prompts, and of an unsplit step at pcp > 1.

A split step: each rank runs vLLM's forward on its rows with the step's ``PCPContext`` in vLLM's
forward context, then one all-gather brings every rank the rows vLLM reads next (each request's logits
rows: its last row, and with MTP drafts every verification row; every row when a request wants prompt
logprobs). An unsplit step runs on every rank as at pcp == 1 and takes the rows that get sampled from
rank 0."""

from __future__ import annotations

import torch

from ..layers.context import PCPContext, running_step
from ..step_rows import local_rows, rank0_rows
from .step import PCPStep


class SplitForward:
    """A planned step's forward on this rank's rows; ``drafter`` (the runner's ``DrafterPart``) says which
    rows the output gather must bring and keeps the step's context for the drafter's first pass."""

    def __init__(self, runner, drafter):
        self.runner = runner
        self.drafter = drafter

    def unsplit(self, step: PCPStep, *args, **kwargs) -> torch.Tensor:
        """vLLM's forward of the whole batch, its sampled rows rank 0's on every rank (``rank0_rows``)."""
        hidden = self.runner.vllm("_model_forward")(*args, **kwargs)
        return rank0_rows(self.runner.pcp_group, hidden, step.logits_indices.long())

    def split(self, step: PCPStep, input_ids, positions, intermediate_tensors, inputs_embeds,
              **model_kwargs) -> torch.Tensor:
        """The gathered hidden states, in the runner's layout."""
        runner = self.runner
        full = input_ids if input_ids is not None else inputs_embeds
        # with drafts every segment's key count comes from vLLM's device lengths (StepTensors.build)
        seq_lens = runner.seq_lens[: step.plan.num_reqs] if runner.speculative_config is not None else None
        ctx = PCPContext(step.plan, runner.pcp_group, full.device, num_tokens_padded=full.shape[0], seq_lens=seq_lens)
        idx = ctx.t.local_idx
        with running_step(ctx):
            hidden = runner.vllm("_model_forward")(
                local_rows(input_ids, idx, 0), local_rows(positions, idx, -1), intermediate_tensors,
                local_rows(inputs_embeds, idx, 0), **model_kwargs)
        split_drafter = self.drafter.split_enabled()
        self.drafter.first_pass_ctx = ctx if split_drafter else None
        return ctx.gather_output(hidden, all_rows=self.drafter.reads_every_row(split_drafter), keep_local=split_drafter)
