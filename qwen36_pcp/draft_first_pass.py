# SPDX-License-Identifier: Apache-2.0
"""The MTP drafter's first pass at a split step, split with the target's plan.

vLLM's drafter (``EagleProposer.propose``) runs its first pass over every row of the step: each prompt
token's target hidden state with the token after it, writing the drafter's K/V of the whole prompt.
Run whole on every rank, that pass costs every rank pcp=1's drafter (one attention layer over the
whole prompt, one MoE layer over every row) and needs every target row gathered first. Split, each
rank runs the drafter over the rows it ran the target on (their hidden states are already on the
rank), with the step's plan as the target's layers read it: its attention through split attention
(its new K/V all-gathered and written to every rank's cache, so the later passes find the whole
prompt's), its experts on the rank's rows, and one gather of each request's last row, the only row
the drafter samples from. Its later passes (one row per request) run whole on every rank.

vLLM's drafter code runs unchanged: for one step the proposer's ``model`` is a stand-in that takes the
first call (``FirstPassSplit``) and puts the model back. Forward hooks would not do: the MTP model's
class is compiled by vLLM's ``support_torch_compile``, whose ``__call__`` calls ``forward`` directly.
"""

from __future__ import annotations

import contextlib

import torch
from vllm.config import CUDAGraphMode

from .layers.context import PCPContext, running_step

# the first pass's row-aligned inputs (``build_model_inputs_first_pass``) and the axis of their rows
ROW_INPUTS = (("input_ids", 0), ("inputs_embeds", 0), ("hidden_states", 0), ("positions", -1))


class FirstPassSplit:
    """The proposer's ``model`` until its first call: that call runs this rank's rows of the target
    step's context ``ctx`` and returns every request's last row in the full batch's order (other rows
    zero). Any other attribute is the model's (the proposer embeds the first pass's inputs through it
    before the call)."""

    def __init__(self, proposer, ctx: PCPContext):
        self.proposer, self.model, self.step_ctx = proposer, proposer.model, ctx
        self.called = False

    def __getattr__(self, name):
        if name == "model":  # not set yet (a copy being built): no attribute, not a recursion
            raise AttributeError(name)
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        self.proposer.model, self.called = self.model, True  # later passes: the model itself
        if args:
            raise RuntimeError("qwen36_pcp: the MTP drafter's model was called with positional arguments; "
                               "its first pass can only be split when called with vLLM's keywords")
        rows = next((kwargs[name] for name in ("input_ids", "inputs_embeds") if kwargs.get(name) is not None), None)
        if rows is None:
            raise RuntimeError("qwen36_pcp: the MTP drafter's first pass got neither input_ids nor inputs_embeds")
        ctx = self.step_ctx.for_rows(rows.shape[0])
        for name, dim in ROW_INPUTS:
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name].index_select(dim, ctx.t.local_idx)
        # a captured graph holds the whole batch's rows: the rank's rows run eagerly, as the target's do
        with running_step(ctx, (CUDAGraphMode.NONE, None)):
            output = self.model(**kwargs)
        if not isinstance(output, torch.Tensor):
            raise RuntimeError(f"qwen36_pcp: the MTP drafter returned {type(output).__name__}, not one tensor "
                               "of hidden states; its first pass cannot be split")
        return ctx.gather_output(output, all_rows=False)


@contextlib.contextmanager
def split_first_pass(proposer, ctx: PCPContext | None):
    """While this runs, the proposer's next model call (its first pass) is split with the target step's
    context ``ctx`` (``FirstPassSplit``); None: nothing changes. The target's gather kept only this rank's rows and
    each request's last one, so a proposal that never called its model through ``proposer.model``
    would have read zeros: that raises."""
    if ctx is None:
        yield
        return
    stand_in = FirstPassSplit(proposer, ctx)
    proposer.model = stand_in
    try:
        yield
    finally:
        proposer.model = stand_in.model
    if not stand_in.called:
        raise RuntimeError("qwen36_pcp: the MTP drafter proposed without calling its model as vLLM 0.20.2's "
                           "EagleProposer does; its first pass at a split step could not be split")
