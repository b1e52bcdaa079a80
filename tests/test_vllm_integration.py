# SPDX-License-Identifier: Apache-2.0
"""The plugin against vLLM 0.20.2's real classes on the CPU: registration, config resolution, startup
checks, the replicated-KV guards (lifted only for our model at pcp > 1), weight mapping, and the plan
the runner hook builds from a step's inputs."""

import json
from types import SimpleNamespace

import pytest

ARCH = "Qwen3_6ForCausalLM"
VL_ARCH = "Qwen3_6ForConditionalGeneration"
OVERRIDES = {"architectures": [ARCH]}


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from qwen36_pcp.tools.make_checkpoint import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", preset="tiny", seed=0))


# ---------------------------------------------------------------------------- config checks
def _configs(ckpt):
    from tests.fake_cuda import engine_config, use_fake_cuda

    use_fake_cuda()
    from vllm import ModelRegistry

    import qwen36_pcp

    qwen36_pcp.register()
    qwen36_pcp.register()  # idempotent
    out = {"registered": ARCH in ModelRegistry.get_supported_archs()}
    import vllm.model_executor.models.registry as registry

    subprocesses = []
    orig_run_in_subprocess = registry._run_in_subprocess
    registry._run_in_subprocess = lambda fn: subprocesses.append(fn) or orig_run_in_subprocess(fn)
    cfg = engine_config(ckpt, hf_overrides=OVERRIDES, prefill_context_parallel_size=2)
    out["inspect_subprocesses"] = len(subprocesses)
    out["arch"] = cfg.model_config.architecture
    out["is_hybrid"] = cfg.model_config.is_hybrid
    out["world_size"] = cfg.parallel_config.world_size
    out["mamba_ssm_dtype"] = str(cfg.cache_config.mamba_ssm_cache_dtype)
    from vllm.model_executor.model_loader.utils import get_model_architecture

    out["model_cls"] = get_model_architecture(cfg.model_config)[0].__name__
    out["gdn_backend"] = cfg.additional_config.get("gdn_prefill_backend")
    out["worker_cls"] = cfg.parallel_config.worker_cls
    from qwen36_pcp import patches

    out["serves_pcp"] = patches.serves_pcp()
    pcp1 = engine_config(ckpt, hf_overrides=OVERRIDES)
    out["gdn_backend_pcp1"] = pcp1.additional_config.get("gdn_prefill_backend")
    out["worker_cls_pcp1"] = pcp1.parallel_config.worker_cls
    bad = {
        "dcp": dict(decode_context_parallel_size=2, tensor_parallel_size=2),
        "attention_backend": dict(attention_backend="TRITON_ATTN"),
        "fp8_kv": dict(kv_cache_dtype="fp8"),
        "unknown_option": dict(additional_config={"qwen36_pcp": {"layuot": "zigzag"}}),
        "bad_layout": dict(additional_config={"qwen36_pcp": {"layout": "ring"}}),
        "bad_moe_experts": dict(additional_config={"qwen36_pcp": {"moe_experts": "mirrored"}}),
        "ep_whole_experts": dict(enable_expert_parallel=True),
        "flashinfer_gdn": dict(gdn_prefill_backend="flashinfer"),
        "spec_decode": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                "prompt_lookup_max": 3, "prompt_lookup_min": 1}),
        "mtp_draft_tp": dict(tensor_parallel_size=2, speculative_config={
            "method": "mtp", "num_speculative_tokens": 1, "draft_tensor_parallel_size": 1}),
        "mtp_interleave": dict(cp_kv_cache_interleave_size=16, speculative_config={
            "method": "mtp", "num_speculative_tokens": 1}),
        "non_hybrid": dict(hf_overrides={**OVERRIDES, "text_config": {
            "layer_types": ["full_attention"] * 8}}),
        "spread_mtp_prefix_caching": dict(additional_config={"qwen36_pcp": {"decode": "spread"}},
                                          enable_prefix_caching=True, speculative_config={
                                              "method": "mtp", "num_speculative_tokens": 1}),
        "spread_sharded_experts": dict(additional_config={"qwen36_pcp": {"decode": "spread",
                                                                          "moe_experts": "sharded"}}),
        "lora": dict(enable_lora=True),
        "ec_connector": dict(ec_transfer_config={"ec_connector": "ECExampleConnector", "ec_role": "ec_both"}),
        "kv_connector": dict(kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"}),
        "pooling": dict(runner="pooling", convert="embed"),
    }

    def error_of(**kw):
        """The message a pcp=2 config with these settings is refused with, or None."""
        try:
            engine_config(ckpt, **{"hf_overrides": OVERRIDES, "prefill_context_parallel_size": 2, **kw})
        except Exception as e:  # noqa: BLE001 - we want the message
            return f"{type(e).__name__}: {e}"
        return None

    out["errors"] = {name: error_of(**kw) for name, kw in bad.items()}
    # the same options are fine at pcp == 1 (nothing of ours applies)
    engine_config(ckpt, hf_overrides=OVERRIDES, attention_backend="TRITON_ATTN")
    # decode="spread" with prefix caching: vLLM's GDN states block by block (state_blocks)
    out["spread_prefix_caching"] = engine_config(
        ckpt, hf_overrides=OVERRIDES, prefill_context_parallel_size=2, enable_prefix_caching=True,
        additional_config={"qwen36_pcp": {"decode": "spread"}}).cache_config.mamba_cache_mode
    # decode="spread" with MTP, prefix caching off: GDN states of the drafts in the blocks vLLM gives them
    out["spread_mtp"] = engine_config(
        ckpt, hf_overrides=OVERRIDES, prefill_context_parallel_size=2, enable_prefix_caching=False,
        additional_config={"qwen36_pcp": {"decode": "spread"}},
        speculative_config={"method": "mtp", "num_speculative_tokens": 3}).cache_config.mamba_cache_mode
    # the checkpoint's own MTP head is served at pcp > 1 (vLLM's Qwen3.5 MTP drafter)
    mtp = engine_config(ckpt, hf_overrides=OVERRIDES, prefill_context_parallel_size=2,
                        speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    out["mtp"] = (mtp.speculative_config.method, mtp.speculative_config.draft_model_config.architecture,
                  mtp.parallel_config.worker_cls)
    # the vision-language class: the same PCP config handling, vLLM's multimodal config
    vl = engine_config(ckpt, hf_overrides={"architectures": [VL_ARCH]}, prefill_context_parallel_size=2)
    out["vl"] = (get_model_architecture(vl.model_config)[0].__name__, vl.parallel_config.worker_cls,
                 vl.model_config.is_multimodal_model, vl.additional_config.get("gdn_prefill_backend"))
    out["errors"]["vl_lora"] = error_of(hf_overrides={"architectures": [VL_ARCH]}, enable_lora=True)
    from qwen36_pcp.expert_memory import whole_experts_bytes

    out["mtp_experts_ratio"] = whole_experts_bytes(mtp) / whole_experts_bytes(cfg)
    # whole experts (12 MiB here) must fit the GPU: a 16 MiB one is too small, sharded is fine
    import vllm.platforms as platforms

    type(platforms._current_platform).get_device_total_memory = classmethod(lambda cls, i=0: 16 * 2**20)
    out["errors"]["small_gpu"] = error_of()
    engine_config(ckpt, hf_overrides=OVERRIDES, prefill_context_parallel_size=2,
                  additional_config={"qwen36_pcp": {"moe_experts": "sharded"}})
    # one visible GPU for two ranks: refused with the numbers; a custom worker class places its ranks
    type(platforms._current_platform).get_device_total_memory = classmethod(lambda cls, i=0: 2**40)
    type(platforms._current_platform).device_count = classmethod(lambda cls: 1)
    out["errors"]["one_gpu"] = error_of()
    shared = engine_config(ckpt, hf_overrides=OVERRIDES, prefill_context_parallel_size=2,
                           worker_cls="harness.shared_gpu.SharedGPUWorker")
    out["shared_worker"] = shared.parallel_config.worker_cls
    out["errors"]["own_worker"] = error_of(worker_cls="vllm.v1.worker.gpu_worker.Worker")
    engine_config(ckpt, hf_overrides=OVERRIDES, enable_lora=True)  # pcp=1: vLLM's own LoRA
    # the first token's detokenization follows the engine configs of ours at pcp > 1 that are alive
    import gc

    from qwen36_pcp import patches

    del cfg, shared, mtp, vl
    gc.collect()
    out["serves_pcp_after"] = patches.serves_pcp()
    return out


def test_config_resolution_and_startup_errors(tiny_ckpt, fake_cuda_ranks):
    out = fake_cuda_ranks.isolated(_configs, tiny_ckpt)
    assert out["registered"] and out["arch"] == ARCH and out["model_cls"] == ARCH
    assert out["inspect_subprocesses"] == 0  # resolving the architecture costs no Python subprocess
    assert out["is_hybrid"] and out["world_size"] == 2 and out["mamba_ssm_dtype"] == "float32"
    for name, msg in out["errors"].items():
        assert msg is not None, f"{name} was accepted"
        assert "qwen36_pcp" in msg, (name, msg)
    assert "decode context parallel" in out["errors"]["dcp"]
    assert "TRITON_ATTN" in out["errors"]["attention_backend"]
    assert "speculative decoding method 'ngram'" in out["errors"]["spec_decode"], out["errors"]["spec_decode"]
    assert "draft_tensor_parallel_size=1" in out["errors"]["mtp_draft_tp"], out["errors"]["mtp_draft_tp"]
    assert "cp_kv_cache_interleave_size" in out["errors"]["mtp_interleave"], out["errors"]["mtp_interleave"]
    assert out["mtp"] == ("mtp", "Qwen3_5MoeMTP", "qwen36_pcp.worker.PCPWorker")
    assert out["mtp_experts_ratio"] == pytest.approx(9 / 8)  # the drafter's layer beside 8 MoE layers
    assert "decode='spread' together with speculative decoding and prefix caching" in \
        out["errors"]["spread_mtp_prefix_caching"]
    assert out["spread_mtp"] == "none"
    assert out["spread_prefix_caching"] == "align"
    assert "moe_experts='sharded'" in out["errors"]["spread_sharded_experts"]
    assert "non-hybrid" in out["errors"]["non_hybrid"]
    assert "ec_transfer_config" in out["errors"]["ec_connector"], out["errors"]["ec_connector"]
    assert "layuot" in out["errors"]["unknown_option"]
    assert "quantized KV cache (kv_cache_dtype=fp8" in out["errors"]["fp8_kv"]
    assert "layout must be one of" in out["errors"]["bad_layout"]
    assert "mirrored" in out["errors"]["bad_moe_experts"]
    assert "'flashinfer'" in out["errors"]["flashinfer_gdn"]
    assert out["gdn_backend"] == "triton" and out["gdn_backend_pcp1"] is None  # pcp=1: vLLM's auto
    # the PCP worker at pcp > 1 (vLLM's worker_cls), vLLM's own at pcp == 1; one's own must build on it
    assert out["worker_cls"] == "qwen36_pcp.worker.PCPWorker"
    assert out["worker_cls_pcp1"] == "auto"  # left to vLLM's platform (its GPU Worker)
    assert out["shared_worker"] == "harness.shared_gpu.SharedGPUWorker"
    assert "not built on qwen36_pcp.worker.PCPWorker" in out["errors"]["own_worker"], out["errors"]["own_worker"]
    assert out["serves_pcp"] and not out["serves_pcp_after"]
    assert "enable_expert_parallel" in out["errors"]["ep_whole_experts"]
    assert "keeps every expert on every GPU" in out["errors"]["small_gpu"], out["errors"]["small_gpu"]
    assert "'moe_experts': 'sharded'" in out["errors"]["small_gpu"]
    assert "LoRA" in out["errors"]["lora"]
    assert out["vl"] == (VL_ARCH, "qwen36_pcp.worker.PCPWorker", True, "triton")
    assert f"with {VL_ARCH} does not support: LoRA" in out["errors"]["vl_lora"], out["errors"]["vl_lora"]
    assert "kv_transfer_config" in out["errors"]["kv_connector"]
    assert "'pooling' runner" in out["errors"]["pooling"]
    assert "1 visible GPU(s)" in out["errors"]["one_gpu"] and "= 2 ranks" in out["errors"]["one_gpu"]


# ------------------------------------------------------------------------------- KV guards
def _kv_guards(ckpt):
    from tests.fake_cuda import engine_config, use_fake_cuda

    use_fake_cuda()
    import torch

    import qwen36_pcp

    qwen36_pcp.register()
    import vllm.v1.engine.core as core
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    def kv_config(cfg):
        bs = cfg.cache_config.block_size
        attn = FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=256, dtype=torch.bfloat16)
        mamba = MambaSpec(block_size=bs, shapes=((3, 1536), (8, 128, 128)),
                          dtypes=(torch.bfloat16, torch.float32), mamba_type="gdn_attention",
                          mamba_cache_mode=cfg.cache_config.mamba_cache_mode)
        groups = [KVCacheGroupSpec(["model.layers.3.self_attn.attn"], attn)] + [
            KVCacheGroupSpec([f"model.layers.{i}.linear_attn"], mamba) for i in (0, 1, 2)]
        return KVCacheConfig(num_blocks=64, kv_cache_tensors=[KVCacheTensor(size=1 << 20,
                             shared_by=["x"])], kv_cache_groups=groups)

    out = {}
    for name, arch_kw in (("ours", {"hf_overrides": OVERRIDES}), ("stock", {})):
        for pcp in (1, 2):
            for caching in (False, True):
                key = f"{name}_pcp{pcp}_{'cache' if caching else 'nocache'}"
                try:
                    cfg = engine_config(ckpt, prefill_context_parallel_size=pcp,
                                        enable_prefix_caching=caching, **arch_kw)
                except Exception as e:  # noqa: BLE001
                    out[key] = {"config_error": str(e)}
                    continue
                kvc = kv_config(cfg)
                cfg.cache_config.num_gpu_blocks = kvc.num_blocks
                res = {"max_mem": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=256,
                                                    dtype=torch.bfloat16).max_memory_usage_bytes(cfg)}
                try:
                    res["block_sizes"] = list(core.resolve_kv_cache_block_sizes(kvc, cfg))
                    sched = Scheduler(vllm_config=cfg, kv_cache_config=kvc,
                                      structured_output_manager=StructuredOutputManager(cfg),
                                      block_size=res["block_sizes"][0],
                                      hash_block_size=res["block_sizes"][1])
                    res["coordinator"] = type(sched.kv_cache_manager.coordinator).__name__
                    res["manager_block_sizes"] = [m.block_size for m in
                                                  sched.kv_cache_manager.coordinator.single_type_managers]
                    res["scheduler_sees_pcp"] = sched.parallel_config.prefill_context_parallel_size
                except Exception as e:  # noqa: BLE001
                    import traceback
                    res["error"] = f"{type(e).__name__}: {e}"
                    res["tb"] = traceback.format_exc()[-1500:]
                out[key] = res
    return out


