# SPDX-License-Identifier: Apache-2.0
"""Prefill Context Parallel for Qwen3.6-style hybrid models on vLLM 0.20.2 (a vLLM general plugin)."""

from __future__ import annotations

import logging

__version__ = "0.2.0"
SUPPORTED_VLLM_VERSION = "0.20.2"

logger = logging.getLogger("qwen36_pcp")
_warned = False


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return "not installed"


def version_supported() -> bool:
    return vllm_version().split("+")[0] == SUPPORTED_VLLM_VERSION


def register() -> None:
    """vLLM calls this in every process it starts (API server, engine core, workers). Idempotent.

    On a vLLM other than 0.20.2 it logs one line and changes nothing (the patches touch 0.20.2
    internals); on a 0.20.2 whose patched functions changed it raises, naming the one that did.
    """
    global _warned
    if not version_supported():
        if not _warned:
            logger.warning("qwen36_pcp: written for vLLM %s, found %s; plugin not loaded.",
                           SUPPORTED_VLLM_VERSION, vllm_version())
            _warned = True
        return
    from vllm import ModelRegistry

    from . import patches
    from .model import Qwen3_6ForCausalLM, Qwen3_6ForConditionalGeneration

    supported = ModelRegistry.get_supported_archs()
    for cls in (Qwen3_6ForCausalLM, Qwen3_6ForConditionalGeneration):
        if cls.__name__ not in supported:
            # the class itself, not "module:Class": vLLM inspects a lazily registered out-of-tree model
            # in a fresh Python subprocess on every engine start (~20 s), and the module is imported anyway
            ModelRegistry.register_model(cls.__name__, cls)
    patches.install()
