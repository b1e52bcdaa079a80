# SPDX-License-Identifier: Apache-2.0
"""The kernels the GDN context-parallel modes run, behind one contract (``gdn_cp`` takes any object
that keeps it: these, or the tests' fp32 torch reference with the same 64-token chunk structure):
vLLM 0.20.2's causal conv, its post-conv prep and its bundled fla chunked scan, whole or stage by stage
(the relay runs the chunk-local stages for all rows at once and the state recurrence run by run)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from vllm.model_executor.layers.fla.ops import chunk_gated_delta_rule, fused_post_conv_prep
from vllm.model_executor.layers.fla.ops.chunk_delta_h import chunk_gated_delta_rule_fwd_h
from vllm.model_executor.layers.fla.ops.chunk_o import chunk_fwd_o
from vllm.model_executor.layers.fla.ops.chunk_scaled_dot_kkt import chunk_scaled_dot_kkt_fwd
from vllm.model_executor.layers.fla.ops.cumsum import chunk_local_cumsum
from vllm.model_executor.layers.fla.ops.index import prepare_chunk_indices, prepare_chunk_offsets
from vllm.model_executor.layers.fla.ops.solve_tril import solve_tril
from vllm.model_executor.layers.fla.ops.utils import FLA_CHUNK_SIZE
from vllm.model_executor.layers.fla.ops.wy_fast import recompute_w_u_fwd
from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn
from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata

from .device_copy import Varlen, to_device_all


@dataclass
class GDNWeights:
    """What the GDN core needs from its layer (per TP shard)."""

    conv_weight: torch.Tensor  # [D, W]
    conv_bias: torch.Tensor | None
    A_log: torch.Tensor  # [HV]
    dt_bias: torch.Tensor  # [HV]
    num_k_heads: int
    head_k_dim: int
    head_v_dim: int
    activation: str = "silu"


# ------------------------------------------------------------------------------------- kernels
class VllmGDNKernels:
    """vLLM 0.20.2's kernels: causal_conv1d_fn, fused_post_conv_prep and its bundled fla chunk scan.

    The augmented scan (V' = V + K) goes to the Triton/fla kernel directly: FlashInfer's GDN prefill
    only takes V = 128.
    """

    @staticmethod
    def conv(x, weight, bias, init_states, seqs: Varlen, activation="silu"):
        num_segs = init_states.shape[0]
        if seqs.conv_meta is None:  # host loops over the tokens: once per step, not once per layer
            nums_dict, batch_ptr, token_chunk_offset_ptr = compute_causal_conv1d_metadata(
                seqs.cu_cpu, device=x.device
            )
            seqs.conv_meta = SimpleNamespace(
                nums_dict=nums_dict, batch_ptr=batch_ptr, token_chunk_offset_ptr=token_chunk_offset_ptr,
                cache_indices=torch.arange(num_segs, dtype=torch.int32, device=x.device),
                has_initial_state=torch.ones(num_segs, dtype=torch.bool, device=x.device),
            )
        meta = seqs.conv_meta
        return causal_conv1d_fn(
            x.transpose(0, 1),
            weight,
            bias,
            conv_states=init_states,
            query_start_loc=seqs.cu,
            cache_indices=meta.cache_indices,
            has_initial_state=meta.has_initial_state,
            activation=activation,
            # the scratch lines are 0..S-1; by default the kernel skips line 0 (vLLM's null block)
            null_block_id=None,
            metadata=meta,
        ).transpose(0, 1)

    @staticmethod
    def prep(y, a, b, w: GDNWeights):
        return fused_post_conv_prep(
            conv_output=y,
            a=a,
            b=b,
            A_log=w.A_log,
            dt_bias=w.dt_bias,
            num_k_heads=w.num_k_heads,
            head_k_dim=w.head_k_dim,
            head_v_dim=w.head_v_dim,
            apply_l2norm=True,
            output_g_exp=False,
        )

    @staticmethod
    def chunk(q, k, v, g, beta, init, seqs: Varlen, scale=None):
        chunk_indices, chunk_offsets = VllmGDNKernels._chunk_meta(seqs, q.device)
        o, final = chunk_gated_delta_rule(
            q=q[None],
            k=k[None],
            v=v[None],
            g=g[None],
            beta=beta[None],
            scale=scale,
            initial_state=init,
            output_final_state=True,
            cu_seqlens=seqs.cu,
            chunk_indices=chunk_indices,
            chunk_offsets=chunk_offsets,
            use_qk_l2norm_in_kernel=False,
        )
        return o[0], final

    @classmethod
    def warm_scan(cls, w: GDNWeights, num_v_heads: int, augmented: bool, device, dtype=torch.bfloat16):
        """Build and autotune prep + the chunk scan on one 64-token chunk of random inputs, at value
        width V (the plain scan) or V + K (``augmented_values``)."""
        T, K = FLA_CHUNK_SIZE, w.head_k_dim
        dim = 2 * w.num_k_heads * K + num_v_heads * w.head_v_dim
        y = torch.randn(T, dim, device=device, dtype=dtype)
        a, b = (torch.randn(T, num_v_heads, device=device, dtype=dtype) for _ in range(2))
        q, k, v, g, beta = cls.prep(y, a, b, w)
        if augmented:
            v = augmented_values(v, K)
        init = torch.zeros(1, num_v_heads, v.shape[-1], K, device=device, dtype=torch.float32)
        cls.chunk(q, k, v, g, beta, init, Varlen.of([0, T], device))

    @staticmethod
    def _chunk_meta(seqs: Varlen, device):
        """fla's chunk indices and offsets of ``seqs``, once per step."""
        if seqs.chunk_meta is None:
            seqs.chunk_meta = tuple(to_device_all(device, *(
                (meta.numpy(), meta.dtype) for meta in (prepare_chunk_indices(seqs.cu_cpu, FLA_CHUNK_SIZE),
                                                        prepare_chunk_offsets(seqs.cu_cpu, FLA_CHUNK_SIZE)))))
        return seqs.chunk_meta

    # relay: the steps of vLLM's chunk_gated_delta_rule_fwd, split where the recurrence starts
    @staticmethod
    def chunk_local(q, k, v, g, beta, seqs: Varlen):
        """cumsum of g, beta K K^T, its triangular solve and the WY factors w, u: chunk by chunk, so one
        call for every local row gives each run's rows what a call on the run alone would."""
        q, k, v, g, beta = (x.contiguous()[None] for x in (q, k, v, g, beta))
        chunk_indices, _ = VllmGDNKernels._chunk_meta(seqs, q.device)
        cu = seqs.cu
        g = chunk_local_cumsum(g, chunk_size=FLA_CHUNK_SIZE, cu_seqlens=cu, chunk_indices=chunk_indices)
        A = chunk_scaled_dot_kkt_fwd(k=k, beta=beta, g=g, cu_seqlens=cu, chunk_indices=chunk_indices,
                                     output_dtype=torch.float32)
        A = solve_tril(A=A, cu_seqlens=cu, chunk_indices=chunk_indices, output_dtype=k.dtype)
        w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g_cumsum=g, cu_seqlens=cu,
                                 chunk_indices=chunk_indices)
        return SimpleNamespace(q=q, k=k, g=g, w=w, u=u)

    @staticmethod
    def chunk_states(prep, lo, hi, init, seqs: Varlen):
        chunk_indices, chunk_offsets = VllmGDNKernels._chunk_meta(seqs, init.device)
        h, v_new, final = chunk_gated_delta_rule_fwd_h(
            k=prep.k[:, lo:hi], w=prep.w[:, lo:hi], u=prep.u[:, lo:hi], g=prep.g[:, lo:hi],
            initial_state=init, output_final_state=True, cu_seqlens=seqs.cu, chunk_indices=chunk_indices,
            chunk_offsets=chunk_offsets,
        )
        return final, (h, v_new)

    @staticmethod
    def chunk_outputs(prep, lo, hi, pending, seqs: Varlen):
        h, v_new = pending
        chunk_indices, _ = VllmGDNKernels._chunk_meta(seqs, h.device)
        o = chunk_fwd_o(q=prep.q[:, lo:hi], k=prep.k[:, lo:hi], v=v_new, h=h, g=prep.g[:, lo:hi],
                        scale=prep.k.shape[-1] ** -0.5, cu_seqlens=seqs.cu, chunk_indices=chunk_indices)
        return o[0].to(prep.q.dtype)


def augmented_values(v, K):
    """v [T, HV, V] -> [T, HV, V+K] with K zero columns: the scan then also carries P and c_t."""
    return torch.cat([v, v.new_zeros(*v.shape[:-1], K)], dim=-1)
