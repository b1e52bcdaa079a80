# SPDX-License-Identifier: Apache-2.0
"""FP8 on vLLM 0.20.2's real objects (CPU, fake CUDA; no FP8 kernel runs).

* The whole-experts memory estimate (``expert_memory.whole_experts_bytes``) for the Qwen3.6-35B-A3B config:
  bf16, vLLM's online ``quantization="fp8"`` (and its ``fp8_per_tensor`` / ``fp8_per_block`` schemes),
  and an FP8 checkpoint laid out like the published Qwen3.6-35B-A3B-FP8 (``make_checkpoint --fp8``,
  128x128 blocks); a method without an estimate skips the memory check with a warning.
* Which FP8 forms start at pcp=2: block-wise checkpoints and static activation scales do; online FP8
  and per-tensor dynamic activation scales are refused with the plugin's message.
* ``make_checkpoint --fp8``: its config parses with ``Fp8Config.from_config``, every FP8 weight has
  its block scales, the dequantized weights are the bf16 checkpoint's of the same seed within e4m3
  rounding, and our model, built with vLLM's ``Fp8Config`` as vLLM's loader builds it, loads every
  tensor through vLLM's own weight loaders.

Everything vLLM-side runs in one fresh process, forked from the test run's fake-CUDA server.
"""

import json
import math
from pathlib import Path

import pytest

ARCH = "Qwen3_6ForCausalLM"
OVERRIDES = {"architectures": [ARCH]}
GiB = 2**30
H100_80GB = 85_017_624_576  # what CUDA reports for an 80 GB H100 (79.2 GiB)
# Qwen3.6-35B-A3B's routed experts: 40 MoE layers x 256 experts x (w13 [2I, H] + w2 [H, I]), H=2048, I=512
EXPERT_WEIGHTS = 40 * 256 * 3 * 2048 * 512


