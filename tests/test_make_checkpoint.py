# SPDX-License-Identifier: Apache-2.0
"""Tests for qwen36_pcp.tools.make_checkpoint (CPU only, small presets)."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
import re
import sys
from pathlib import Path

import pytest

from qwen36_pcp.tools import make_checkpoint as mc

# ---------------------------------------------------------------------------------------------
# fixtures / helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return mc.make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=0)


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory) -> Path:
    return mc.make_checkpoint(
        tmp_path_factory.mktemp("tiny_dense"), preset="tiny-dense", seed=0
    )


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tensor_names_and_shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            keys = sf.keys()
            for k in keys:
                assert k not in out, f"{k} in two files"
                out[k] = tuple(sf.get_slice(k).get_shape())
    return out


def _config(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


# sha256 of the tiny preset's model.safetensors for seed 0, one file. GPU results saved elsewhere
# were computed with these exact weights: a change here must be deliberate.
TINY_SEED0_SHA256 = "cbd36f334bef4535677597890e7eb25a1de4cb2f0578cfbcfdb72d8cf927d5a4"


@contextlib.contextmanager
def torch_reference_gdn(model_cls):
    """Make transformers' Qwen3.5 modeling module use its pure-PyTorch gated-delta-rule and
    causal-conv1d paths while open: transformers binds the fla / causal_conv1d kernels at import
    time when those packages are importable, and fla's Triton kernels cannot run on a CPU."""
    mod = sys.modules[model_cls.__module__]
    names = ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
             "causal_conv1d_fn", "causal_conv1d_update"]
    saved = {n: getattr(mod, n) for n in names if hasattr(mod, n)}
    try:
        for n, fn in saved.items():
            setattr(mod, n, inspect.unwrap(fn))
        yield
    finally:
        for n, fn in saved.items():
            setattr(mod, n, fn)


# ---------------------------------------------------------------------------------------------
# config layout
# ---------------------------------------------------------------------------------------------


