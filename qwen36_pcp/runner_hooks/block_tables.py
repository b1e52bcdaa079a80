# SPDX-License-Identifier: Apache-2.0
"""The replicated KV cache's block tables: vLLM 0.20.2 would shard the cache over the PCP ranks (and
rejects hybrid models); here every rank holds the whole cache and every request's GDN states, so the
block tables and slot mapping are pcp == 1's, as the engine core's block accounting is (``patches``)."""

from __future__ import annotations

import contextlib

import vllm.v1.worker.block_table as block_table_module
import vllm.v1.worker.gpu_model_runner as gpu_model_runner_module
from vllm.distributed import get_pcp_group


@contextlib.contextmanager
def pcp1_block_tables():
    """Block tables built while this runs have pcp == 1's rows: vLLM sizes a request's block-table row
    for 1/pcp of ``max_model_len`` (``get_total_cp_world_size``, read in the block-table and runner
    modules); a replicated cache needs the whole sequence's blocks. Reverts when the block ends (a
    worker process builds its runner on one thread)."""
    originals = {m: m.get_total_cp_world_size for m in (block_table_module, gpu_model_runner_module)}
    pcp = get_pcp_group().world_size

    def dcp_only() -> int:
        return originals[block_table_module]() // pcp

    try:
        for module in originals:
            module.get_total_cp_world_size = dcp_only
        yield
    finally:
        for module, fn in originals.items():
            module.get_total_cp_world_size = fn


def replicate_block_tables(input_batch) -> None:
    """Every rank computes the slot of every new token (vLLM's kernel would give other ranks' tokens
    the pad slot): the tables see pcp == 1 (DCP, refused with PCP, stays vLLM's)."""
    for table in input_batch.block_table.block_tables:
        table.pcp_world_size, table.pcp_rank = 1, 0