def _vllm_side(root):
    from tests.fake_cuda import build_model, engine_config, free_port, use_fake_cuda

    use_fake_cuda()
    import logging

    import qwen36_pcp
    from qwen36_pcp.tools.make_checkpoint import make_checkpoint

    qwen36_pcp.register()
    root = Path(root)
    paths = {"big": make_checkpoint(root / "big", "qwen3.6-35b-a3b"),
             "big_fp8": make_checkpoint(root / "big_fp8", "qwen3.6-35b-a3b", fp8=True),
             "tiny": make_checkpoint(root / "tiny", "tiny", seed=0),
             "tiny_fp8": make_checkpoint(root / "tiny_fp8", "tiny", seed=0, fp8=True)}
    out = {"paths": {k: str(v) for k, v in paths.items()}}
    from qwen36_pcp.tools.make_checkpoint import main

    main([str(root / "cli"), "--preset", "tiny-dense", "--fp8", "--config-only"])
    out["cli"] = json.loads((root / "cli" / "config.json").read_text())["quantization_config"]

    # ----------------------------------------------------------------- the estimate (35B-A3B)
    from qwen36_pcp.expert_memory import experts_storage, whole_experts_bytes, whole_experts_problems

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("vllm.qwen36_pcp").addHandler(handler)

    def config(name, tp=1, pcp=2, **kw):
        return engine_config(str(paths[name]), hf_overrides=OVERRIDES, load_format="dummy",
                             prefill_context_parallel_size=pcp, tensor_parallel_size=tp, **kw)

    cases = {"bf16": ("big", {}), "fp8_online": ("big", {"quantization": "fp8"}),
             "fp8_per_tensor": ("big", {"quantization": "fp8_per_tensor"}),
             "fp8_per_block": ("big", {"quantization": "fp8_per_block"}),
             "fp8_checkpoint": ("big_fp8", {}), "experts_int8": ("big", {"quantization": "experts_int8"})}
    online = ("fp8_online", "fp8_per_tensor", "fp8_per_block")  # refused at pcp > 1: estimated at pcp=1
    out["bytes"], out["storage"] = {}, {}
    for case, (name, kw) in cases.items():
        for tp in (1, 2):
            cfg = config(name, tp, pcp=1 if case in online else 2, **kw)
            out["bytes"][f"{case}_tp{tp}"] = whole_experts_bytes(cfg, tp)
        out["storage"][case] = (experts_storage(cfg.model_config) or (None,))[0]
    out["int8_problems"], out["int8_warnings"] = whole_experts_problems(cfg), list(warnings)

    # the startup check on an 80 GB H100: bf16 experts at tp=1 do not fit, FP8 ones do
    import vllm.platforms as platforms

    type(platforms._current_platform).get_device_total_memory = classmethod(lambda cls, i=0: H100_80GB)

    from harness.dist import error_of

    out["h100"] = {case: error_of(lambda: config(name, tp, **kw)) for case, name, tp, kw in (
        ("bf16_tp1", "big", 1, {}), ("bf16_tp2", "big", 2, {}), ("fp8_checkpoint_tp1", "big_fp8", 1, {}))}
    # per-tensor FP8 experts at pcp=2: refused; block-wise and static activation scales pass
    # per-tensor FP8 checkpoints (config only: dummy weights), the quantization config where the
    # releases put it and inside text_config
    for scheme, where in (("static", None), ("dynamic", None), ("dynamic", "text_config")):
        name = f"per_tensor_{scheme}" + (f"_in_{where}" if where else "")
        paths[name] = make_checkpoint(root / name, "qwen3.6-35b-a3b")
        hf = json.loads((paths[name] / "config.json").read_text())
        (hf[where] if where else hf)["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": scheme}
        (paths[name] / "config.json").write_text(json.dumps(hf))
    online = {"fp8_online": {"quantization": "fp8"}, "fp8_per_tensor": {"quantization": "fp8_per_tensor"},
              "fp8_per_block": {"quantization": "fp8_per_block"}, "mxfp8": {"quantization": "mxfp8"},
              "online_fp8_moe": {"quantization": "online", "quantization_config": {
                  "linear_scheme_override": "int8_per_channel_weight_only", "moe_scheme_override": "fp8_per_block"}},
              "online_int8_weight_only": {"quantization": "online", "quantization_config": {
                  "global_scheme": "int8_per_channel_weight_only"}}}
    out["fp8_scales"] = {case: error_of(lambda: config(name, 1, **kw)) for case, name, kw in (
        *((case, "big", kw) for case, kw in online.items()), ("fp8_checkpoint", "big_fp8", {}),
        ("checkpoint_per_tensor_static", "per_tensor_static", {}),
        ("checkpoint_per_tensor_dynamic", "per_tensor_dynamic", {}),
        ("checkpoint_per_tensor_dynamic_in_text_config", "per_tensor_dynamic_in_text_config", {}))}

    # ------------------------------------------------------------ the tiny FP8 checkpoint in vLLM
    from vllm.model_executor.layers.quantization import fp8
    from vllm.model_executor.model_loader.utils import configure_quant_config, get_model_architecture

    quant = json.loads((paths["tiny_fp8"] / "config.json").read_text())["quantization_config"]
    parsed = fp8.Fp8Config.from_config(quant)
    out["parsed"] = {"serialized": parsed.is_checkpoint_fp8_serialized, "block": parsed.weight_block_size,
                     "activation_scheme": parsed.activation_scheme, "ignored": parsed.ignored_layers}
    cfg = engine_config(str(paths["tiny_fp8"]), prefill_context_parallel_size=2,
                        hf_overrides={**OVERRIDES, "text_config": {"max_position_embeddings": 4096}})
    out["quant_config"] = (type(cfg.quant_config).__name__, cfg.quant_config.weight_block_size)
    # CPU: no FP8 kernel to choose (they are chosen per platform); parameters and loaders stay vLLM's
    fp8.init_fp8_linear_kernel = lambda **kw: None
    fp8.select_fp8_moe_backend = lambda **kw: (None, None)
    configure_quant_config(cfg.quant_config, get_model_architecture(cfg.model_config)[0])  # initialize_model's step
    model = build_model(cfg, port=free_port())
    params = dict(model.named_parameters())
    from safetensors import safe_open

    with safe_open(str(paths["tiny_fp8"] / "model.safetensors"), "pt") as f:
        loaded = model.load_weights((n, f.get_tensor(n)) for n in f.keys())
    out["not_loaded"] = sorted(set(params) - set(loaded))
    out["dtypes"] = {n: str(p.dtype).removeprefix("torch.") for n, p in params.items()}
    out["experts_tp"] = {(m.moe_parallel_config.tp_size, m.moe_parallel_config.pcp_size)
                         for m in model.modules() if hasattr(m, "moe_parallel_config")}
    keep = ("layers.0.mlp.experts.w13_weight", "layers.0.mlp.experts.w2_weight",
            "layers.0.linear_attn.in_proj_qkvz.weight",
            "layers.3.self_attn.qkv_proj.weight", "layers.3.mlp.shared_expert.gate_up_proj.weight")
    import torch

    def plain(n):  # fp8 -> fp32 is exact; vLLM's parameter classes stay in this process
        return params[n].data.to(torch.float32).clone()

    out["loaded"] = {f"model.{k}": (plain(f"model.{k}"), plain(f"model.{k}".replace("weight", "weight_scale_inv")))
                     for k in keep}
    return out