def test_replicated_kv_guards_only_for_our_model(tiny_ckpt, fake_cuda_ranks):
    out = fake_cuda_ranks.isolated(_kv_guards, tiny_ckpt)
    print(json.dumps(out, indent=1))
    for caching in ("nocache", "cache"):
        ours1, ours2 = out[f"ours_pcp1_{caching}"], out[f"ours_pcp2_{caching}"]
        assert "error" not in ours2, ours2
        # replicated KV: the same block accounting and memory sizing as pcp == 1
        assert ours2["block_sizes"] == ours1["block_sizes"]
        assert ours2["manager_block_sizes"] == ours1["manager_block_sizes"]
        assert ours2["max_mem"] == ours1["max_mem"]
        assert ours2["scheduler_sees_pcp"] == 2  # the rest of the scheduler still sees the truth
        # stock vLLM at pcp=2 is untouched: it still rejects the hybrid KV layout
        stock2 = out[f"stock_pcp2_{caching}"]
        assert "error" in stock2 and "context parallel" in stock2["error"], stock2
        assert stock2["max_mem"] * 2 == out[f"stock_pcp1_{caching}"]["max_mem"]
    assert out["ours_pcp2_cache"]["coordinator"] == "HybridKVCacheCoordinator"


# ------------------------------------------------------------------------------ the model
def _model(ckpt, pcp, arch=ARCH):
    from harness.dist import error_of
    from tests.fake_cuda import build_model, engine_config, use_fake_cuda

    use_fake_cuda()
    import qwen36_pcp

    qwen36_pcp.register()
    from safetensors import safe_open
    from vllm.model_executor.custom_op import op_registry_oot

    from qwen36_pcp.model import SKIPPED_PREFIXES

    cfg = engine_config(ckpt, hf_overrides={"architectures": [arch]}, prefill_context_parallel_size=pcp)
    model = build_model(cfg, port=29600 + pcp)
    params = {n for n, _ in model.named_parameters()}
    visual = getattr(model, "visual", None)
    with safe_open(f"{ckpt}/model.safetensors", "pt") as f:
        names = list(f.keys())
        loaded = model.load_weights((n, f.get_tensor(n)) for n in names)
    skipped = [n for n in names if n.startswith(SKIPPED_PREFIXES)]
    return {
        "params": sorted(params), "loaded": sorted(loaded), "num_tensors": len(names),
        "skipped": len(skipped), "gdn": sorted({type(m).__name__ for m in model.modules()
                                                if "DeltaNet" in type(m).__name__}),
        "impls": sorted({type(m.impl).__name__ for m in model.modules() if hasattr(m, "impl")}),
        "full_rows": sorted(n.split(".")[-1] for n, m in model.named_modules() if getattr(m, "full_rows", False)),
        "linear_classes": sorted({type(m).__name__ for m in model.modules() if "ReplicatedLinear" in type(m).__name__}),
        "moe_classes": sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("FusedMoE")}),
        "mrope": model.get_mrope_input_positions(list(range(5)), [])[0].tolist(),
        "oot_left": sorted(op_registry_oot),
        "visual_params": sum(n.startswith("visual.") for n in params),
        "split_encoder": getattr(model, "split_encoder", None),
        "visual_classes": sorted({type(m).__module__.split(".")[0] for m in (visual.modules() if visual else [])}),
        "text_only_image_error": error_of(lambda: model.get_mrope_input_positions([1, 2], [object()])),
    }


