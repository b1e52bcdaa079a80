# SPDX-License-Identifier: Apache-2.0
"""``make_checkpoint --num-shards N``: exactly N files, each with at least one tensor; more shards than
tensors are refused before anything is written (CPU only, tiny presets)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwen36_pcp.tools import make_checkpoint as mc

TINY_TENSORS = 203  # tiny's bf16 tensors: language model, vision tower, MTP layer with per-expert experts
TINY_FP8_TENSORS = 652  # the same weights per expert, each FP8 weight with its block scales
TINY_DENSE_TENSORS = 145


def refusal(n: int, preset: str, tensors: int, fp8: bool = False) -> str:
    return (f"{n} weight shards asked for, but preset {preset!r}{' in fp8' if fp8 else ''} has {tensors} "
            f"tensors and a shard holds at least one: pass --num-shards {tensors} or fewer")


@pytest.mark.parametrize("preset, fp8, tensors", [
    ("tiny", False, TINY_TENSORS), ("tiny", True, TINY_FP8_TENSORS), ("tiny-dense", False, TINY_DENSE_TENSORS)])
def test_more_shards_than_tensors_is_refused_before_writing(tmp_path, preset, fp8, tensors):
    out = tmp_path / "ckpt"
    with pytest.raises(mc.BadInput) as e:
        mc.make_checkpoint(out, preset=preset, num_shards=tensors + 1, fp8=fp8)
    assert str(e.value) == refusal(tensors + 1, preset, tensors, fp8)
    assert not out.exists()


def test_an_earlier_checkpoint_keeps_its_files_when_refused(tmp_path):
    out = mc.make_checkpoint(tmp_path / "ckpt", preset="tiny", config_only=True)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    with pytest.raises(mc.BadInput):
        mc.make_checkpoint(out, preset="tiny", num_shards=1000)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before


def test_command_line_refusal(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        mc.main([str(tmp_path / "ckpt"), "--preset", "tiny", "--num-shards", "1000"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(refusal(1000, "tiny", TINY_TENSORS))


@pytest.mark.parametrize("preset, tensors", [("tiny", TINY_TENSORS), ("tiny-dense", TINY_DENSE_TENSORS)])
def test_one_shard_per_tensor(tmp_path, preset, tensors):
    """As many shards as tensors: one tensor in each file (a large tensor used to take several shards'
    shares at once, so fewer files than asked were written)."""
    out = mc.make_checkpoint(tmp_path / "ckpt", preset=preset, num_shards=tensors)
    files = sorted(f.name for f in out.glob("*.safetensors"))
    assert files == [f"model-{k:05d}-of-{tensors:05d}.safetensors" for k in range(1, tensors + 1)]
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(weight_map) == tensors
    assert sorted(weight_map.values()) == files


def test_shards_hold_every_tensor_once(tmp_path):
    from safetensors import safe_open

    out: Path = mc.make_checkpoint(tmp_path / "ckpt", preset="tiny", num_shards=7)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) == 7
    stored = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            stored.update({name: f.name for name in st.keys()})
    assert stored == weight_map
    assert len(stored) == TINY_TENSORS