@pytest.fixture(scope="module")
def vllm_side(tmp_path_factory, fake_cuda_ranks):
    return fake_cuda_ranks.isolated(_vllm_side, str(tmp_path_factory.mktemp("fp8")))


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def dequantize(q, scale, block=128):
    """weight ~= fp8 x scale, one scale per [block x block] tile of the last two dims."""
    s = scale.repeat_interleave(block, -2).repeat_interleave(block, -1)
    return q.float() * s[..., : q.shape[-2], : q.shape[-1]]


def assert_e4m3_close(deq, ref, scale, block=128):
    """Within e4m3 rounding: 2^-4 of the value (3 mantissa bits) plus half the subnormal step."""
    s = scale.repeat_interleave(block, -2).repeat_interleave(block, -1)[..., : ref.shape[-2], : ref.shape[-1]]
    err = (deq - ref.float()).abs()
    assert (err <= ref.float().abs() * 2**-4 + s * 2**-10 + 1e-12).all(), err.max()
    assert (err.norm() / ref.float().norm()).item() < 0.03


# --------------------------------------------------------------------------------- B: the estimate
def test_whole_experts_bytes_bf16_and_fp8_for_35b_a3b(vllm_side):
    b = vllm_side["bytes"]
    assert b["bf16_tp1"] == EXPERT_WEIGHTS * 2 == 60 * GiB and b["bf16_tp2"] == 30 * GiB
    # online fp8 (per-tensor): 1 byte per weight + at most 3 fp32 scales per expert
    per_tensor_scales = 40 * 256 * 3 * 4
    for case in ("fp8_online", "fp8_per_tensor"):
        assert b[f"{case}_tp1"] == EXPERT_WEIGHTS + per_tensor_scales, case
        assert b[f"{case}_tp2"] == EXPERT_WEIGHTS // 2 + per_tensor_scales, case
    # 128x128 blocks, per rank: w13 [2I/tp, H] -> 2 x (I/tp/128) x 16 scales, w2 [H, I/tp] -> 16 x (I/tp/128)
    for tp, blocks in ((1, 2 * 4 * 16 + 16 * 4), (2, 2 * 2 * 16 + 16 * 2)):
        want = EXPERT_WEIGHTS // tp + 40 * 256 * blocks * 4
        assert b[f"fp8_checkpoint_tp{tp}"] == b[f"fp8_per_block_tp{tp}"] == want
    assert b["fp8_checkpoint_tp1"] == 32_220_119_040 and b["fp8_checkpoint_tp2"] == 16_110_059_520
    assert vllm_side["storage"] == {"bf16": "bfloat16", "fp8_online": "fp8 (online, per-tensor scales)",
                                    "fp8_per_tensor": "fp8 (online, per-tensor scales)",
                                    "fp8_per_block": "fp8 (online, 128x128 blocks)",
                                    "fp8_checkpoint": "fp8, 128x128 blocks", "experts_int8": None}


def test_no_estimate_skips_the_memory_check_with_a_warning(vllm_side):
    assert vllm_side["bytes"]["experts_int8_tp1"] is None and vllm_side["int8_problems"] == []
    assert any("not checked at startup for quantization='experts_int8'" in w for w in vllm_side["int8_warnings"])


