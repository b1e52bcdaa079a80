# SPDX-License-Identifier: Apache-2.0
"""The vision encoder split over the PCP ranks (``qwen36_pcp.layers.vision_split``).

Two halves of one claim, both against the whole batch encoded at once:
- vLLM's own Qwen3-VL vision tower (the tiny checkpoint's, float32 on the CPU) gives, for every rank's
  share of the frames encoded apart, exactly the rows of the whole batch: frames are independent in
  it (and a share that cut a frame, or mislabelled a share's grids, would not be);
- on real gloo ranks (vLLM's GroupCoordinator, 2, 4 and 8 ranks), the shares, the padded all-gather
  and the item split give every rank every item's embeddings in order, ranks without frames
  included, with a stand-in tower that is frame-local as the real one is;
- at tp=2 x pcp=2 with ``mm_encoder_tp_mode="data"`` (vLLM's process groups, the real tower), the
  model's ``_encode_split``: each PCP rank's share sharded over its TP ranks by vLLM's balancing,
  gives every rank the whole batch's rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.dist import run_distributed
from qwen36_pcp.layers.vision_split import frame_bounds, frame_shares, sub_grids

# an image, a video, a small image, a video (grids in patches: [t, h, w])
BATCH = [[1, 16, 16], [12, 8, 12], [1, 8, 8], [6, 16, 20]]
MERGE = 4  # patches per output row (spatial merge 2 x 2)


def test_frame_bounds_balance_patches_in_order():
    weights = [h * w for t, h, w in BATCH for _ in range(t)]
    for world in (1, 2, 3, 4, 8):
        bounds = frame_bounds(BATCH, world)
        assert bounds[0] == 0 and bounds[-1] == len(weights) and all(np.diff(bounds) >= 0)
        shares = [sum(weights[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        assert max(shares) <= sum(weights) / world + max(weights), (world, shares)
    assert sub_grids(BATCH, 0, 1) == [[1, 16, 16]]
    assert sub_grids(BATCH, 3, 16) == [[10, 8, 12], [1, 8, 8], [2, 16, 20]]
    assert sorted(np.diff(frame_bounds([[1, 16, 16]], 4)).tolist()) == [0, 0, 0, 1]  # one image: one rank


@pytest.fixture(scope="module")
def tiny_ckpt_server(tmp_path_factory, fake_cuda_ranks):
    """A tiny checkpoint and the test run's fake-CUDA rank server for the tests below."""
    from qwen36_pcp.tools.make_checkpoint import make_checkpoint

    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", preset="tiny", seed=0)
    return str(ckpt), fake_cuda_ranks


def _real_tower(rank, world_size, port, ckpt: str) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer

    from tests.fake_cuda import engine_config

    cfg = engine_config(ckpt, hf_overrides={"architectures": ["Qwen3_6ForConditionalGeneration"]},
                        mm_encoder_attn_backend="TORCH_SDPA")
    vision = cfg.model_config.hf_config.vision_config
    torch.manual_seed(0)
    with set_current_vllm_config(cfg), torch.device("cpu"):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        initialize_model_parallel(1, 1, backend="gloo")
        tower = Qwen3_VisionTransformer(vision, prefix="visual")
        for p in tower.parameters():
            p.data.normal_(0, 0.05)
        process_weights_after_loading(tower, cfg.model_config, torch.device("cpu"))
    pixels = torch.randn(sum(t * h * w for t, h, w in BATCH), 3 * vision.temporal_patch_size * vision.patch_size ** 2)
    out = {}
    with set_current_vllm_config(cfg), torch.inference_mode():
        whole = tower(pixels, grid_thw=BATCH)
        for world in (2, 4, 8):
            parts = [tower(pixels[patches], grid_thw=grids) for patches, grids in frame_shares(BATCH, world) if grids]
            out[world] = (torch.cat(parts) - whole).abs().max().item()
        # mm_encoder_tp_mode="data": vLLM's sharded encoding of the frames one by one, as
        # Qwen3_6ForConditionalGeneration._encode_split hands them: the call and its output order
        # (one TP rank here; over two: test_data_parallel_encoder_at_tp2_pcp2)
        from vllm.model_executor.models.vision import run_dp_sharded_mrope_vision_model

        frames = [[1, h, w] for t, h, w in BATCH for _ in range(t)]
        dp = torch.cat(run_dp_sharded_mrope_vision_model(tower, pixels, frames, rope_type="rope_3d"))
        out["data_parallel"] = (dp - whole).abs().max().item() if dp.shape == whole.shape else float("inf")
        # a share that cuts the video's frames in the middle of a frame gives other rows
        cut = 16 * 16 + 8 * 12 + 40
        broken = torch.cat([tower(pixels[:cut], grid_thw=[[1, 16, 16], [1, 8, 12], [1, 4, 10]]),
                            tower(pixels[cut:], grid_thw=[[1, 4, 14], [10, 8, 12], [1, 8, 8], [6, 16, 20]])])
    out["broken"] = (broken - whole).abs().max().item() if broken.shape == whole.shape else float("inf")
    out["rows"], out["scale"] = whole.shape[0], whole.abs().mean().item()
    return out