def test_config_layout_moe(tiny):
    cfg = _config(tiny)
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert cfg["model_type"] == "qwen3_5_moe"
    assert cfg["tie_word_embeddings"] is False
    for k in (
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
    ):
        assert isinstance(cfg[k], int)
    t = cfg["text_config"]
    assert t["model_type"] == "qwen3_5_moe_text"
    assert t["dtype"] == "bfloat16"
    assert t["num_hidden_layers"] >= 8
    assert t["full_attention_interval"] == 4
    assert t["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * (
        t["num_hidden_layers"] // 4
    )
    assert t["attn_output_gate"] is True
    assert t["mtp_num_hidden_layers"] == 1
    assert t["max_position_embeddings"] == 262144
    assert t["rope_parameters"] == {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
    }
    assert t["linear_key_head_dim"] == t["linear_value_head_dim"] == 128
    assert t["head_dim"] == 256
    assert t["linear_num_value_heads"] == 2 * t["linear_num_key_heads"]
    # TP / CP up to 4: every head count vLLM shards must divide by 4 (KV heads are replicated).
    for k in ("num_attention_heads", "linear_num_key_heads", "linear_num_value_heads"):
        assert t[k] % 4 == 0, k
    assert t["num_key_value_heads"] % 2 == 0
    assert cfg["vision_config"]["num_heads"] % 4 == 0
    for k in (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
    ):
        assert t[k] > 0, k
    assert "intermediate_size" not in t
    assert isinstance(t["eos_token_id"], int) and t["eos_token_id"] < t["vocab_size"]
    v = cfg["vision_config"]
    assert v["model_type"] == "qwen3_5_moe_vision"
    assert v["depth"] in (1, 2)
    assert v["out_hidden_size"] == t["hidden_size"]
    assert math.isqrt(v["num_position_embeddings"]) ** 2 == v["num_position_embeddings"]
    # special ids are real tokens of the tokenizer
    tok = json.loads((tiny / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    assert vocab["<|image_pad|>"] == cfg["image_token_id"]
    assert vocab["<|video_pad|>"] == cfg["video_token_id"]
    assert vocab["<|vision_start|>"] == cfg["vision_start_token_id"]
    assert vocab["<|vision_end|>"] == cfg["vision_end_token_id"]
    assert vocab["<|endoftext|>"] == t["eos_token_id"]
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [vocab["<|im_end|>"], vocab["<|endoftext|>"]]


def test_config_layout_dense(tiny_dense):
    cfg = _config(tiny_dense)
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert cfg["model_type"] == "qwen3_5"
    t = cfg["text_config"]
    assert t["model_type"] == "qwen3_5_text"
    assert t["intermediate_size"] > 0
    for k in (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
    ):
        assert k not in t
    assert cfg["vision_config"]["model_type"] == "qwen3_5_vision"
    names = _tensor_names_and_shapes(tiny_dense)
    assert not any(".experts." in n or "shared_expert" in n for n in names)
    assert "model.language_model.layers.0.mlp.gate_proj.weight" in names
    assert "mtp.layers.0.mlp.down_proj.weight" in names
    # 4 MTP top-level tensors + one full-attention layer with a dense MLP (as in the published
    # Qwen3.6-27B checkpoints: 15 mtp.* tensors)
    assert sum(n.startswith("mtp.") for n in names) == 15


# ---------------------------------------------------------------------------------------------
# transformers can load it
# ---------------------------------------------------------------------------------------------


def test_transformers_loads_config_and_tokenizer(tiny):
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny)
    assert type(cfg).__name__ == "Qwen3_5MoeConfig"
    assert cfg.text_config.layer_types[3] == "full_attention"
    assert cfg.text_config.vocab_size == 8192

    tok = AutoTokenizer.from_pretrained(tiny)
    assert len(tok) == cfg.text_config.vocab_size  # every id decodes
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    raw = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    for text in [
        "Hello world! The quick brown fox jumps over the lazy dog.",
        "  spaces   and\n\nnewlines\ttabs, numbers 12345 and I'll we've",
        "ünïcödé 中文 🙂 — arbitrary bytes go through the byte-level fallback",
    ]:
        ids = tok(text).input_ids
        assert (
            ids == raw.encode(text).ids
        )  # transformers' class and tokenizer.json agree
        assert all(0 <= i < cfg.text_config.vocab_size for i in ids)
        assert tok.decode(ids) == text
    # a never-trained id still decodes to something
    assert tok.decode([cfg.text_config.vocab_size - 1]).strip()

    msgs = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi there"},
    ]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_gen = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert no_gen.endswith("Hi there<|im_end|>\n")
    no_think = tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "look: "}, {"type": "image"}],
        }
    ]
    assert (
        "look: <|vision_start|><|image_pad|><|vision_end|><|im_end|>"
        in tok.apply_chat_template(parts, tokenize=False)
    )
    ids = tok(rendered).input_ids
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == rendered


def test_transformers_loads_weights_and_logits_are_peaked(tiny):
    """Every tensor of the HF model is in the file (fused expert layout included), nothing but
    mtp.* is left over, and the fp32 forward gives finite, peaked logits."""
    import torch
    from transformers import AutoTokenizer, Qwen3_5MoeForConditionalGeneration

    model, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(
        tiny, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"], info["missing_keys"]
    assert not info.get("mismatched_keys"), info.get("mismatched_keys")
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"]), info[
        "unexpected_keys"
    ]
    tok = AutoTokenizer.from_pretrained(tiny)
    ids = tok("The weather today is sunny", return_tensors="pt").input_ids
    with torch.no_grad(), torch_reference_gdn(Qwen3_5MoeForConditionalGeneration):
        out = model.eval()(input_ids=ids, output_hidden_states=True)
    logits = out.logits[0]
    assert torch.isfinite(logits).all()
    for h in out.hidden_states[
        :-1
    ]:  # residual stream stays O(1) (no blow-up through the layers)
        assert float(h.float().pow(2).mean().sqrt()) < 5.0
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert float(gaps.median()) > 0.5, gaps  # deterministic (seed 0)


