# SPDX-License-Identifier: Apache-2.0
"""Split attention and the GDN split sweep with vLLM's real kernels, bf16, against the unsplit kernels.

    python -m pytest -q -s tests/gpu/test_layers_gpu.py      # one GPU is enough

On one GPU the N ranks are replayed in one process (``replay``); with N GPUs they also run as N
processes over NCCL. Attention, the GDN relay and island must be bit for bit the unsplit call; GDN state
passing within its bf16 correction.
"""

import json
import os

import pytest
import torch

from harness.dist import run_distributed

from .layer_cases_gpu import attention_case, gdn_sweep_case
from .replay import replay

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

REPORT = {}


def _save():
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "layers_gpu.json"), "w") as f:
            json.dump(REPORT, f, indent=1)


def _run(fn, world_size, how, *args):
    if how == "replay":
        return replay(fn, world_size, *args)
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs for NCCL")
    return run_distributed(fn, world_size, *args, backend="nccl")


@pytest.mark.parametrize("how", ["replay", "nccl"])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_split_attention_bit_for_bit(world_size, how):
    for layout in ("zigzag", "contiguous"):
        per_rank = _run(attention_case, world_size, how, layout)
        REPORT[f"attention pcp{world_size} {layout} {how}"] = per_rank
        _save()
        assert all(v == 0.0 for r in per_rank for v in r.values()), per_rank


@pytest.mark.parametrize("how", ["replay", "nccl"])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_gdn_sweep_every_mode(world_size, how):
    per_rank = _run(gdn_sweep_case, world_size, how)
    failures = [f for fails, _ in per_rank for f in fails]
    worst = {k: max(w[k] for _, w in per_rank) for k in per_rank[0][1]}
    REPORT[f"gdn sweep pcp{world_size} {how}"] = {"worst_rel": worst, "failures": failures[:50]}
    _save()
    print(f"pcp{world_size} {how}: worst relative errors {worst}")
    assert not failures, "\n".join(failures[:20])


def test_sweep_sees_blocks_off_the_chunk_grid(monkeypatch):
    """Negative control: with the split rule from before the split floor, the relay departs from the
    unsplit kernels (NaN at pcp=8 on 520-900 tokens end to end), island does not."""
    from tests.gdn_sweep import unaligned_blocks

    unaligned_blocks(monkeypatch.setattr)
    failures = [f for fails, _ in replay(gdn_sweep_case, 8) for f in fails]
    REPORT["negative control pcp8 replay"] = {"failures": len(failures), "first": failures[:10]}
    _save()
    assert any(" relay out" in f for f in failures)
    assert not any(" island " in f for f in failures)


def test_indices_reach_the_gpu_from_pinned_memory_without_the_host_waiting():
    """``to_device_all`` on a GPU with work queued: it returns while the stream is still busy (the
    host did not wait for the queued work), and the indices arrive intact even though the pinned
    blocks of that size are taken and overwritten before the copy runs."""
    import numpy as np

    from qwen36_pcp.layers.device_copy import to_device_all

    arrays = [np.arange(1000) + 7 * i for i in range(3)] + [(np.arange(5) % 2 == 0, torch.bool)]
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of queued work on the current stream
    moved = to_device_all("cuda", *arrays)
    assert not torch.cuda.current_stream().query(), "the host waited for the queued work"
    for _ in range(8):  # pinned blocks as big as the packed copy's, written before the copy has run
        torch.empty(4 * 8000, dtype=torch.uint8, pin_memory=True).fill_(255)
    torch.cuda.synchronize()
    for item, t in zip(arrays, moved):
        array = item[0] if isinstance(item, tuple) else item
        assert t.is_cuda and np.array_equal(t.cpu().numpy(), array)


def test_kv_stage_is_kept_by_the_cache_write_inside_a_cuda_graph():
    """``KVStage`` on a GPU: the plugin's attention impl, with vLLM's real cache write
    (``reshape_and_cache_flash``), captured in a CUDA graph as vLLM captures a decode step; each replay
    with new K/V and slots writes them to the cache and keeps them in the stage, and a step of more rows
    than the stage holds keeps its first rows."""
    from types import SimpleNamespace

    from vllm.v1.attention.backend import AttentionType

    from qwen36_pcp.layers.pcp_attention import PCPFlashAttentionImpl
    from qwen36_pcp.spread.owned_batch import KVStage

    kvh, d, bs, blocks, rows = 2, 256, 16, 8, 8
    impl = object.__new__(PCPFlashAttentionImpl)
    impl.attn_type, impl.kv_cache_dtype, impl.num_kv_heads, impl.head_size = AttentionType.DECODER, "auto", kvh, d
    one = torch.ones((), device="cuda")
    layer = SimpleNamespace(impl=impl, _k_scale=one, _v_scale=one,
                            kv_cache=torch.zeros(2, blocks, bs, kvh, d, dtype=torch.bfloat16, device="cuda"))
    stage = KVStage([layer], rows, torch.bfloat16, "cuda")
    qkv = torch.zeros(rows, 3, kvh, d, dtype=torch.bfloat16, device="cuda")  # K and V: views, as vLLM's
    slots = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture, as vLLM does
        impl.do_kv_cache_update(layer, qkv[:, 1], qkv[:, 2], layer.kv_cache, slots)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        impl.do_kv_cache_update(layer, qkv[:, 1], qkv[:, 2], layer.kv_cache, slots)
    for trial in range(3):
        qkv.copy_(torch.randn_like(qkv))
        slots.copy_(torch.randperm(blocks * bs, device="cuda")[:rows])
        slots[-1] = -1  # a padding row: not written, still kept
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(stage.rows[:, 0, 0], qkv[:, 1]) and torch.equal(stage.rows[:, 0, 1], qkv[:, 2]), trial
        cache = layer.kv_cache.view(2, -1, kvh, d)
        assert torch.equal(cache[0][slots[:-1]], qkv[:-1, 1]) and torch.equal(cache[1][slots[:-1]], qkv[:-1, 2])
    more = torch.randn(rows + 1, kvh, d, dtype=torch.bfloat16, device="cuda")
    impl.do_kv_cache_update(layer, more, -more, layer.kv_cache, torch.full((rows + 1,), -1, device="cuda"))
    assert torch.equal(stage.rows[:, 0, 0], more[:rows]) and torch.equal(stage.rows[:, 0, 1], -more[:rows])
