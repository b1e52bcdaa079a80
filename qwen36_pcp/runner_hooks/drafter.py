# SPDX-License-Identifier: Apache-2.0
"""The MTP drafter's part of the runner: where its first pass after a split step runs, which rows the
step's output gather must bring it, and its drafts made the same bits on every rank."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.layer import FusedMoE

from ..draft_first_pass import split_first_pass
from ..layers.classes import adopt_pcp_attention
from ..layers.context import PCPContext


class DrafterPart:
    """The runner's MTP drafter (built in ``load_model``) as the step needs it: where its first pass runs,
    the context it runs that pass with, and its drafts the same bits on every rank."""

    def __init__(self, runner):
        self.runner = runner
        # a split step's context, kept from its forward for the drafter's first pass (``propose``)
        self.first_pass_ctx: PCPContext | None = None

    def adopt(self, replacements: dict) -> None:
        """After ``load_model``: the drafter's attention takes the PCP impl, and its experts must have
        been built whole (the PCP layer classes registered around the whole load)."""
        drafter = getattr(getattr(self.runner, "drafter", None), "model", None)
        if drafter is None:
            return
        adopt_pcp_attention(drafter)
        whole = replacements.get(FusedMoE)
        sharded = [n for n, m in drafter.named_modules()
                   if whole is not None and isinstance(m, FusedMoE) and not isinstance(m, whole)]
        if sharded:  # built outside load_model: its experts would be sharded over the PCP ranks
            raise RuntimeError(f"qwen36_pcp: the MTP drafter's experts {sharded} were not built whole on "
                               "every PCP rank (vLLM built the drafter outside the model runner's load_model)")

    def split_enabled(self) -> bool:
        """Whether the MTP drafter's first pass at a split step runs this rank's rows
        (``mtp_first_pass="split"``, ``draft_first_pass``): not where vLLM's drafter reshapes its
        first pass's rows (``needs_extra_input_slots``: parallel drafting), which then runs whole."""
        runner = self.runner
        drafter = getattr(runner, "drafter", None) if runner.speculative_config is not None else None
        # vLLM's unpadded drafter batch (``disable_padded_drafter_batch``) drops the rejected drafts' rows
        # from its first pass: not the plan's rows
        unpadded = getattr(runner.speculative_config, "disable_padded_drafter_batch", False)
        return (drafter is not None and runner.pcp_config.mtp_first_pass == "split" and not unpadded
                and not getattr(drafter, "needs_extra_input_slots", True))

    def reads_every_row(self, split_drafter: bool) -> bool:
        """Whether vLLM reads more of this step's hidden states than ``hidden_states[logits_indices]``
        (each request's last row at a split step): prompt logprobs (``_get_prompt_logprobs_dict``) and
        an MTP drafter whose first pass runs whole (over ``hidden_states[:num_tokens]``, every row, to
        write its K/V of the whole prompt) read every row; pooling, which would too, is refused at
        startup. A split first pass reads the rank's own rows, kept in place by the gather."""
        whole_drafter = self.runner.speculative_config is not None and not split_drafter
        return bool(self.runner.num_prompt_logprobs) or whole_drafter

    def propose(self, propose, *args, **kwargs):
        """``propose``'s drafts (vLLM's ``propose_draft_token_ids``), rank 0's on every rank.

        After a split step the drafter's first pass runs this rank's rows of the step's plan
        (``split_first_pass``); its other passes run on every rank over the same rows. Every rank feeds
        its own drafts into its next step (under async scheduling, from the GPU), so they must be the
        same bits everywhere; as with the sampled rows (``rank0_rows``), nothing proves that every
        process picks the same kernel configs, so rank 0's drafts are broadcast ([num_reqs, K] token
        ids, one call)."""
        ctx, self.first_pass_ctx = self.first_pass_ctx, None
        with split_first_pass(self.runner.drafter if ctx is not None else None, ctx):
            drafts = propose(*args, **kwargs)
        if isinstance(drafts, torch.Tensor):
            drafts = self.runner.pcp_group.broadcast(drafts.contiguous(), src=0)
        return drafts