# ---------------------------------------------------------------------------------------------
# determinism
# ---------------------------------------------------------------------------------------------


def test_tiny_weights_are_pinned(tiny):
    assert _sha(tiny / "model.safetensors") == TINY_SEED0_SHA256


def test_same_seed_same_bytes_different_seed_differs(tiny, tmp_path):
    again = mc.make_checkpoint(tmp_path / "again", preset="tiny", seed=0)
    other = mc.make_checkpoint(tmp_path / "other", preset="tiny", seed=1)
    for name in (
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert _sha(tiny / name) == _sha(again / name), name
    assert _sha(tiny / "model.safetensors") != _sha(other / "model.safetensors")

    from safetensors.torch import load_file

    a, b = (
        load_file(str(tiny / "model.safetensors")),
        load_file(str(other / "model.safetensors")),
    )
    assert a.keys() == b.keys()
    for k in (
        "lm_head.weight",
        "model.language_model.layers.0.linear_attn.A_log",
        "mtp.fc.weight",
    ):
        assert not a[k].equal(b[k]), k


def test_sharded_output_matches_single_file(tiny, tmp_path):
    from safetensors.torch import load_file

    sharded = mc.make_checkpoint(
        tmp_path / "sharded", preset="tiny", seed=0, num_shards=3
    )
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert set(index["weight_map"].values()) == set(files)
    single = load_file(str(tiny / "model.safetensors"))
    merged = {}
    for f in files:
        part = load_file(str(sharded / f))
        assert all(index["weight_map"][k] == f for k in part)
        merged.update(part)
    assert merged.keys() == single.keys()
    assert all(merged[k].equal(single[k]) for k in single)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in single.values()
    )


# ---------------------------------------------------------------------------------------------
# tensor layout
# ---------------------------------------------------------------------------------------------


def test_tensor_layout_moe(tiny):
    from safetensors import safe_open

    cfg = _config(tiny)
    t = cfg["text_config"]
    names = _tensor_names_and_shapes(tiny)
    H, E, I = t["hidden_size"], t["num_experts"], t["moe_intermediate_size"]  # noqa: E741 (the shapes' names)
    L = "model.language_model.layers"
    # main layers: fused experts, [E, 2I, H] and [E, H, I], no ".weight"
    for i in range(t["num_hidden_layers"]):
        assert names[f"{L}.{i}.mlp.experts.gate_up_proj"] == (E, 2 * I, H)
        assert names[f"{L}.{i}.mlp.experts.down_proj"] == (E, H, I)
        assert not any(n.startswith(f"{L}.{i}.mlp.experts.0.") for n in names)
        kind = (
            "linear_attn" if t["layer_types"][i] == "linear_attention" else "self_attn"
        )
        other = "self_attn" if kind == "linear_attn" else "linear_attn"
        assert any(n.startswith(f"{L}.{i}.{kind}.") for n in names)
        assert not any(n.startswith(f"{L}.{i}.{other}.") for n in names)
    gdn = f"{L}.0.linear_attn"
    kd = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    vd = t["linear_num_value_heads"] * t["linear_value_head_dim"]
    assert names[f"{gdn}.in_proj_qkv.weight"] == (2 * kd + vd, H)
    assert names[f"{gdn}.in_proj_z.weight"] == (vd, H)
    assert (
        names[f"{gdn}.in_proj_b.weight"]
        == names[f"{gdn}.in_proj_a.weight"]
        == (t["linear_num_value_heads"], H)
    )
    assert names[f"{gdn}.conv1d.weight"] == (
        2 * kd + vd,
        1,
        t["linear_conv_kernel_dim"],
    )
    assert (
        names[f"{gdn}.dt_bias"]
        == names[f"{gdn}.A_log"]
        == (t["linear_num_value_heads"],)
    )
    assert names[f"{gdn}.norm.weight"] == (t["linear_value_head_dim"],)
    attn = f"{L}.3.self_attn"
    assert names[f"{attn}.q_proj.weight"] == (
        2 * t["num_attention_heads"] * t["head_dim"],
        H,
    )  # + output gate
    assert names[f"{attn}.k_proj.weight"] == (
        t["num_key_value_heads"] * t["head_dim"],
        H,
    )
    assert names[f"{attn}.q_norm.weight"] == (t["head_dim"],)
    # MTP: the four top-level tensors + one full-attention layer with per-expert experts
    for n in (
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.norm.weight",
    ):
        assert names[n] == (H,)
    assert names["mtp.fc.weight"] == (H, 2 * H)
    for e in range(E):
        assert names[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] == (I, H)
        assert names[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] == (I, H)
        assert names[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] == (H, I)
    assert "mtp.layers.0.self_attn.q_proj.weight" in names
    assert not any(n.startswith("mtp.layers.0.linear_attn") for n in names)
    assert not any(
        n.startswith(("mtp.embed_tokens", "mtp.lm_head", "mtp.layers.1")) for n in names
    )
    assert (
        "lm_head.weight" in names
        and "model.language_model.embed_tokens.weight" in names
    )
    assert any(n.startswith("model.visual.blocks.0.") for n in names)

    with safe_open(str(tiny / "model.safetensors"), "pt") as sf:
        keys = sf.keys()
        assert {sf.get_slice(k).get_dtype() for k in keys} == {"BF16"}

        def g(k):
            return sf.get_tensor(k).float()

        # (1 + w) norms near 0, plain norms near 1
        assert abs(float(g(f"{L}.0.input_layernorm.weight").mean())) < 0.05
        assert abs(float(g("model.language_model.norm.weight").mean())) < 0.05
        assert abs(float(g(f"{gdn}.norm.weight").mean()) - 1) < 0.05
        a = g(f"{gdn}.A_log").exp()
        assert float(a.min()) >= 1.0 - 1e-2 and float(a.max()) <= 16.0 + 1e-1
        dt = g(f"{gdn}.dt_bias")
        assert float(dt.max()) < 0  # softplus(dt_bias) in [1e-3, 1e-1]
        lm = g("lm_head.weight").std()
        emb = g("model.language_model.embed_tokens.weight").std()
        assert 20 < float(lm / emb) < 40  # lm_head scaled up (LM_HEAD_SCALE = 30)


