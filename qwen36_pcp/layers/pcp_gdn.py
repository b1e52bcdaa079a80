# SPDX-License-Identifier: Apache-2.0
"""vLLM's GatedDeltaNetAttention with context-parallel steps (relay, state passing or island).

Only the core (conv + gated delta rule) changes: projections, gated norm and out_proj run on the local
tokens as usual. Steps without a PCP context (pcp == 1, unsplit steps, profiling) take vLLM's path,
and so does a spread decode step, on this rank's rows. At a planned step with speculative decoding the
verification rows (first in the rank's rows) take vLLM's own path too, with vLLM's metadata of the
requests this rank verifies; the other rows take the PCP path.
The mode comes from the step's PCP config (``PCPContext.config``), the one place it is set.
"""

from __future__ import annotations

import dataclasses

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn_linear_attn import GatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

from .context import current_pcp_context
from .gdn_cp import gdn_island, gdn_relay, gdn_state_passing, hand_over_states
from .gdn_kernels import GDNWeights, VllmGDNKernels

CORES = {"relay": gdn_relay, "state_passing": gdn_state_passing}


class PCPGatedDeltaNetAttention(GatedDeltaNetAttention):
    def gdn_weights(self) -> GDNWeights:
        w = self.conv1d.weight
        return GDNWeights(
            conv_weight=w.view(w.size(0), w.size(2)),
            conv_bias=self.conv1d.bias,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            num_k_heads=self.num_k_heads // self.tp_size,
            head_k_dim=self.head_k_dim,
            head_v_dim=self.head_v_dim,
            activation=self.activation,
        )

    def warm_augmented_scan(self, device, dtype) -> None:
        """Autotune the chunk kernels for state passing's augmented value width (V + K), as vLLM does
        for V during profiling: otherwise the first split step pays it (a minute on a fresh machine)
        and the autotuner's buffers come out of memory the KV cache already took."""
        VllmGDNKernels.warm_scan(self.gdn_weights(), self.num_v_heads // self.tp_size, augmented=True,
                                 device=device, dtype=dtype)

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        ctx = current_pcp_context()
        if ctx is None:
            return super()._forward_core(mixed_qkv, b, a, core_attn_out)
        meta = get_forward_context().attn_metadata[self.prefix]
        gdn = ctx.gdn  # the requests whose GDN work is split or replicated here (all but the verified)
        state_idx = None if gdn is None else meta.non_spec_state_indices_tensor[: gdn.plan.num_reqs].long()
        if gdn is not None and gdn.plan.handovers:
            hand_over_states(gdn, self.kv_cache[:2], state_idx)
        mode = ctx.config.gdn_mode
        if mode == "island":  # vLLM's core on the whole batch: verification rows included (with
            # decode="spread" a rank that does not own a verifying request then writes over its stale
            # copy of that request's blocks, which no rank reads before a hand-over sends the owner's)
            return gdn_island(ctx, super()._forward_core, mixed_qkv, b, a, core_attn_out)
        rows = ctx.verified.rows
        if rows:
            self._verify(verification_metadata(ctx, meta), mixed_qkv[:rows], b[:rows], a[:rows],
                         core_attn_out[:rows])
        if gdn is None:
            return
        mixed_qkv, b, a, core_attn_out = mixed_qkv[rows:], b[rows:], a[rows:], core_attn_out[rows:]
        conv_state = self.kv_cache[0]
        if not is_conv_state_dim_first():
            conv_state = conv_state.transpose(-1, -2)
        # with speculative decoding the cache keeps K more columns for verification rows; a prefill
        # reads and writes the first width - 1, as vLLM's prefill path does
        conv_state = conv_state[..., : self.conv_kernel_size - 1]
        CORES[mode](gdn, VllmGDNKernels, mixed_qkv, b, a, core_attn_out, self.gdn_weights(), conv_state,
                    self.kv_cache[1], state_idx)

    def _verify(self, verification, mixed_qkv, b, a, core_attn_out) -> None:
        """vLLM's own core on this rank's verification rows, with ``verification`` (vLLM's metadata of
        the step's verified requests narrowed to the ones this rank computes, as a batch of
        verification rows alone) in the forward context while it runs. Each rank writes the states of
        the requests it verifies itself: replicated ones as at an unsplit step, owned ones on their
        owner."""
        forward_context = get_forward_context()
        whole = forward_context.attn_metadata[self.prefix]
        forward_context.attn_metadata[self.prefix] = verification
        try:
            super()._forward_core(mixed_qkv, b, a, core_attn_out)
        finally:
            forward_context.attn_metadata[self.prefix] = whole


def verification_metadata(ctx, meta):
    """``meta`` (vLLM's GDN metadata of the whole step) as the metadata of a batch of this rank's
    verification rows alone (``PCPContext.verified``), once per step and metadata object (every GDN
    layer of a KV-cache group shares one)."""
    cache = ctx.derived
    if id(meta) not in cache:
        rows = ctx.verified
        indices, accepted = meta.spec_state_indices_tensor, meta.num_accepted_tokens
        if rows.picks is not None:
            indices, accepted = indices.index_select(0, rows.picks), accepted.index_select(0, rows.picks)
        # vLLM's core only asks whether the mask is set; it is the batch's own: every request verified
        mask = torch.ones(rows.num_reqs, dtype=torch.bool, device=rows.query_start.device)
        cache[id(meta)] = meta, dataclasses.replace(
            meta, num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
            num_spec_decodes=rows.num_reqs, num_spec_decode_tokens=rows.rows, num_actual_tokens=rows.rows,
            has_initial_state=None, spec_query_start_loc=rows.query_start, non_spec_query_start_loc=None,
            spec_sequence_masks=mask,
            spec_state_indices_tensor=indices, non_spec_state_indices_tensor=None, spec_token_indx=None,
            non_spec_token_indx=None, num_accepted_tokens=accepted, chunk_indices=None, chunk_offsets=None,
            nums_dict=None, batch_ptr=None, token_chunk_offset_ptr=None)
    return cache[id(meta)][1]