def _models(ckpt, dense_ckpt):
    """Both models in one fresh process, the vision-language one of the dense layout at pcp=2, and our
    model at pcp=2 built by a runner that is not the PCP one."""
    from harness.dist import error_of
    from tests.fake_cuda import build_model, engine_config

    out = {pcp: _model(ckpt, pcp) for pcp in (1, 2)}
    out.update({("vl", pcp): _model(ckpt, pcp, VL_ARCH) for pcp in (1, 2)})
    out["vl_dense"] = _model(dense_ckpt, 2, VL_ARCH)
    cfg = engine_config(ckpt, hf_overrides=OVERRIDES, prefill_context_parallel_size=2)
    out["other_runner"] = error_of(lambda: build_model(cfg, as_pcp_runner=False))
    return out


@pytest.fixture(scope="module")
def models(tiny_ckpt, tmp_path_factory, fake_cuda_ranks):
    from qwen36_pcp.tools.make_checkpoint import make_checkpoint

    dense = str(make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-dense", preset="tiny-dense", seed=0))
    return fake_cuda_ranks.isolated(_models, tiny_ckpt, dense)


def test_dense_vision_language_model_builds_with_pcp_layers(models):
    """The dense layout (Qwen3.6-27B's) of the vision-language class at pcp=2: the PCP GDN and
    attention, vLLM's dense MLP, every parameter (the vision tower's too) from the checkpoint."""
    out = models["vl_dense"]
    assert out["loaded"] == out["params"], set(out["params"]) ^ set(out["loaded"])
    assert out["gdn"] == ["PCPGatedDeltaNetAttention"] and out["impls"] == ["PCPFlashAttentionImpl"]
    assert out["moe_classes"] == [] and out["visual_params"] > 0 and out["split_encoder"] is True
    assert out["oot_left"] == []


def test_model_at_pcp_needs_the_pcp_runner(models):
    """A worker whose runner is not the PCP one (its block tables would give other ranks' tokens the pad
    slot) cannot build our model at pcp > 1."""
    assert "must be built by the PCP model runner" in (models["other_runner"] or ""), models["other_runner"]


@pytest.mark.parametrize("pcp", [1, 2])
def test_model_builds_and_every_tensor_is_mapped_or_skipped(models, pcp):
    out = models[pcp]
    assert out["loaded"] == out["params"], set(out["params"]) ^ set(out["loaded"])
    assert out["skipped"] > 0  # the vision tower and MTP head are in the checkpoint and skipped
    if pcp == 1:  # vLLM's own layers, untouched
        assert out["gdn"] == ["GatedDeltaNetAttention"] and out["impls"] == ["FlashAttentionImpl"]
        assert out["full_rows"] == [] and out["linear_classes"] == ["ReplicatedLinear"]
        assert out["moe_classes"] == ["FusedMoE"]
    else:
        assert out["gdn"] == ["PCPGatedDeltaNetAttention"] and out["impls"] == ["PCPFlashAttentionImpl"]
        assert out["full_rows"] == ["shared_expert_gate"] * 8  # one per MoE layer
        assert out["linear_classes"] == ["PCPReplicatedLinear"] and out["moe_classes"] == ["WholeExpertsFusedMoE"]
    assert out["oot_left"] == []  # the PCP classes were registered only while the model was built
    assert out["mrope"] == [list(range(5))] * 3
    assert out["visual_params"] == 0 and "for images and video use " + VL_ARCH in out["text_only_image_error"]


@pytest.mark.parametrize("pcp", [1, 2])
def test_vision_language_model_builds_with_pcp_layers_and_its_vision_tower(models, pcp):
    """The vision-language class: vLLM's at pcp=1; at pcp=2 its language model has the PCP layers and
    its vision tower stays vLLM's; every parameter, the vision tower's included, comes from the
    checkpoint (only the MTP head, left to the drafter, is skipped)."""
    out, text = models[("vl", pcp)], models[pcp]
    assert out["loaded"] == out["params"], set(out["params"]) ^ set(out["loaded"])
    assert out["visual_params"] > 0 and "qwen36_pcp" not in out["visual_classes"], out["visual_classes"]
    assert out["split_encoder"] is (pcp > 1)  # the encoder split over the ranks at pcp > 1 (the default)
    for key in ("gdn", "impls", "full_rows", "linear_classes", "moe_classes", "oot_left", "mrope"):
        assert out[key] == text[key], key  # the same layers as the text-only class
    assert len(out["params"]) == len(text["params"]) + out["visual_params"]


def test_per_token_metadata_features_are_named():
    """The features the runner feeds per-token metadata of the whole batch, one line each (EPLB and
    sequence parallelism cannot be configured on a CPU machine, so the check is called directly)."""
    from qwen36_pcp.checks import per_token_metadata_problems

    def cfg(**kw):
        passes = SimpleNamespace(enable_sp=kw.get("sp"), fuse_gemm_comms=kw.get("gemm_comms"))
        return SimpleNamespace(
            lora_config=kw.get("lora"), kv_transfer_config=None,
            cache_config=SimpleNamespace(kv_offloading_size=kw.get("offload")),
            parallel_config=SimpleNamespace(enable_eplb=kw.get("eplb", False),
                                            tensor_parallel_size=kw.get("tp", 1)),
            compilation_config=SimpleNamespace(pass_config=passes),
            model_config=SimpleNamespace(runner_type="generate"))

    assert per_token_metadata_problems(cfg()) == []
    assert per_token_metadata_problems(cfg(sp=True)) == []  # sequence parallelism needs tp > 1
    assert "enable_eplb" in per_token_metadata_problems(cfg(eplb=True))[0]
    assert "sequence parallelism" in per_token_metadata_problems(cfg(sp=True, tp=2))[0]
    assert "sequence parallelism" in per_token_metadata_problems(cfg(gemm_comms=True, tp=2))[0]
    assert "kv_offloading_size" in per_token_metadata_problems(cfg(offload=4.0))[0]
    # the fields read above, on vLLM 0.20.2's real config classes
    import dataclasses

    from vllm.config import CacheConfig, ParallelConfig, VllmConfig
    from vllm.config.compilation import PassConfig

    def fields(c):
        return {f.name for f in dataclasses.fields(c)}

    assert {"lora_config", "kv_transfer_config", "cache_config", "compilation_config"} <= fields(VllmConfig)
    assert "kv_offloading_size" in fields(CacheConfig) and {"enable_sp", "fuse_gemm_comms"} <= fields(PassConfig)
    assert {"enable_eplb", "worker_cls", "distributed_executor_backend"} <= fields(ParallelConfig)
    assert isinstance(ParallelConfig.local_world_size, property)
    assert "LoRA" in per_token_metadata_problems(cfg(lora=object()))[0]


# ------------------------------------------------- vLLM 0.20.2's GDN kernels kept to one output's configs
@pytest.mark.parametrize("env", [None, "0", "1"])
def test_gdn_config_pins_wanted(monkeypatch, env):
    from qwen36_pcp.deterministic_gdn import DETERMINISTIC_GDN_ENV, pin_gdn_configs_wanted

    if env is None:
        monkeypatch.delenv(DETERMINISTIC_GDN_ENV, raising=False)
    else:
        monkeypatch.setenv(DETERMINISTIC_GDN_ENV, env)
    # default: only where PCP runs (the runner hook asks with pcp=True for our model at pcp > 1)
    assert pin_gdn_configs_wanted(pcp=True) == (env != "0")
    assert pin_gdn_configs_wanted(pcp=False) == (env == "1")


def test_keep_autotune_configs_on_a_real_autotuner():
    import triton

    from qwen36_pcp.deterministic_gdn import ORIGINAL_CONFIGS, keep_autotune_configs

    def kernel(K):
        pass

    grid = _vllm_config_grids()["chunk_scaled_dot_kkt_fwd_kernel"]
    tuner = triton.autotune(configs=grid, key=["K"])(triton.jit(kernel))
    tuner.cache[("stale",)] = grid[0]
    assert keep_autotune_configs(tuner, lambda c: c.kwargs["BK"] == 128)
    assert [c.kwargs["BK"] for c in tuner.configs] == [128] * 9 and not tuner.cache
    assert keep_autotune_configs(tuner, lambda c: False)  # idempotent: applied once
    assert len(tuner.configs) == 9 and len(getattr(tuner, ORIGINAL_CONFIGS)) == 27
    other = triton.autotune(configs=grid[:3], key=["K"])(triton.jit(kernel))
    assert not keep_autotune_configs(other, lambda c: c.kwargs["BK"] == 128)  # nothing left: untouched
    assert len(other.configs) == 3


def _vllm_config_grids(hopper: bool = True):
    """vLLM 0.20.2's autotune config grids of the three pinned GDN kernels (its ``fla/ops`` files) on
    Hopper, or on a GPU with less shared memory (``chunk_o.py``: BK, BV in 32, 64; 2, 4 or 8 warps)."""
    import triton

    bkv, warps = ((64, 128), (2, 4)) if hopper else ((32, 64), (2, 4, 8))
    return {
        "chunk_scaled_dot_kkt_fwd_kernel": [triton.Config({"BK": bk}, num_warps=w, num_stages=s)
                                            for bk in (32, 64, 128) for w in (2, 4, 8) for s in (2, 3, 4)],
        "chunk_fwd_kernel_o": [triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=s)
                               for bk in bkv for bv in bkv for w in warps for s in (2, 3, 4)],
        "merge_16x16_to_64x64_inverse_kernel": [triton.Config({}, num_warps=w, num_stages=s)
                                                for w in (2, 4, 8) for s in (2, 3, 4, 5)],
    }


