# SPDX-License-Identifier: Apache-2.0
"""Decode and verification rows over a sharded KV cache with vLLM's kernels (bf16, Qwen3.6's attention
shape): vLLM's slot mapping writes each token on its rank, FlashAttention attends each rank's shard,
the merges (``qwen36_pcp.kv_shard``) give the rows' attention; against vLLM's own decode call over the
whole cache, both measured from an fp32 reference.

    python -m pytest -q -s tests/gpu/test_kv_shard_gpu.py      # one GPU is enough (ranks replayed)
"""

import json
import os

import numpy as np
import pytest
import torch

from harness.dist import run_distributed

from ..attention_reference import varlen_reference
from .replay import replay

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

H, KVH, D = 16, 2, 256
SEQ_LENS = [1, 4, 700, 5000, 33, 12000]
QUERY_LENS = [1, 4, 1, 4, 1, 1]
REPORT = {}


def _case():
    g = torch.Generator(device="cuda").manual_seed(3)
    total = sum(SEQ_LENS)
    k = torch.randn(total, KVH, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, KVH, D, generator=g, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(sum(QUERY_LENS), H, D, generator=g, device="cuda", dtype=torch.bfloat16)
    return q, k, v


def _tables(n, rank, block_size, interleave):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    from qwen36_pcp.kv_shard.layout import KVShard, shard_block_tables

    max_blocks = -(-max(SEQ_LENS) // block_size)
    tables = MultiGroupBlockTable(len(SEQ_LENS), max(SEQ_LENS), sum(SEQ_LENS), False, torch.device("cuda"),
                                  [block_size] * 2, [block_size] * 2, max_num_blocks=[max_blocks] * 2)
    specs = [FullAttentionSpec(block_size=block_size, num_kv_heads=KVH, head_size=D, dtype=torch.bfloat16),
             MambaSpec(block_size=block_size, shapes=((4, 4),), dtypes=(torch.float32,))]
    shard_block_tables(tables.block_tables, specs, KVShard(n, rank, interleave))
    next_block = 1
    for i, t in enumerate(SEQ_LENS):
        nb = -(-t // (block_size * n))
        tables.add_row((list(range(next_block, next_block + nb)), [1]), i)
        next_block += nb
    tables.commit_block_table(len(SEQ_LENS))
    return tables, next_block


def _rank(rank, group, block_size, interleave):
    """One rank's rows over its shard, or (group None) vLLM's decode call over the whole cache."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

    from qwen36_pcp.kv_shard.decode import ShardedRows, attend_sharded
    from qwen36_pcp.kv_shard.layout import KVShard

    n = 1 if group is None else group.world_size
    q, k, v = _case()
    tables, num_blocks = _tables(n, 0 if group is None else rank, block_size, interleave)
    positions = torch.cat([torch.arange(t, device="cuda") for t in SEQ_LENS])
    cu = torch.tensor(np.concatenate([[0], np.cumsum(SEQ_LENS)]), dtype=torch.int32, device="cuda")
    tables.compute_slot_mapping(len(SEQ_LENS), cu, positions)
    slots = tables[0].slot_mapping.gpu[: len(positions)]
    key_cache = torch.zeros(num_blocks, block_size, KVH, D, dtype=torch.bfloat16, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    mine = slots >= 0
    key_cache.view(-1, KVH, D)[slots[mine]] = k[mine]
    value_cache.view(-1, KVH, D)[slots[mine]] = v[mine]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(QUERY_LENS)]), dtype=torch.int32, device="cuda")
    block_table = tables[0].get_device_tensor(len(SEQ_LENS))
    scale = D**-0.5
    fa = get_flash_attn_version()
    if group is None:  # vLLM's decode: the rows attend the whole cache, their own new tokens included
        out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
        seq = torch.tensor(SEQ_LENS, dtype=torch.int32, device="cuda")
        flash_attn_varlen_func(q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=cu_q,
                               max_seqlen_q=max(QUERY_LENS), seqused_k=seq, max_seqlen_k=max(SEQ_LENS),
                               softmax_scale=scale, causal=True, block_table=block_table, fa_version=fa)
        return out
    context = [t - m for t, m in zip(SEQ_LENS, QUERY_LENS)]
    new = torch.cat([torch.arange(c, t, device="cuda") + int(cu[i]) for i, (c, t) in enumerate(zip(context, SEQ_LENS))])
    local = KVShard(n, rank, interleave).local_lens(torch.tensor(context, dtype=torch.int32, device="cuda"))
    rows = ShardedRows(cu_q, max(QUERY_LENS), local, int(local.max()), block_table)
    out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
    return attend_sharded(q, k[new], v[new], key_cache, value_cache, rows, scale, group, out, fa_version=fa)


@pytest.mark.parametrize("world_size,interleave", [(2, 1), (3, 1), (4, 16), (8, 1)])
@pytest.mark.parametrize("how", ["replay", "nccl"])
def test_sharded_decode_as_close_as_vllms_decode(world_size, interleave, how):
    block_size = 16
    if how == "replay":
        outs = replay(_rank, world_size, block_size, interleave)
    else:
        if torch.cuda.device_count() < world_size:
            pytest.skip(f"needs {world_size} GPUs for NCCL")
        outs = run_distributed(_rank, world_size, block_size, interleave, backend="nccl")
    whole = _rank(0, None, block_size, interleave)
    q, k, v = _case()
    cu_q = np.concatenate([[0], np.cumsum(QUERY_LENS)]).tolist()
    ref, _ = varlen_reference(q, k, v, torch.tensor(cu_q, dtype=torch.int32, device="cuda"), max(QUERY_LENS),
                              D**-0.5, True, True, max_seqlen_k=max(SEQ_LENS),
                              cu_seqlens_k=torch.tensor(np.concatenate([[0], np.cumsum(SEQ_LENS)]),
                                                        dtype=torch.int32, device="cuda"))
    assert all(torch.equal(o.cpu(), outs[0].cpu()) for o in outs), "ranks disagree"
    report = []
    for i in range(len(QUERY_LENS)):
        rows = slice(cu_q[i], cu_q[i + 1])
        size = float(ref[rows].abs().max())
        err_vllm = float((whole[rows].float() - ref[rows]).abs().max())
        err = float((outs[0][rows].float().to(ref.device) - ref[rows]).abs().max())
        report.append({"tokens": SEQ_LENS[i], "rows": QUERY_LENS[i], "size": size, "vllm_decode": err_vllm,
                       "sharded": err})
    REPORT[f"{how} pcp{world_size} interleave{interleave}"] = report
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kv_shard_gpu.json"), "w") as f:
            json.dump(REPORT, f, indent=1)
    for r in report:
        # per request, against the size of its own output: the sharded path rounds to bf16 (2**-8 relative at
        # most) at each of N partial outputs, their merge, its correction and the final merge: N + 3 times
        assert r["sharded"] <= r["vllm_decode"] + (world_size + 3) * 2**-8 * r["size"], r
