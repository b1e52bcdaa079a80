"""vLLM's GatedDeltaNetAttention with context-parallel steps (relay, state passing or island).

Only the core (conv + gated delta rule) changes: projections, gated norm and out_proj run on the local
tokens as usual. Steps without a PCP context (pcp == 1, unsplit steps, profiling) take vLLM's path,
and so does a spread decode step, on this rank's rows.
The mode comes from the step's PCP config (``PCPContext.config``), the one place it is set.
"""

from __future__ import annotations

from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn_linear_attn import GatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

from .context import current_pcp_context
from .gdn_cp import GDNWeights, VllmGDNKernels, gdn_island, gdn_relay, gdn_state_passing, hand_over_states

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
        state_idx = meta.non_spec_state_indices_tensor[: ctx.plan.num_reqs].long()
        if ctx.plan.handovers:
            hand_over_states(ctx, self.kv_cache[:2], state_idx)
        mode = ctx.config.gdn_mode
        if mode == "island":
            return gdn_island(ctx, super()._forward_core, mixed_qkv, b, a, core_attn_out)
        conv_state = self.kv_cache[0]
        if not is_conv_state_dim_first():
            conv_state = conv_state.transpose(-1, -2)
        # with speculative decoding the cache keeps K more columns for verification rows; a prefill
        # reads and writes the first width - 1, as vLLM's prefill path does
        conv_state = conv_state[..., : self.conv_kernel_size - 1]
        CORES[mode](ctx, VllmGDNKernels, mixed_qkv, b, a, core_attn_out, self.gdn_weights(), conv_state,
                    self.kv_cache[1], state_idx)