def _stand_in_gdn_kernels(monkeypatch, grids: dict) -> dict:
    """Real Triton autotuners over ``grids`` in place of vLLM's three pinned kernels, in its modules."""
    import importlib

    import triton

    from qwen36_pcp.deterministic_gdn import PINS

    def kernel(K):
        pass

    tuners = {}
    for pin in PINS:
        mod = importlib.import_module(f"vllm.model_executor.layers.fla.ops.{pin.module}")
        tuner = triton.autotune(configs=grids[pin.kernel], key=["K"])(triton.jit(kernel))
        # vLLM's three sit under @heuristics (``.fn``); a bare autotuner is found too
        wrapped = tuner if pin.kernel == "chunk_fwd_kernel_o" else SimpleNamespace(fn=tuner)
        monkeypatch.setattr(mod, pin.kernel, wrapped)
        tuners[pin.kernel] = tuner
    return tuners


def test_gdn_kernels_kept_to_one_outputs_configs(monkeypatch):
    """The three pins on real Triton autotuners with vLLM 0.20.2's config grids, in vLLM's modules:
    each kept to the configs that gave one output in the sweeps (``tests/gpu/gdn_kernel_race.py``),
    once, and given all back."""
    import torch

    from qwen36_pcp.deterministic_gdn import ORIGINAL_CONFIGS, PINS, pin_gdn_configs, restore_gdn_configs

    if not torch.cuda.is_available():
        assert pin_gdn_configs() == []  # vLLM has plain functions there; nothing changes
    grids = _vllm_config_grids()
    assert sorted(grids) == sorted(p.kernel for p in PINS)
    tuners = _stand_in_gdn_kernels(monkeypatch, grids)
    assert sorted(pin_gdn_configs()) == sorted(grids) and sorted(pin_gdn_configs()) == sorted(grids)
    kept = {name: t.configs for name, t in tuners.items()}
    assert [c.kwargs["BK"] for c in kept["chunk_scaled_dot_kkt_fwd_kernel"]] == [128] * 9
    assert [c.kwargs["BK"] for c in kept["chunk_fwd_kernel_o"]] == [128] * 12
    assert [c.num_warps for c in kept["merge_16x16_to_64x64_inverse_kernel"]] == [2] * 4
    restore_gdn_configs()  # reversible: every config back
    for name, tuner in tuners.items():
        assert tuner.configs == grids[name] and not hasattr(tuner, ORIGINAL_CONFIGS)


