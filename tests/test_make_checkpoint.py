"""Tests for qwen36_pcp.tools.make_checkpoint (CPU only, small presets)."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
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
    H, E, I = t["hidden_size"], t["num_experts"], t["moe_intermediate_size"]
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
# every tensor is mapped to a model parameter or skipped by an explicit rule
# ---------------------------------------------------------------------------------------------

# A mapping says, for one checkpoint tensor, which (parameter, shard) slots it loads into. The
# check is two-sided: every tensor maps to >= 1 known slot or matches a skip rule, and every
# expected slot is filled exactly once. `shard` distinguishes the pieces of a stacked/fused
# parameter (q/k/v of qkv_proj, w1/w3 of expert e in w13_weight, ...).


@dataclass
class WeightMapping:
    map_name: Callable[
        [str], list[tuple[str, str]]
    ]  # tensor name -> [(param name, shard)]
    expected: set[tuple[str, str]]  # every (param name, shard) the model needs
    skip: list[tuple[str, str]] = field(default_factory=list)  # (regex, reason)


def check_mapping(tensor_names, mapping: WeightMapping) -> dict[str, list]:
    """Apply ``mapping`` to ``tensor_names``; return the problems (all lists empty = OK)."""
    skip = [(re.compile(p), why) for p, why in mapping.skip]
    unmapped, unknown, seen, dup = [], [], set(), []
    for name in tensor_names:
        if any(p.search(name) for p, _ in skip):
            continue
        targets = mapping.map_name(name)
        if not targets:
            unmapped.append(name)
        for slot in targets:
            if slot not in mapping.expected:
                unknown.append((name, slot))
            elif slot in seen:
                dup.append((name, slot))
            seen.add(slot)
    return {
        "unmapped_tensors": unmapped,
        "targets_not_in_model": unknown,
        "slots_loaded_twice": dup,
        "params_not_loaded": sorted(mapping.expected - seen),
    }


def stock_vllm_mapping(config: dict) -> WeightMapping:
    """Placeholder target: vLLM 0.20.2's own Qwen3_5(Moe)ForConditionalGeneration (+ the
    Qwen3_5(Moe)MTP draft model, under "draft."), written out from its hf_to_vllm_mapper and
    load_weights rules. Vision tensors are skipped.

    TODO(wire to qwen36_pcp.model): replace this by the mapping of the PCP model class in
    `qwen36_pcp/model/` -- `map_name` from its hf_to_vllm_mapper + load_weights stacking/expert
    rules (ideally by calling them, e.g. by running its `load_weights` over
    (name, meta tensor) pairs and recording the param/shard each lands in), `expected` from its
    `named_parameters()` (x shards), `skip` from its explicit skip rules (vision tower? mtp.*
    when no draft model is built?).
    """
    t = config["text_config"]
    moe = "num_experts" in t
    n_exp = t.get("num_experts", 0)

    def layer_slots(prefix: str, layer_type: str) -> set[tuple[str, str]]:
        s = {
            (f"{prefix}.input_layernorm.weight", ""),
            (f"{prefix}.post_attention_layernorm.weight", ""),
        }
        if layer_type == "linear_attention":
            a = f"{prefix}.linear_attn"
            s |= {
                (f"{a}.in_proj_qkvz.weight", "qkv"),
                (f"{a}.in_proj_qkvz.weight", "z"),
            }
            s |= {(f"{a}.in_proj_ba.weight", "b"), (f"{a}.in_proj_ba.weight", "a")}
            s |= {
                (f"{a}.{n}", "")
                for n in (
                    "conv1d.weight",
                    "dt_bias",
                    "A_log",
                    "norm.weight",
                    "out_proj.weight",
                )
            }
        else:
            a = f"{prefix}.self_attn"
            s |= {(f"{a}.qkv_proj.weight", x) for x in "qkv"}
            s |= {(f"{a}.{n}.weight", "") for n in ("o_proj", "q_norm", "k_norm")}
        m = f"{prefix}.mlp"
        if moe:
            s |= {(f"{m}.gate.weight", ""), (f"{m}.shared_expert_gate.weight", "")}
            s |= {(f"{m}.shared_expert.gate_up_proj.weight", x) for x in "01"}
            s |= {(f"{m}.shared_expert.down_proj.weight", "")}
            s |= {
                (f"{m}.experts.w13_weight", f"w{w}/{e}")
                for e in range(n_exp)
                for w in (1, 3)
            }
            s |= {(f"{m}.experts.w2_weight", f"w2/{e}") for e in range(n_exp)}
        else:
            s |= {(f"{m}.gate_up_proj.weight", x) for x in "01"} | {
                (f"{m}.down_proj.weight", "")
            }
        return s

    lm = "language_model.model"
    expected = {
        (f"{lm}.embed_tokens.weight", ""),
        (f"{lm}.norm.weight", ""),
        ("language_model.lm_head.weight", ""),
    }
    for i, lt in enumerate(t["layer_types"]):
        expected |= layer_slots(f"{lm}.layers.{i}", lt)
    expected |= {("draft.model.embed_tokens.weight", ""), ("draft.lm_head.weight", "")}
    expected |= {
        (f"draft.model.{n}.weight", "")
        for n in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
    }
    for j in range(t["mtp_num_hidden_layers"]):
        expected |= layer_slots(f"draft.model.layers.{j}", "full_attention")

    def layer_rule(rest: str) -> list[tuple[str, str]]:
        stacked = [
            (
                r"self_attn\.([qkv])_proj\.weight$",
                "self_attn.qkv_proj.weight",
                lambda m: m[1],
            ),
            (
                r"linear_attn\.in_proj_(qkv|z)\.weight$",
                "linear_attn.in_proj_qkvz.weight",
                lambda m: m[1],
            ),
            (
                r"linear_attn\.in_proj_([ba])\.weight$",
                "linear_attn.in_proj_ba.weight",
                lambda m: m[1],
            ),
            (
                r"mlp\.shared_expert\.(gate|up)_proj\.weight$",
                "mlp.shared_expert.gate_up_proj.weight",
                lambda m: "0" if m[1] == "gate" else "1",
            ),
            (
                r"^mlp\.(gate|up)_proj\.weight$",
                "mlp.gate_up_proj.weight",
                lambda m: "0" if m[1] == "gate" else "1",
            ),
            (
                r"mlp\.experts\.(\d+)\.(gate|up)_proj\.weight$",
                "mlp.experts.w13_weight",
                lambda m: f"w{1 if m[2] == 'gate' else 3}/{m[1]}",
            ),
            (
                r"mlp\.experts\.(\d+)\.down_proj\.weight$",
                "mlp.experts.w2_weight",
                lambda m: f"w2/{m[1]}",
            ),
        ]
        for pat, param, shard in stacked:
            m = re.search(pat, rest)
            if m:
                return [(param, shard(m))]
        if (
            rest == "mlp.experts.gate_up_proj"
        ):  # fused [E, 2I, H]: chunk(2, dim=-2) -> w1, w3
            return [
                ("mlp.experts.w13_weight", f"w{w}/{e}")
                for e in range(n_exp)
                for w in (1, 3)
            ]
        if rest == "mlp.experts.down_proj":
            return [("mlp.experts.w2_weight", f"w2/{e}") for e in range(n_exp)]
        return [(rest, "")]

    def map_name(name: str) -> list[tuple[str, str]]:
        m = re.match(r"^model\.language_model\.layers\.(\d+)\.(.*)$", name)
        if m:
            return [(f"{lm}.layers.{m[1]}.{p}", s) for p, s in layer_rule(m[2])]
        m = re.match(r"^mtp\.layers\.(\d+)\.(.*)$", name)
        if m:
            return [(f"draft.model.layers.{m[1]}.{p}", s) for p, s in layer_rule(m[2])]
        if name.startswith("mtp."):
            return [("draft.model." + name[len("mtp.") :], "")]
        if (
            name == "model.language_model.embed_tokens.weight"
        ):  # shared with the MTP draft
            return [
                (f"{lm}.embed_tokens.weight", ""),
                ("draft.model.embed_tokens.weight", ""),
            ]
        if name == "lm_head.weight":
            return [("language_model.lm_head.weight", ""), ("draft.lm_head.weight", "")]
        if name.startswith("model.language_model."):
            return [(f"{lm}." + name[len("model.language_model.") :], "")]
        return []

    return WeightMapping(
        map_name=map_name,
        expected=expected,
        skip=[
            (r"^model\.visual\.", "vision tower: not part of the text model under test")
        ],
    )


@pytest.mark.parametrize("which", ["tiny", "tiny_dense"])
def test_every_tensor_is_mapped_or_skipped(which, request):
    ckpt = request.getfixturevalue(which)
    names = list(_tensor_names_and_shapes(ckpt))
    # TODO(wire to qwen36_pcp.model): use the PCP model's mapping instead of the stock one.
    mapping = stock_vllm_mapping(_config(ckpt))
    problems = check_mapping(names, mapping)
    assert problems == {k: [] for k in problems}, {
        k: v[:5] for k, v in problems.items()
    }


def test_mapping_check_is_not_vacuous(tiny):
    names = list(_tensor_names_and_shapes(tiny))
    mapping = stock_vllm_mapping(_config(tiny))
    # a dropped tensor leaves a parameter (slot) unloaded
    dropped = [
        n for n in names if n != "model.language_model.layers.3.self_attn.k_proj.weight"
    ]
    assert check_mapping(dropped, mapping)["params_not_loaded"] == [
        ("language_model.model.layers.3.self_attn.qkv_proj.weight", "k")
    ]
    # dropping one MTP expert leaves its w1/w3/w2 slots unloaded
    dropped = [n for n in names if not n.startswith("mtp.layers.0.mlp.experts.5.")]
    assert len(check_mapping(dropped, mapping)["params_not_loaded"]) == 3
    # an unknown tensor is reported, not silently ignored
    extra = names + [
        "model.language_model.layers.0.linear_attn.bogus.weight",
        "something.else",
    ]
    problems = check_mapping(extra, mapping)
    assert problems["unmapped_tensors"] == ["something.else"]
    assert [n for n, _ in problems["targets_not_in_model"]] == [
        "model.language_model.layers.0.linear_attn.bogus.weight"
    ]


@pytest.mark.parametrize("which", ["tiny", "tiny_dense"])
def test_stock_vllm_loader_accepts_layout(which, request):
    """Run vLLM 0.20.2's own `Qwen3_5Model.load_weights` and
    `Qwen3_5MultiTokenPredictor.load_weights` (the code paths of the stock
    Qwen3_5(Moe)ForConditionalGeneration and Qwen3_5(Moe)MTP) over the checkpoint's tensors,
    against stand-in modules whose parameters (the `expected` names of `stock_vllm_mapping`)
    record every weight_loader call: every parameter must be loaded, nothing else asked for,
    and every expert of every MoE layer must receive w1, w3 and w2 -- from the fused tensors
    of the main layers as from the per-expert tensors of the MTP layer."""
    pytest.importorskip("vllm")
    import collections

    import torch
    from safetensors.torch import load_file
    from torch import nn
    from vllm.model_executor.models.qwen3_5 import Qwen3_5Model
    from vllm.model_executor.models.qwen3_5_mtp import Qwen3_5MultiTokenPredictor
    from vllm.model_executor.models.qwen3_next import Qwen3NextModel
    from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration

    ckpt = request.getfixturevalue(which)
    cfg = _config(ckpt)
    tc = cfg["text_config"]
    weights = load_file(str(ckpt / "model.safetensors"))
    mapping = stock_vllm_mapping(cfg)
    calls: dict[str, list] = collections.defaultdict(list)

    def stand_in(cls, prefix: str) -> nn.Module:
        class StandIn(nn.Module):
            load_weights = cls.load_weights
            load_fused_expert_weights = cls.load_fused_expert_weights
            get_expert_mapping = Qwen3NextModel.get_expert_mapping

        m = StandIn()
        m.config = type("TextConfig", (), dict(tc))()
        m.enable_lora = False
        m.num_redundant_experts = 0
        for full in sorted(
            {p[len(prefix) :] for p, _ in mapping.expected if p.startswith(prefix)}
        ):
            *path, leaf = full.split(".")
            mod = m
            for part in path:
                if not isinstance(getattr(mod, part, None), nn.Module):
                    mod.add_module(part, nn.Module())
                mod = getattr(mod, part)
            param = nn.Parameter(torch.empty(0), requires_grad=False)

            def loader(_param, w, *args, _name=prefix + full, **kwargs):
                kwargs.pop("return_success", None)
                calls[_name].append((args, kwargs, tuple(w.shape)))
                return True

            param.weight_loader = loader
            mod.register_parameter(leaf, param)
        return m

    # Main model: the names AutoWeightsLoader hands to Qwen3_5Model after hf_to_vllm_mapper.
    mapper = Qwen3VLForConditionalGeneration.hf_to_vllm_mapper
    lm = "language_model.model."
    main_weights = []
    for n, w in weights.items():
        mapped = mapper._map_name(n)
        if mapped and mapped.startswith(lm):
            main_weights.append((mapped[len(lm) :], w))
    stand_in(Qwen3_5Model, lm).load_weights(main_weights)
    # MTP draft: Qwen3_5MTP.load_weights renames mtp.* -> model.* and shares embed_tokens.
    mtp_weights = [
        (n[len("mtp.") :], w) for n, w in weights.items() if n.startswith("mtp.")
    ]
    mtp_weights.append(
        ("embed_tokens.weight", weights["model.language_model.embed_tokens.weight"])
    )
    stand_in(Qwen3_5MultiTokenPredictor, "draft.model.").load_weights(mtp_weights)

    expected = {
        p for p, _ in mapping.expected if not p.endswith("lm_head.weight")
    }  # ParallelLMHead elsewhere
    assert set(calls) == expected, (
        sorted(expected - set(calls))[:5],
        sorted(set(calls) - expected)[:5],
    )
    n_exp = tc.get("num_experts", 0)
    I, H = tc.get("moe_intermediate_size"), tc["hidden_size"]
    for p, c in calls.items():
        if ".experts.w" not in p:
            continue

        def shard_expert(args, kwargs):
            return (
                args[1] if len(args) > 1 else kwargs["shard_id"],
                args[2] if len(args) > 2 else kwargs["expert_id"],
            )

        got = sorted(shard_expert(a, k) for a, k, _ in c)
        want = sorted(
            (w, e)
            for e in range(n_exp)
            for w in (("w1", "w3") if "w13" in p else ("w2",))
        )
        assert got == want, p
        assert {s for _, _, s in c} == {(I, H) if "w13" in p else (H, I)}, p
