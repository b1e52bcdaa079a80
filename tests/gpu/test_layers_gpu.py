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
