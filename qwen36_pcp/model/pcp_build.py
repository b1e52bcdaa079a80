# SPDX-License-Identifier: Apache-2.0
"""What both of our model classes do around vLLM's constructor (text-only and vision-language).

At prefill_context_parallel_size > 1 the PCP model runner builds them while the PCP layer classes are
registered (``layers.classes.pcp_model_build``), so vLLM's constructor already builds the PCP GDN,
narrow-linear and whole-experts layers; what is left is the check that it is that runner, the
attention impl (not a pluggable layer), and one log line about the experts' memory. At pcp == 1 this
is vLLM's constructor and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger

from ..config import built_by_pcp_runner
from ..expert_memory import whole_experts_bytes
from ..layers.classes import adopt_pcp_attention

logger = init_logger(__name__)


def build_model(model: torch.nn.Module, vllm_config: VllmConfig, architecture: str,
                construct: Callable[[], None]) -> None:
    """Run ``construct`` (vLLM's ``__init__`` for ``model``) with what PCP needs before and after it."""
    pcp = vllm_config.parallel_config.prefill_context_parallel_size > 1
    if pcp and not built_by_pcp_runner():
        raise RuntimeError(
            f"qwen36_pcp: {architecture} at prefill_context_parallel_size > 1 must be built by the PCP "
            f"model runner, which qwen36_pcp.worker.PCPWorker builds; this worker "
            f"(worker_cls={vllm_config.parallel_config.worker_cls!r}) built another. Leave worker_cls "
            "unset, or build your worker class on qwen36_pcp.worker.PCPWorker.")
    construct()
    if not getattr(vllm_config.model_config.hf_text_config, "num_experts", 0):
        # dense (Qwen3.6-27B-style): vLLM's MoE bookkeeping, empty
        model.num_moe_layers = 0
        model.expert_weights = []
        model.moe_layers = []
    if not pcp:
        return
    adopt_pcp_attention(model)
    experts = [m for m in model.modules() if hasattr(m, "moe_parallel_config")]
    if experts:
        par = experts[0].moe_parallel_config
        size = whole_experts_bytes(vllm_config)
        logger.info(
            "%s: MoE experts %s over the PCP ranks (expert TP size %d%s)", architecture,
            "sharded" if par.pcp_size > 1 else "whole on every rank, not sharded",
            par.tp_size, "" if size is None else f", {size / par.tp_size / 2**30:.3g} GiB per GPU",
        )