def test_startup_check_on_an_80gb_gpu(vllm_side):
    h100 = vllm_side["h100"]
    assert "keeps every expert on every GPU: 60 GiB, more than" in h100["bf16_tp1"], h100["bf16_tp1"]
    assert "allows (experts in bfloat16)" in h100["bf16_tp1"]
    assert h100["bf16_tp2"] is None and h100["fp8_checkpoint_tp1"] is None


def test_fp8_forms_whose_answers_change_with_pcp_are_refused(vllm_side):
    """Online FP8 (it quantizes the narrow layers a checkpoint keeps in bf16) and per-tensor dynamic
    activation scales (they span each rank's rows) are refused at pcp=2; block-wise FP8 checkpoints
    and static activation scales pass."""
    scales = vllm_side["fp8_scales"]
    online = ("fp8_online", "fp8_per_tensor", "fp8_per_block", "mxfp8", "online_fp8_moe")
    for case in online:
        assert scales[case] is not None and "online FP8 quantization" in scales[case], (case, scales)
    assert "fp8_per_block" in scales["online_fp8_moe"] and "int8" not in scales["online_fp8_moe"]
    dynamic = ("checkpoint_per_tensor_dynamic", "checkpoint_per_tensor_dynamic_in_text_config")
    for case in dynamic:
        assert "per-tensor scales and dynamic activation scales" in scales[case], (case, scales[case])
    for case in (*online, *dynamic):
        assert "use a block-wise FP8 checkpoint" in scales[case], (case, scales[case])
    for case in ("fp8_checkpoint", "checkpoint_per_tensor_static", "online_int8_weight_only"):
        assert scales[case] is None, (case, scales[case])


def test_experts_named_in_modules_to_not_convert_stay_unquantized():
    """vLLM skips a FusedMoE whose prefix is part of an ignored name naming experts (is_layer_skipped)."""
    from types import SimpleNamespace

    import torch

    from qwen36_pcp.expert_memory import whole_experts_bytes
    from qwen36_pcp.tools.make_checkpoint import PRESETS

    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
             "modules_to_not_convert": ["model.language_model.layers.1.mlp.experts", "mlp.experts"]}
    text = SimpleNamespace(**PRESETS["qwen3.6-35b-a3b"]["text"])
    cfg = SimpleNamespace(model_config=SimpleNamespace(
        quantization="fp8", hf_text_config=text, dtype=torch.bfloat16,
        hf_config=SimpleNamespace(quantization_config=quant)))
    per_layer_fp8 = 256 * (3 * 2048 * 512 + 4 * (2 * 4 * 16 + 16 * 4))
    # layer 1 (not 10-19) in bf16; the bare "mlp.experts" matches no prefix in vLLM either
    assert whole_experts_bytes(cfg) == 39 * per_layer_fp8 + 256 * 3 * 2048 * 512 * 2


# ------------------------------------------------------------------------- C: the --fp8 checkpoint
def test_fp8_config_parses_with_vllm(vllm_side):
    p = vllm_side["parsed"]
    assert p["serialized"] and p["block"] == [128, 128] and p["activation_scheme"] == "dynamic"
    ignored = set(p["ignored"])
    assert {"lm_head", "model.language_model.embed_tokens", "model.language_model.layers.0.mlp.gate",
            "model.language_model.layers.0.mlp.shared_expert_gate",
            "model.language_model.layers.0.linear_attn.in_proj_a",
            "model.language_model.layers.0.linear_attn.in_proj_b", "model.language_model.layers.0.linear_attn.conv1d",
            "mtp.fc"} <= ignored
    # outside the vision tower exactly these kinds of module stay bf16; no expert, no other projection
    assert {n.rsplit(".", 1)[-1] for n in ignored if not n.startswith("model.visual.")} == {
        "lm_head", "embed_tokens", "conv1d", "in_proj_a", "in_proj_b", "gate", "shared_expert_gate", "fc"}
    assert vllm_side["quant_config"] == ("Fp8Config", [128, 128])
    config = json.loads((Path(vllm_side["paths"]["tiny_fp8"]) / "config.json").read_text())
    assert config["quantization_config"]["fmt"] == "e4m3" and config["quantization_config"]["quant_method"] == "fp8"
    cli = vllm_side["cli"]  # --fp8 --config-only, dense: its MLP is FP8, nothing of it listed
    assert cli["weight_block_size"] == [128, 128] and not any(".mlp." in n for n in cli["modules_to_not_convert"]
                                                      if not n.startswith("model.visual."))