def test_real_tower_encodes_frames_apart_exactly(tiny_ckpt_server):
    ckpt, server = tiny_ckpt_server
    (out,) = server.run(_real_tower, 1, ckpt)
    assert out["rows"] == sum(t * h * w for t, h, w in BATCH) // MERGE and out["scale"] > 0
    for world in (2, 4, 8):
        assert out[world] == 0.0, (world, out)
    assert out["data_parallel"] == 0.0, out
    assert out["broken"] > 1e-3 * out["scale"], out


def _data_parallel_split(rank, world_size, port, ckpt):
    """``Qwen3_6ForConditionalGeneration._encode_split`` on one rank of tp=2 x pcp=2, the tower in
    vLLM's data-parallel mode, against the whole batch through the same tower."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_pcp_group, get_tp_group, init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer

    import qwen36_pcp
    from qwen36_pcp.model.qwen3_6_vl import Qwen3_6ForConditionalGeneration
    from tests.fake_cuda import engine_config

    qwen36_pcp.register()
    cfg = engine_config(ckpt, hf_overrides={"architectures": ["Qwen3_6ForConditionalGeneration"]},
                        mm_encoder_attn_backend="TORCH_SDPA", mm_encoder_tp_mode="data",
                        tensor_parallel_size=2, prefill_context_parallel_size=2)
    vision = cfg.model_config.hf_config.vision_config
    with set_current_vllm_config(cfg), torch.device("cpu"):
        init_distributed_environment(world_size, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
        initialize_model_parallel(2, 1, prefill_context_model_parallel_size=2, backend="gloo")
        torch.manual_seed(0)  # the same weights on every rank
        tower = Qwen3_VisionTransformer(vision, prefix="visual")
        for p in tower.parameters():
            p.data.normal_(0, 0.05)
        process_weights_after_loading(tower, cfg.model_config, torch.device("cpu"))
    pixels = torch.randn(sum(t * h * w for t, h, w in BATCH), 3 * vision.temporal_patch_size * vision.patch_size ** 2,
                         generator=torch.Generator().manual_seed(1))
    model = SimpleNamespace(visual=tower, use_data_parallel=True)
    with set_current_vllm_config(cfg), torch.inference_mode():
        whole = tower(pixels, grid_thw=BATCH)
        encoded, forward = [], tower.forward  # the patches this rank's tower encodes

        def counted(x, grid_thw, **kw):
            encoded.append(int(torch.as_tensor(grid_thw).prod(-1).sum()))
            return forward(x, grid_thw=grid_thw, **kw)

        tower.forward = counted
        items = Qwen3_6ForConditionalGeneration._encode_split(model, pixels, torch.tensor(BATCH))
    full = torch.cat(items)
    share, _ = frame_shares(BATCH, 2)[get_pcp_group().rank_in_group]
    return {"tower_whole": tower.tp_size == 1,  # data-parallel: the tower whole on every TP rank
            "diff": (full - whole).abs().max().item() if full.shape == whole.shape else float("inf"),
            "items": [tuple(x.shape) for x in items], "scale": whole.abs().mean().item(),
            "pcp_rank": get_pcp_group().rank_in_group, "tp_rank": get_tp_group().rank_in_group,
            "encoded": sum(encoded), "share": share.stop - share.start}


def test_data_parallel_encoder_at_tp2_pcp2(tiny_ckpt_server):
    ckpt, server = tiny_ckpt_server
    ranks = server.run(_data_parallel_split, 4, ckpt)
    expected = [(t * h * w // MERGE, ranks[0]["items"][0][1]) for t, h, w in BATCH]
    for rank, out in enumerate(ranks):
        assert out["tower_whole"] and out["items"] == expected and out["scale"] > 0, (rank, out)
        assert out["diff"] < 1e-5 * max(out["scale"], 1.0), (rank, out)
    # each PCP rank's share went to its two TP ranks by vLLM's balancing: both encoded part of it
    for pcp_rank in (0, 1):
        pair = [r for r in ranks if r["pcp_rank"] == pcp_rank]
        assert sorted(r["tp_rank"] for r in pair) == [0, 1]
        assert sum(r["encoded"] for r in pair) == pair[0]["share"] and all(r["encoded"] > 0 for r in pair), pair


def _frame_local(pixels: torch.Tensor, grids) -> torch.Tensor:
    """Stand-in tower: each output row sums its 4 merged patches' first 3 features and adds its frame's
    mean (frame-local, like the real tower's attention), float64."""
    out, at = [], 0
    for t, h, w in grids:
        for _ in range(t):
            frame = pixels[at: at + h * w, :3]
            out.append(frame.reshape(-1, MERGE, 3).sum(1) + frame.mean(0))
            at += h * w
    return torch.cat(out)


def _split(rank, group, batch):
    from qwen36_pcp.layers.vision_split import encode_split

    pixels = torch.arange(sum(t * h * w for t, h, w in batch) * 5, dtype=torch.float64).reshape(-1, 5).sin()
    items = encode_split(_frame_local, pixels, batch, MERGE, 3, group)
    whole = _frame_local(pixels, batch).split([t * h * w // MERGE for t, h, w in batch])
    return {"equal": all(torch.equal(a, b) for a, b in zip(items, whole)), "num_items": len(items)}


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_split_encoding_gives_every_rank_every_item(world_size):
    for batch in (BATCH, [[1, 16, 16]], [[3, 8, 8], [1, 8, 8]]):  # the last two: ranks without frames
        for rank, out in enumerate(run_distributed(_split, world_size, batch)):
            assert out == {"equal": True, "num_items": len(batch)}, (world_size, batch, rank, out)
