# SPDX-License-Identifier: Apache-2.0
"""Which rank keeps which token's K/V: vLLM's context-parallel rule with the PCP group as the CP group.

vLLM 0.20.2's block tables already shard a cache group over ``pcp x dcp`` ranks: a block of the
scheduler's holds ``block_size x N`` tokens, rank r keeps those whose ``(pos // interleave) % N == r`` in
its own physical page of ``block_size`` slots, and every other token of the step gets the pad slot
(``_compute_slot_mapping_kernel``). Sharded here are the attention groups only: a GDN group's block is one
request's whole recurrent state, which every rank needs to run its share of the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec


def is_sharded(spec: KVCacheSpec) -> bool:
    """Attention K/V is sharded; recurrent (GDN, Mamba) state stays whole on every rank."""
    return isinstance(spec, AttentionSpec)


@dataclass(frozen=True)
class KVShard:
    """Rank ``rank`` of ``world_size`` keeps every ``interleave`` consecutive tokens of each
    ``world_size x interleave`` (``cp_kv_cache_interleave_size``, vLLM's default 1)."""

    world_size: int
    rank: int
    interleave: int = 1

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size or self.interleave < 1:
            raise ValueError(f"no such shard: rank {self.rank} of {self.world_size}, interleave {self.interleave}")

    def keeps(self, positions: np.ndarray) -> np.ndarray:
        """Whether this rank keeps the tokens at ``positions``."""
        return (np.asarray(positions) // self.interleave) % self.world_size == self.rank

    def local_index(self, positions: np.ndarray) -> np.ndarray:
        """A kept token's index among the tokens this rank keeps of its sequence (where it sits in the
        rank's pages: ``local_index // block_size`` is the block, the rest the slot in it)."""
        pos = np.asarray(positions)
        return pos // (self.world_size * self.interleave) * self.interleave + pos % self.interleave

    def local_lens(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """How many of each sequence's first ``seq_lens`` tokens this rank keeps (vLLM's DCP helper)."""
        return get_dcp_local_seq_lens(seq_lens, self.world_size, self.rank, self.interleave)


def shard_block_tables(block_tables, specs: list[KVCacheSpec], shard: KVShard) -> None:
    """Point vLLM's per-group block tables (``MultiGroupBlockTable.block_tables``, in the order of the KV
    cache groups, whose specs are ``specs``) at the shard: an attention group's slot mapping writes only
    the tokens this rank keeps; a GDN group's stays pcp == 1's."""
    if len(block_tables) != len(specs):
        raise ValueError(f"{len(block_tables)} block tables for {len(specs)} KV cache groups")
    for table, spec in zip(block_tables, specs):
        if is_sharded(spec) and table.block_size % shard.interleave:
            # vLLM's kernel interleaves within a block: the rule above holds when the interleave divides it
            raise ValueError(f"cp_kv_cache_interleave_size {shard.interleave} does not divide the attention "
                             f"block size {table.block_size}")
        if is_sharded(spec):
            table.pcp_world_size, table.pcp_rank = shard.world_size, shard.rank
        else:
            table.pcp_world_size, table.pcp_rank = 1, 0
        table.cp_kv_cache_interleave_size = shard.interleave