def test_config_only_full_size_preset(tmp_path):
    out = mc.make_checkpoint(tmp_path / "big", preset="qwen3.6-35b-a3b")
    assert not list(out.glob("*.safetensors"))
    cfg = _config(out)
    t = cfg["text_config"]
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    expect = {
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "vocab_size": 248320,
    }
    assert {k: t[k] for k in expect} == expect
    # the real ids
    assert (cfg["image_token_id"], cfg["video_token_id"]) == (248056, 248057)
    assert (cfg["vision_start_token_id"], cfg["vision_end_token_id"]) == (
        248053,
        248054,
    )
    assert t["eos_token_id"] == 248044
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    assert (vocab["<|endoftext|>"], vocab["<|im_start|>"], vocab["<|im_end|>"]) == (
        248044,
        248045,
        248046,
    )
    assert len(vocab) == 248320
    # The real Qwen3.5/3.6-35B-A3B checkpoint holds 1811 tensors (fused experts in the 40 main
    # layers, 256 per-expert triples in the MTP layer, a 27-block vision tower).
    specs = mc.tensor_specs(cfg)
    assert len(specs) == 1811
    assert 35.0e9 < sum(math.prod(s) for s in specs.values()) < 36.5e9


def test_full_size_weights_are_refused(tmp_path):
    with pytest.raises(mc.BadInput, match="load_format='dummy'"):
        mc.make_checkpoint(tmp_path / "big", preset="qwen3.6-27b", config_only=False)
    assert not (tmp_path / "big").exists()  # refused before anything is written


def test_cli(tmp_path, capsys):
    rc = mc.main(
        [str(tmp_path / "cli"), "--preset", "tiny", "--seed", "3", "--config-only"]
    )
    assert rc == 0
    assert (tmp_path / "cli" / "config.json").exists()
    assert (tmp_path / "cli" / "tokenizer.json").exists()
    assert not list((tmp_path / "cli").glob("*.safetensors"))
    assert "wrote" in capsys.readouterr().out


