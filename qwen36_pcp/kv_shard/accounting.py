# SPDX-License-Identifier: Apache-2.0
"""The scheduler's view of a sharded cache: an attention block holds N times the tokens.

Each rank's pool keeps its physical pages (``block_size`` slots per attention block, the page size that
vLLM sized the pool by and that the GDN state pages match); a block id of the scheduler names the same
page on every rank, and each rank writes there only the tokens it keeps (``layout``). So the scheduler
accounts an attention block as ``block_size x N`` tokens and a GDN block as it is: one request's state.
vLLM 0.20.2 multiplies a single group's block size by ``dcp x pcp`` and refuses hybrid groups with
context parallelism (``resolve_kv_cache_block_sizes``); here the scheduler keeps seeing pcp == 1 (as the
replicated cache has it, ``patches``) with the attention groups' specs rescaled.
"""

from __future__ import annotations

import copy
import dataclasses

from vllm.v1.kv_cache_interface import KVCacheConfig

from .layout import is_sharded


def sharded_scheduler_config(kv_cache_config: KVCacheConfig, world_size: int) -> KVCacheConfig:
    """The scheduler's copy of the engine's KV-cache config: attention groups' blocks of ``world_size``
    times the tokens; the workers keep the config they allocated by."""
    view = copy.copy(kv_cache_config)
    view.kv_cache_groups = [
        dataclasses.replace(g, kv_cache_spec=dataclasses.replace(
            g.kv_cache_spec, block_size=g.kv_cache_spec.block_size * world_size))
        if is_sharded(g.kv_cache_spec) else g
        for g in kv_cache_config.kv_cache_groups
    ]
    return view