def test_chunk_o_without_a_bk128_config_is_left_as_it_is(monkeypatch, caplog):
    """Where vLLM's ``chunk_o`` has no BK=128 config (GPUs with less shared memory than Hopper's), it
    is left unpinned with one warning, and the other two are kept as on Hopper."""
    from qwen36_pcp import deterministic_gdn
    from qwen36_pcp.deterministic_gdn import pin_gdn_configs, restore_gdn_configs

    monkeypatch.setattr(deterministic_gdn, "_warned", set())  # said once per process: this one's own
    grids = _vllm_config_grids(hopper=False)
    tuners = _stand_in_gdn_kernels(monkeypatch, grids)
    with caplog.at_level("WARNING", logger="vllm.qwen36_pcp"):
        applied = pin_gdn_configs() + pin_gdn_configs()
    try:
        assert sorted(set(applied)) == ["chunk_scaled_dot_kkt_fwd_kernel", "merge_16x16_to_64x64_inverse_kernel"]
        assert tuners["chunk_fwd_kernel_o"].configs == grids["chunk_fwd_kernel_o"]  # untouched
        warned = [r.getMessage() for r in caplog.records if "chunk_fwd_kernel_o" in r.getMessage()]
        assert len(warned) == 1 and "no BK=128" in warned[0], warned
    finally:
        restore_gdn_configs()


def test_default_ray_executor_is_refused_at_pcp(monkeypatch):
    """vLLM's default Ray executor would leave PCP ranks 1+ without steps (a hang); its V2 executor and
    the multiprocessing backend send every step to every rank."""
    from vllm.v1.executor.ray_executor import RayDistributedExecutor

    from qwen36_pcp.checks import ray_executor_without_pcp_ranks

    def cfg(backend):
        return SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend))

    monkeypatch.delenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", raising=False)
    assert ray_executor_without_pcp_ranks(cfg("ray"))
    assert not ray_executor_without_pcp_ranks(cfg("mp")) and not ray_executor_without_pcp_ranks(cfg(None))
    assert ray_executor_without_pcp_ranks(cfg(RayDistributedExecutor))
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "00")  # vLLM reads bool(int(...)): still V1
    assert ray_executor_without_pcp_ranks(cfg("ray"))
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "1")
    assert not ray_executor_without_pcp_ranks(cfg("ray"))
    # what the check stands on: the V1 Ray executor's step graph is built from pp_tp_workers
    import inspect

    assert "pp_tp_workers[0]" in inspect.getsource(RayDistributedExecutor)
