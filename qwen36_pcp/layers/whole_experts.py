# SPDX-License-Identifier: Apache-2.0
"""vLLM's FusedMoE with every expert whole on each PCP rank (``moe_experts="replicated"``, the default).

vLLM 0.20.2 shards each expert's intermediate dimension over TP x PCP and wraps the experts in a PCP
all-gather and a bf16 reduce-scatter. That is tp=2's MoE arithmetic: it alone moves pcp=2 as far from
pcp=1 as tp=2 is (docs/validation.md), and it costs two collectives per MoE layer in every step,
decode included. With whole experts (sharded over TP alone) each rank runs its own tokens through
pcp=1's kernel, which gives every token the same bits whatever the batch split, and decode needs no
MoE collective; the price is the experts' full memory on every GPU (checked at startup).
``moe_experts="sharded"`` keeps vLLM's way.
"""

from __future__ import annotations

from vllm.model_executor.layers.fused_moe.layer import FusedMoE


class WholeExpertsFusedMoE(FusedMoE):
    def __init__(self, *args, **kwargs):
        if kwargs.get("pcp_size") is None:
            kwargs["pcp_size"] = 1  # FusedMoEParallelConfig then flattens TP over TP alone
        super().__init__(*args, **kwargs)
