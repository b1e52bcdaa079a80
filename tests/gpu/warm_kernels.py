# SPDX-License-Identifier: Apache-2.0
"""Build and autotune on one GPU the Triton kernels that pcp > 1 and tp = 2 engines add to pcp=1's, so
a machine that reuses this Triton cache (``~/.triton``) starts those engines warm.

A pcp=2 engine autotunes vLLM's GDN chunk kernels at the augmented value width V + K during its
profile run (``VllmGDNKernels.warm_scan``, called here on each shape); on a fresh machine
that made its start ~250 s instead of 39 s (two ranks). A tp=2 engine runs the plain kernels
at half the GDN heads. Shapes: the tiny checkpoint (GPU tests) and Qwen3.6-35B-A3B (benchmarks), with
the GDN configs every engine of the checks keeps to (``qwen36_pcp.deterministic_gdn``).

    TRITON_CACHE_AUTOTUNING=1 python -m tests.gpu.diagnose warm
"""

from __future__ import annotations

import time

import torch

from qwen36_pcp.tools.make_checkpoint import build_config

SHAPES = ("tiny", "qwen3.6-35b-a3b")


def gdn_shape(preset: str) -> dict:
    text = build_config(preset)
    text = text.get("text_config", text)
    return {"hk": text["linear_num_key_heads"], "hv": text["linear_num_value_heads"],
            "K": text["linear_key_head_dim"], "V": text["linear_value_head_dim"]}


def shard_weights(s: dict, tp: int):
    """Random GDN weights of one TP shard (what the scan kernels read: gates and head counts)."""
    from qwen36_pcp.layers.gdn_kernels import GDNWeights

    hv = s["hv"] // tp
    return GDNWeights(conv_weight=None, conv_bias=None,
                      A_log=torch.randn(hv, device="cuda"), dt_bias=torch.randn(hv, device="cuda"),
                      num_k_heads=s["hk"] // tp, head_k_dim=s["K"], head_v_dim=s["V"])


def warm_augmented(s: dict) -> None:
    """pcp=2 (tp=1): the augmented scan that the layer warms in its profile run."""
    from qwen36_pcp.layers.gdn_kernels import VllmGDNKernels

    VllmGDNKernels.warm_scan(shard_weights(s, 1), s["hv"], augmented=True, device="cuda")


def warm_plain(s: dict, tp: int = 2) -> None:
    """tp=2 (pcp=1): vLLM's plain chunk scan at the shard's head count."""
    from qwen36_pcp.layers.gdn_kernels import VllmGDNKernels

    VllmGDNKernels.warm_scan(shard_weights(s, tp), s["hv"] // tp, augmented=False, device="cuda")


def main() -> None:
    from qwen36_pcp.deterministic_gdn import pin_gdn_configs

    pin_gdn_configs()  # the GDN configs every engine of the checks autotunes among
    # the pcp=2 kernels of every shape first: they cost a pcp=2 engine's start the most
    for what, fn in (("pcp=2 augmented scan", warm_augmented), ("tp=2 plain scan", warm_plain)):
        for preset in SHAPES:
            s = gdn_shape(preset)
            t0 = time.time()
            fn(s)
            torch.cuda.synchronize()
            print(f"{preset} {s}: {what} ready in {time.time() - t0:.1f} s", flush=True)

