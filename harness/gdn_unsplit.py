# SPDX-License-Identifier: Apache-2.0
"""The plain (unsplit) GDN core of a batch with any kernels of ``VllmGDNKernels``' contract: vLLM's on
a GPU, the tests' fp32 reference on the CPU. What every split mode is compared with, and a benchmark's
one-GPU baseline."""

from __future__ import annotations

import torch

from qwen36_pcp.layers.device_copy import Varlen
from qwen36_pcp.layers.gdn_kernels import GDNWeights


def gdn_unsplit_core(kernels, mixed_qkv, b, a, out, w: GDNWeights, conv_state, ssm_state,
                       state_idx, num_computed, cu_cpu):
    """The plain (unsplit) GDN core of a batch of requests, with the given kernels; writes the states.

    conv_state [lines, D, W-1]; ``num_computed`` (host ints) says which requests continue from the cache.
    """
    has_init = torch.tensor([int(c) > 0 for c in num_computed], device=mixed_qkv.device)
    init_conv = conv_state.index_select(0, state_idx).to(mixed_qkv.dtype)
    init_conv = torch.where(has_init[:, None, None], init_conv, 0)  # [R, D, W-1]
    seqs = Varlen(cu_cpu.to(mixed_qkv.device), cu_cpu)
    width = w.conv_weight.shape[1]
    bounds = cu_cpu.tolist()
    new_conv = [  # before the conv kernel, which writes its final states into init_conv
        torch.cat([init_conv[i].transpose(0, 1), mixed_qkv[bounds[i] : bounds[i + 1]]], 0)[-(width - 1) :]
        for i in range(len(bounds) - 1)
    ]
    scratch = init_conv.transpose(1, 2).contiguous().transpose(1, 2)  # SD layout, like vLLM's cache
    y = kernels.conv(mixed_qkv, w.conv_weight, w.conv_bias, scratch, seqs, w.activation)
    for i, state in enumerate(new_conv):
        conv_state[state_idx[i]] = state.transpose(0, 1).to(conv_state.dtype)
    q, k, v, g, beta = kernels.prep(y, a, b, w)
    init = ssm_state.index_select(0, state_idx).float()
    init = torch.where(has_init[:, None, None, None], init, 0.0)
    o, final = kernels.chunk(q, k, v, g, beta, init, seqs)
    ssm_state[state_idx] = final.to(ssm_state.dtype)
    out[: o.shape[0]] = o.to(out.dtype)