def test_every_fp8_weight_has_its_scales_and_dequantizes_to_the_bf16_weights(vllm_side):
    import torch

    ref, got = _tensors(vllm_side["paths"]["tiny"]), _tensors(vllm_side["paths"]["tiny_fp8"])
    fp8 = {n for n, t in got.items() if t.dtype == torch.float8_e4m3fn}
    scales = {n for n in got if n.endswith(".weight_scale_inv")}
    assert {n.removesuffix("weight_scale_inv") + "weight" for n in scales} == fp8
    # experts (main, MTP), GDN, attention (main, MTP), shared experts (main, MTP)
    assert len(fp8) == 8 * 8 * 3 + 8 * 3 + 6 * 3 + 2 * 4 + 4 + 8 * 3 + 3
    for name in sorted(fp8):
        w, s = got[name], got[name.removesuffix("weight") + "weight_scale_inv"]
        assert s.dtype == torch.float32 and s.shape == tuple(math.ceil(d / 128) for d in w.shape), name
        layer, _, rest = name.partition(".mlp.experts.")
        if rest and layer.startswith("model."):  # main layers: fused [E, 2I, H] / [E, H, I] in bf16
            e, proj = rest.split(".")[:2]
            fused = ref[f"{layer}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][int(e)]
            source = fused if proj == "down_proj" else fused.chunk(2)[proj == "up_proj"]
        else:
            source = ref[name]
        assert_e4m3_close(dequantize(w, s), source, s)
    # everything else: the bf16 checkpoint's tensors, bit for bit
    for name, t in got.items():
        if name not in fp8 and name not in scales:
            assert t.dtype == torch.bfloat16 and torch.equal(t, ref[name]), name
    assert not [n for n in got if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]  # per expert


def test_our_model_loads_the_fp8_checkpoint_through_vllms_loaders(vllm_side):
    import torch

    # everything loaded but the attention's KV-cache scales (Fp8KVCacheMethod's, optional: defaults)
    assert vllm_side["not_loaded"] and all(n.endswith(("attn.q_scale", "attn.k_scale", "attn.v_scale",
                                                        "attn.prob_scale")) for n in vllm_side["not_loaded"])
    d = vllm_side["dtypes"]
    assert d["model.layers.0.mlp.experts.w13_weight"] == "float8_e4m3fn"
    assert d["model.layers.3.self_attn.qkv_proj.weight"] == "float8_e4m3fn"
    assert d["model.layers.0.linear_attn.in_proj_ba.weight"] != "float8_e4m3fn"  # in modules_to_not_convert
    assert d["model.layers.0.mlp.gate.weight"] != "float8_e4m3fn"
    assert vllm_side["experts_tp"] == {(1, 1)}  # pcp=2, whole experts: FP8 experts on every rank whole
    ref = _tensors(vllm_side["paths"]["tiny"])
    lm = "model.language_model.layers"
    sources = {
        "model.layers.0.mlp.experts.w13_weight": ref[f"{lm}.0.mlp.experts.gate_up_proj"],
        "model.layers.0.mlp.experts.w2_weight": ref[f"{lm}.0.mlp.experts.down_proj"],
        "model.layers.0.linear_attn.in_proj_qkvz.weight": torch.cat(
            [ref[f"{lm}.0.linear_attn.in_proj_qkv.weight"], ref[f"{lm}.0.linear_attn.in_proj_z.weight"]]),
        "model.layers.3.self_attn.qkv_proj.weight": torch.cat(
            [ref[f"{lm}.3.self_attn.{p}_proj.weight"] for p in "qkv"]),
        "model.layers.3.mlp.shared_expert.gate_up_proj.weight": torch.cat(
            [ref[f"{lm}.3.mlp.shared_expert.{p}_proj.weight"] for p in ("gate", "up")]),
    }
    for name, (w, s) in vllm_side["loaded"].items():
        assert_e4m3_close(dequantize(w, s), sources[name], s)
