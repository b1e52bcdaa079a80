# SPDX-License-Identifier: Apache-2.0
"""Random inputs with Qwen3.6-35B-A3B layer shapes, shared by GPU layer tests and benchmarks."""

from __future__ import annotations

import torch

from qwen36_pcp.layers.gdn_kernels import GDNWeights

# Qwen3.6-35B-A3B per-layer shapes (tp = 1)
ATTN = dict(heads=16, kv_heads=2, head_dim=256, block_size=64)
GDN = dict(hk=16, hv=32, dk=128, dv=128, width=4)

def gdn_inputs(num_computed, num_new, dev, seed=0):
    hk, hv, dk, dv, w = GDN["hk"], GDN["hv"], GDN["dk"], GDN["dv"], GDN["width"]
    g = torch.Generator(device=dev).manual_seed(seed)
    D = 2 * hk * dk + hv * dv
    T, R = sum(num_new), len(num_new)
    rnd = lambda *s, dt=torch.bfloat16: torch.randn(*s, device=dev, generator=g, dtype=torch.float32).to(dt)  # noqa: E731
    weights = GDNWeights(conv_weight=rnd(D, w) * 0.5, conv_bias=None,
                         A_log=torch.log(torch.empty(hv, device=dev).uniform_(1, 16, generator=g)),
                         dt_bias=rnd(hv, dt=torch.float32) * 0.1, num_k_heads=hk, head_k_dim=dk, head_v_dim=dv)
    lines = R + 2
    return dict(mixed_qkv=rnd(T, D), b=rnd(T, hv), a=rnd(T, hv), conv_state=rnd(lines, D, w - 1),
                ssm_state=rnd(lines, hv, dv, dk, dt=torch.float32) * 0.1,
                state_idx=torch.arange(1, R + 1, device=dev)), weights
