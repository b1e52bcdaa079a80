from .qwen3_6 import ARCHITECTURE, SKIPPED_PREFIXES, Qwen3_6ForCausalLM

__all__ = ["ARCHITECTURE", "SKIPPED_PREFIXES", "Qwen3_6ForCausalLM"]
