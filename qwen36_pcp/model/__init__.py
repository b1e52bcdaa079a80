# SPDX-License-Identifier: Apache-2.0
from .qwen3_6 import ARCHITECTURE, SKIPPED_PREFIXES, Qwen3_6ForCausalLM
from .qwen3_6_vl import Qwen3_6ForConditionalGeneration

__all__ = ["ARCHITECTURE", "SKIPPED_PREFIXES", "Qwen3_6ForCausalLM", "Qwen3_6ForConditionalGeneration"]