def test_existing_checkpoint_is_overwritten_and_loses_stale_weights(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"stale")
    (out / "model.safetensors.index.json").write_text("{}")
    mc.make_checkpoint(out, preset="tiny", config_only=True)
    assert _config(out)["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert not list(out.glob("model.safetensors*"))


def test_force_writes_into_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    mc.make_checkpoint(tmp_path, preset="tiny-dense", config_only=True, force=True)
    assert (tmp_path / "config.json").exists() and (tmp_path / "notes.txt").read_text() == "mine"


def _foreign_dir(tmp_path: Path) -> str:
    (tmp_path / "notes.txt").write_text("mine")
    return str(tmp_path)


def _a_file(tmp_path: Path) -> str:
    (tmp_path / "f").write_text("x")
    return str(tmp_path / "f")


def _under_a_file(tmp_path: Path) -> str:
    return str(Path(_a_file(tmp_path)) / "ckpt")


@pytest.mark.parametrize(
    "make_out, args, message",
    [
        (_a_file, [], "exists and is not a directory"),
        (_under_a_file, [], "cannot write"),
        (_foreign_dir, [], "is not empty and holds no config.json; pass --force"),
        (None, ["--num-shards", "0"], "number of shards must be an integer >= 1, got 0"),
        (None, ["--preset", "tiny-moe"], "argument --preset: invalid choice"),
        (None, ["--seed", "-1"], "seed must be an integer >= 0, got -1"),
        (None, ["--seed", "x"], "argument --seed: invalid int value: 'x'"),
        (None, ["--preset", "qwen3.6-35b-a3b", "--num-shards", "2"],
         "2 weight shards asked for, but preset 'qwen3.6-35b-a3b' is config-only"),
        (None, ["--config-only", "--num-shards", "2"], "config_only is set: no weights are written"),
    ],
)
def test_cli_bad_input_is_one_usage_error(tmp_path, capsys, make_out, args, message):
    out = make_out(tmp_path) if make_out else str(tmp_path / "new")
    before = sorted(tmp_path.iterdir())
    with pytest.raises(SystemExit) as exc:
        mc.main([out, *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert message in last and err.count("error:") == 1 and "Traceback" not in err, err
    assert sorted(tmp_path.iterdir()) == before  # nothing written


@pytest.mark.parametrize(
    "kwargs, message",
    [({"preset": "nope"}, "unknown preset 'nope'"), ({"seed": -3}, "seed must be"),
     ({"num_shards": 0}, "number of shards")],
)
def test_api_bad_input(tmp_path, kwargs, message):
    with pytest.raises(mc.BadInput, match=re.escape(message)):
        mc.make_checkpoint(tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


def test_help_names_every_option_and_its_default(capsys):
    with pytest.raises(SystemExit) as exc:
        mc.main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for option, default in [("--preset", "tiny"), ("--seed", "0"), ("--num-shards", "1"),
                            ("--config-only", "False"), ("--force", "False")]:
        assert re.search(re.escape(option) + r".*?\(default: " + re.escape(default) + r"\)", text), option
    assert "load_format='dummy'" in text


# ---------------------------------------------------------------------------------------------
# vLLM's own models of the published architecture load every tensor
# ---------------------------------------------------------------------------------------------


def _vllm_loads(ckpt: str, drop: str | None, extra: str | None) -> dict:
    """vLLM 0.20.2's own model of the checkpoint's architecture (config.json: the vision-language
    Qwen3.5 class, vision tower included) and its MTP draft model (``speculative_config`` method
    "mtp"), built on the CPU and loaded from the checkpoint by vLLM's own loaders.

    Every parameter starts as NaN, so an element no tensor was loaded into stays NaN; every weight
    loader call is recorded by the storage of the tensor it was handed, so a checkpoint tensor that
    never reached a parameter is seen (vLLM's Qwen3.5 loaders pass over names they do not know).
    ``drop``: a tensor left out; ``extra``: a tensor added under that name."""
    import copy

    from tests.fake_cuda import build_model, engine_config, free_port, use_fake_cuda

    use_fake_cuda()  # before vLLM's modules bind the platform
    import torch
    from safetensors import safe_open
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    cfg = engine_config(ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with safe_open(f"{ckpt}/model.safetensors", "pt") as f:
        weights = {n: f.get_tensor(n) for n in f.keys() if n != drop}
    if extra is not None:
        weights[extra] = torch.ones(3)
    storage_of = {t.untyped_storage().data_ptr(): n for n, t in weights.items()}
    target = build_model(cfg, port=free_port())
    draft_cfg = copy.copy(cfg)
    draft_cfg.model_config = cfg.speculative_config.draft_model_config
    draft_cls, _ = get_model_architecture(draft_cfg.model_config)
    with set_current_vllm_config(draft_cfg):
        draft = draft_cls(vllm_config=draft_cfg, prefix="")
    out = {"arch": cfg.model_config.architecture, "draft_arch": draft_cls.__name__}
    consumed = set()
    for name, model in (("target", target), ("draft", draft)):
        for param in model.parameters():
            param.data.fill_(float("nan"))
            loader = getattr(param, "weight_loader", default_weight_loader)

            def recording(p, w, *args, _loader=loader, **kwargs):
                consumed.add(storage_of.get(w.untyped_storage().data_ptr()))
                return _loader(p, w, *args, **kwargs)

            param.weight_loader = recording
        with set_current_vllm_config(cfg if name == "target" else draft_cfg):
            model.load_weights(iter(weights.items()))
        out[name] = {"params": sum(1 for _ in model.parameters()),
                     "not_loaded": sorted(n for n, p in model.named_parameters() if p.isnan().any()),
                     "visual": sum(n.startswith("visual.") for n, _ in model.named_parameters())}
    out["not_consumed"] = sorted(set(weights) - consumed)
    return out


def _vllm_loads_cases(tiny: str, tiny_dense: str) -> dict:
    """Every case in one fresh process (forked from the test run's fake-CUDA server)."""
    return {"tiny": _vllm_loads(tiny, None, None), "tiny_dense": _vllm_loads(tiny_dense, None, None),
            "dropped_and_foreign": _vllm_loads(tiny, "model.language_model.layers.3.self_attn.k_proj.weight",
                                               "model.language_model.layers.0.linear_attn.bogus.weight")}


@pytest.fixture(scope="module")
def vllm_loads(tiny, tiny_dense, fake_cuda_ranks) -> dict:
    return fake_cuda_ranks.isolated(_vllm_loads_cases, str(tiny), str(tiny_dense))


@pytest.mark.parametrize("which", ["tiny", "tiny_dense"])
def test_vllms_own_models_load_every_tensor(which, request, vllm_loads):
    """Every element of every parameter of vLLM's vision-language model and of its MTP head comes
    from the checkpoint, and every checkpoint tensor goes into one of them."""
    out = vllm_loads[which]
    assert out["arch"] == _config(request.getfixturevalue(which))["architectures"][0]
    assert out["draft_arch"] in ("Qwen3_5MoeMTP", "Qwen3_5MTP")
    for name in ("target", "draft"):
        assert out[name]["not_loaded"] == [], (name, out[name]["not_loaded"][:5])
    assert out["not_consumed"] == [], out["not_consumed"][:5]
    assert out["target"]["visual"] > 0 and out["draft"]["params"] > 0


def test_a_missing_or_foreign_tensor_is_seen(vllm_loads):
    """Negative control: a tensor left out leaves part of its parameter unloaded (one shard of the
    fused qkv projection), and a tensor no model knows is not consumed."""
    out = vllm_loads["dropped_and_foreign"]
    assert out["target"]["not_loaded"] == ["language_model.model.layers.3.self_attn.qkv_proj.weight"], out
    assert out["not_consumed"] == ["model.language_model.layers.0.linear_attn.bogus.weight"], out
