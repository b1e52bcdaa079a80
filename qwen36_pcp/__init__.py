"""Prefill Context Parallel for Qwen3.6-style hybrid models on vLLM 0.20.2 (a vLLM general plugin)."""

from __future__ import annotations

import logging

__version__ = "0.1.0"
ARCHITECTURE = "Qwen3_6ForCausalLM"
_MODEL_REF = "qwen36_pcp.model.qwen3_6:Qwen3_6ForCausalLM"

logger = logging.getLogger("qwen36_pcp")


def register() -> None:
    """vLLM calls this in every process it starts (API server, engine core, workers). Idempotent."""
    from vllm import ModelRegistry

    from . import runner_hooks

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, _MODEL_REF)
    runner_hooks.install()
