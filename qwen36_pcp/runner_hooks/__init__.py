# SPDX-License-Identifier: Apache-2.0
"""The plugin's integration into vLLM's model runner at pcp > 1 (``runner.py`` and its parts)."""

from .block_tables import pcp1_block_tables
from .runner import PCPModelRunner

__all__ = ["PCPModelRunner", "pcp1_block_tables"]
