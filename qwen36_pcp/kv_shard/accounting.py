# SPDX-License-Identifier: Apache-2.0
"""The scheduler's view of a sharded cache: an attention block holds N times the tokens.

Each rank's pool keeps its physical pages (``block_size`` slots per attention block, the page size that
vLLM sized the pool by and that the GDN state pages match); a block id of the scheduler names the same
page on every rank, and each rank writes there only the tokens it keeps (``layout``). So the scheduler
accounts an attention block as ``block_size x N`` tokens and a GDN block as it is: one request's state.
vLLM 0.20.2 multiplies a single group's block size by ``dcp x pcp`` and refuses hybrid groups with
context parallelism (``resolve_kv_cache_block_sizes``); here the scheduler keeps seeing pcp == 1 (as the
replicated cache has it, ``patches``) with the attention groups' specs rescaled, and aligns prompt
chunks to the longer block (``cache_config.block_size``, which vLLM's prefix caching of GDN states in
``align`` mode reads: a state is kept where a chunk ends, and a hit needs one at an attention block's end).
The copies are for block counting only: a rescaled spec's page size is not a page of the pool.
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
    groups = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        if is_sharded(spec):
            if getattr(spec, "page_size_padded", None) is not None:
                raise ValueError(f"a sharded attention group with a padded page ({spec}) is not supported")
            g = dataclasses.replace(g, kv_cache_spec=dataclasses.replace(spec, block_size=spec.block_size * world_size))
        groups.append(g)
    view.kv_cache_groups = groups
    return view


def sharded_scheduler_vllm_config(vllm_config, world_size: int):
    """A shallow copy of the config whose cache block is ``world_size`` physical blocks long (the
    scheduler's prompt-chunk alignment); everything else is the config itself."""
    view = copy.copy(vllm_config)
    cache = copy.copy(vllm_config.cache_config)
    object.__setattr__(cache, "block_size", vllm_config.cache_config.block_size * world_size)
    object.__setattr__(view, "cache_config", cache)
    return view
