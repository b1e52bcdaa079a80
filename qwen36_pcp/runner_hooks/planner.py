# SPDX-License-Identifier: Apache-2.0
"""The step's decision, once per step on the host: its drafts as the plan needs them and its
``PCPPlan``, from what every rank already holds (tokens in the cache, tokens scheduled now: no
collective)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..plan import PCPPlan
from .step import StepDrafts

if TYPE_CHECKING:
    from ..spread.owned_batch import OwnedBatch


class StepPlanner:
    """The step's decision from the runner's host state (its batch, its config and group, read at each
    step); ``spread``: ``decode="spread"``'s part (``qwen36_pcp.spread``), which assigns decode rows to
    owners and runs a step of owned rows alone as its own batch."""

    def __init__(self, runner, spread=None):
        self.runner = runner
        self.spread = spread

    def drafts(self, scheduler_output, num_new: np.ndarray) -> StepDrafts | None:
        """The step's drafts as vLLM's runner and GDN layers see them (None without speculative
        decoding): each request's logits rows (its last token and its drafts), which requests the GDN
        layers verify (vLLM's builder's rule: past the prompt with drafts scheduled,
        ``num_decode_draft_tokens >= 0``, where any has drafts), and (``decode="spread"``) whether the
        step is vLLM's uniform decode batch of verifications (every request 1 + K rows)."""
        runner = self.runner
        if runner.speculative_config is None:
            return None
        num_reqs = len(num_new)
        num_read = np.ones(num_reqs, dtype=np.int64)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        verify = None
        if drafts:
            index = runner.input_batch.req_id_to_index
            num_read[[index[r] for r in drafts]] += [len(d) for d in drafts.values()]
            decode_drafts = runner.num_decode_draft_tokens.np[:num_reqs]  # written by vLLM's _prepare_inputs
            if decode_drafts[decode_drafts >= 0].sum() > 0:
                verify = decode_drafts >= 0
        uniform = (self.spread is not None and verify is not None and bool(verify.all())
                   and bool((num_new == runner.uniform_decode_query_len).all()) and bool((num_read == num_new).all()))
        return StepDrafts(verify, num_read, uniform)

    def plan(self, num_new: np.ndarray, drafts: StepDrafts | None = None) -> tuple[PCPPlan | None, OwnedBatch | None]:
        """(the step's plan, the spread decode step's batch of owned requests), (None, None) when the
        step stays whole: no request has enough new tokens to split and (``decode="spread"``) none
        decodes.

        With speculative decoding (``drafts``) the requests vLLM's GDN layers verify are computed whole
        beside the split ones (``PCPPlan(verify=...)``), replicated or (spread) on their owners, and the
        rows vLLM reads are each request's logits rows. Under async scheduling the host's
        ``num_computed_tokens`` of a request that had drafts counts them as accepted until vLLM corrects
        it on the GPU: the plan's own use of it is exact (such a request is never split, its keys come
        from vLLM's device lengths, ``StepTensors.build``; its GDN state is read by vLLM's kernels at the
        accepted offset on the device). A step whose requests past their prompt have no drafts anywhere
        in it (vLLM's non-speculative decode path, with the widened conv state) stays whole.

        With ``decode="spread"`` each decode row goes to its request's owner and a step that hands a
        request's states over from its owner is planned even when nothing splits (``SpreadDecode``)."""
        runner = self.runner
        batch, group, config = runner.input_batch, runner.pcp_group, runner.pcp_config
        num_reqs = len(num_new)
        num_computed = batch.num_computed_tokens_cpu[:num_reqs]
        verify = None if drafts is None else drafts.verify
        owner = handover = None
        if self.spread is not None:
            owner, handover = self.spread.assign(num_new, num_computed, drafts)
        splits = config.step_splits(num_new if verify is None else num_new[~verify], group.world_size)
        if not splits and (owner is None or not ((owner >= 0).any() or (handover >= 0).any())):
            return None, None
        if drafts is not None and verify is None and (
                num_computed + num_new > batch.num_prompt_tokens[:num_reqs]).any():
            return None, None
        rows = 0
        if self.spread is not None:
            reused, rows = self.spread.reuse(owner, num_new, drafts, num_computed)
            if reused is not None:
                return reused
        plan = PCPPlan(num_computed, num_new, group.world_size, group.rank_in_group, config, owner, handover,
                       min_rows=abs(rows), verify=verify, num_read=None if drafts is None else drafts.num_read)
        return plan, (self.spread.batch(plan, rows) if rows else None)
