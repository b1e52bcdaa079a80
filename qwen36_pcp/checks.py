# SPDX-License-Identifier: Apache-2.0
"""Startup checks: what PCP for Qwen3.6 does not support is rejected when the engine's config is built,
with one message that names every problem (``validate_pcp_config``, run from our model's config check,
``patches._config_check_class``); what cannot wait for a config (bad options, no GPU, nodes) is
refused before vLLM's own checks by ``early_refusals``. They read the config only; the one thing
they set is the worker class and the GDN prefill backend PCP needs. ``startup_problems`` is the list
both the engine and ``doctor`` judge; every refusal is a ``refusal.Refusal``, which an uncaught one
turns into its message alone and exit code 1.
"""

from __future__ import annotations

import logging

import vllm.envs as envs
from vllm.utils.import_utils import resolve_obj_by_qualname

from .config import (
    MTP_DRAFTERS,
    MTP_METHOD,
    VL_ARCHITECTURE,
    PCPConfig,
    our_architecture,
    pcp_config_of,
    uses_pcp,
)
from .early_refusals import few_gpus_problem, option_error, visible_gpu_count
from .expert_memory import checkpoint_quant_config, online_schemes, whole_experts_problems
from .refusal import ConfigRefusal

logger = logging.getLogger("vllm.qwen36_pcp")  # under vLLM's logger, so that it shows in the engine's log

PCP_WORKER_CLS = "qwen36_pcp.worker.PCPWorker"  # named, not imported: the worker module imports vLLM's runner


def validate_pcp_config(vllm_config) -> None:
    """Reject, at startup and with one clear message, what PCP for Qwen3.6 does not support."""
    if not uses_pcp(vllm_config):
        return
    problems = startup_problems(vllm_config)
    try:
        warn_encoder_graphs(vllm_config, pcp_config_of(vllm_config))
    except ValueError:
        pass  # a bad option: among the problems
    if problems:
        pc = vllm_config.parallel_config
        raise ConfigRefusal(
            f"qwen36_pcp: prefill_context_parallel_size={pc.prefill_context_parallel_size} with "
            f"{our_architecture(vllm_config)} does not support: " + "; ".join(problems) + "."
        )


def option_problems(vllm_config) -> list[str]:
    """The plugin options' problems: a value the plugin does not know, or a combination with the rest of
    the config that it refuses."""
    try:
        config = pcp_config_of(vllm_config)
    except (ValueError, TypeError) as e:
        return [option_error(e)]
    return spread_decode_problems(vllm_config, config)


def startup_problems(vllm_config, machine: bool = True) -> list[str]:
    """Everything the plugin refuses our model at pcp > 1 for, one phrase each, the options' first:
    ``validate_pcp_config`` raises them in one message, ``doctor`` prints them one a line (for a
    stand-in config built from its arguments). ``machine=False`` leaves out what this process's GPUs
    decide (their number, whether whole experts fit): the doctor judges those itself, with the numbers
    and the fix."""
    pc = vllm_config.parallel_config
    problems = option_problems(vllm_config)
    if pc.decode_context_parallel_size > 1:
        problems.append("decode context parallel (-dcp > 1) together with PCP")
    if pc.pipeline_parallel_size > 1:
        problems.append("pipeline parallel together with PCP")
    if pc.data_parallel_size > 1:
        problems.append("data parallel together with PCP")
    problems += speculative_problems(vllm_config)
    problems += worker_class_problems(vllm_config)
    if ray_executor_without_pcp_ranks(vllm_config):
        problems.append(
            "vLLM's default Ray executor (it sends each step to pp x tp workers only, so PCP ranks 1 and up "
            "would never run one): set VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1 or use the multiprocessing backend"
        )
    backend = getattr(vllm_config.attention_config, "backend", None)
    if backend is not None and getattr(backend, "name", str(backend)) != "FLASH_ATTN":
        problems.append(f"attention backend {getattr(backend, 'name', backend)} (PCP needs FLASH_ATTN)")
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype not in ("auto", "bfloat16", "float16"):
        problems.append(f"quantized KV cache (kv_cache_dtype={cache_dtype}) together with PCP")
    text = vllm_config.model_config.hf_text_config
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        problems.append("sliding-window attention layers")
    layer_types = list(getattr(text, "layer_types", None) or [])
    if "linear_attention" not in layer_types or "full_attention" not in layer_types:
        problems.append(
            "a non-hybrid model (PCP here is for Gated DeltaNet + full-attention hybrids; "
            f"layer_types={sorted(set(layer_types))})"
        )
    if getattr(vllm_config.model_config, "enable_return_routed_experts", False):
        problems.append("enable_return_routed_experts together with PCP")
    if gdn_prefill_backend(vllm_config) == "flashinfer":
        problems.append(
            "gdn_prefill_backend='flashinfer' (PCP's split steps run vLLM's Triton/FLA GDN kernels: "
            "pass 'triton' or leave it unset)"
        )
    problems += per_token_metadata_problems(vllm_config)
    problems += fp8_problems(vllm_config)
    problems += whole_experts_problems(vllm_config, memory=machine)
    if machine:
        problems += visible_gpu_problems(vllm_config)
    return problems


def warn_encoder_graphs(vllm_config, config: PCPConfig) -> None:
    """vLLM's vision-encoder CUDA graphs (``cudagraph_mm_encoder``) run the tower on every rank before
    the split encoder is reached: the answers are right, the split's time is not saved."""
    if (our_architecture(vllm_config) == VL_ARCHITECTURE and config.vision_encoder == "split"
            and getattr(vllm_config.compilation_config, "cudagraph_mm_encoder", False)):
        logger.warning("qwen36_pcp: cudagraph_mm_encoder is on, so every PCP rank encodes every image and "
                       "video frame (vLLM's encoder graphs bypass vision_encoder='split'); turn it off to "
                       "share the encoder over the ranks")


def spread_decode_problems(vllm_config, config: PCPConfig) -> list[str]:
    """``decode="spread"`` keeps a decoding request's GDN states on its owner alone
    (``decode_owners``; with prefix caching the blocks it fills go to every rank: ``state_blocks``):
    what would read them on every rank is refused."""
    if config.decode != "spread":
        return []
    problems = []
    if vllm_config.speculative_config is not None and vllm_config.cache_config.enable_prefix_caching:
        problems.append("decode='spread' together with speculative decoding and prefix caching (vLLM then "
                        "keeps GDN states block by block at accepted-token offsets, which spread decode does "
                        "not share): pass enable_prefix_caching=False (--no-enable-prefix-caching) or use "
                        "decode='replicated'")
    if config.moe_experts == "sharded":
        problems.append("decode='spread' together with moe_experts='sharded' (each rank decodes its own "
                        "requests alone, but sharded experts need every rank in every MoE layer): use "
                        "moe_experts='replicated' or decode='replicated'")
    return problems


def speculative_problems(vllm_config) -> list[str]:
    """Speculative decoding at pcp > 1: the checkpoint's own MTP head only (``--speculative-config
    '{"method": "mtp", ...}'``); the runner builds that drafter with whole experts and runs it on every
    rank. Draft models, EAGLE, n-gram and the rest are not supported with PCP."""
    spec = vllm_config.speculative_config
    if spec is None:
        return []
    draft = getattr(spec, "draft_model_config", None)
    arch = list(getattr(getattr(draft, "hf_config", None), "architectures", None) or [])
    if spec.method != MTP_METHOD or not arch or arch[0] not in MTP_DRAFTERS:
        draft = f" (draft {arch or None})" if spec.method == MTP_METHOD else ""  # another method: that is all
        return [(f"speculative decoding method {spec.method!r}{draft} together with PCP: only the checkpoint's "
                 "own MTP head is supported, --speculative-config '{\"method\": \"mtp\", "
                 "\"num_speculative_tokens\": K}'")]
    pc = vllm_config.parallel_config
    problems = []
    draft_tp = getattr(spec, "draft_tensor_parallel_size", None)
    if draft_tp not in (None, pc.tensor_parallel_size):
        problems.append(f"MTP with draft_tensor_parallel_size={draft_tp} other than the target's tensor "
                        f"parallel size ({pc.tensor_parallel_size}) together with PCP (not verified)")
    if getattr(pc, "cp_kv_cache_interleave_size", 1) > 1:
        problems.append("MTP with cp_kv_cache_interleave_size > 1 (vLLM's attention does not support it)")
    return problems


def worker_class_problems(vllm_config) -> list[str]:
    """A worker class of the user's own must build on the PCP worker (it carries the PCP model runner);
    the model checks it again where it is built (``config.pcp_runner_builds_model``)."""
    worker_cls = vllm_config.parallel_config.worker_cls
    if worker_cls == "auto" or worker_cls == PCP_WORKER_CLS:
        return []
    from .worker import PCPWorker  # only here: it imports vLLM's GPU model runner, which a front end never needs

    try:
        cls = resolve_obj_by_qualname(worker_cls) if isinstance(worker_cls, str) else worker_cls
    except Exception as e:  # noqa: BLE001 - it may exist only where the workers run
        logger.warning("qwen36_pcp: worker_cls=%r cannot be imported here (%s: %s); the workers check that "
                       "it builds on %s when they build the model", worker_cls, type(e).__name__, e,
                       PCP_WORKER_CLS)
        return []
    if isinstance(cls, type) and issubclass(cls, PCPWorker):
        return []
    return [f"worker_cls={worker_cls!r}, which is not built on {PCP_WORKER_CLS} (the worker that runs "
            "PCP's model runner: subclass it, or leave worker_cls unset)"]


def select_pcp_worker(vllm_config) -> None:
    """Our model at pcp > 1 runs on the PCP worker (vLLM's ``worker_cls``, read by every executor)."""
    if uses_pcp(vllm_config) and vllm_config.parallel_config.worker_cls == "auto":
        vllm_config.parallel_config.worker_cls = PCP_WORKER_CLS


def ray_executor_without_pcp_ranks(vllm_config) -> bool:
    """vLLM 0.20.2's ``RayDistributedExecutor`` builds its step graph from ``pp_tp_workers`` (ranks
    pp x tp + tp_rank): at pcp > 1 the other PCP ranks get no step and the first collective waits for
    them forever. Its V2 executor (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1``) sends each step to every rank."""
    backend = vllm_config.parallel_config.distributed_executor_backend
    if isinstance(backend, type):
        from vllm.v1.executor.ray_executor import RayDistributedExecutor

        return issubclass(backend, RayDistributedExecutor)
    return backend == "ray" and not envs.VLLM_USE_RAY_V2_EXECUTOR_BACKEND


def per_token_metadata_problems(vllm_config) -> list[str]:
    """Features that read per-token metadata the runner prepared for the whole batch while the model
    runs on a rank's slice of the rows: at a split step they would compute with other tokens'
    metadata, silently (LoRA's adapter map) or by a crash (sequence parallelism), or they are
    unverified with a split batch (KV and encoder-cache connectors, EPLB, pooling)."""
    problems = []
    if vllm_config.lora_config is not None:
        problems.append("LoRA (the per-token adapter mapping covers the whole batch, each PCP rank "
                        "computes a slice of it)")
    # KV offloading (kv_offloading_size) becomes a kv_transfer_config only after this check runs
    if (vllm_config.kv_transfer_config is not None
            or getattr(vllm_config.cache_config, "kv_offloading_size", None) is not None):
        problems.append("KV connectors / disaggregated prefill / KV offloading (kv_transfer_config, "
                        "kv_offloading_size)")
    if getattr(vllm_config, "ec_transfer_config", None) is not None:
        problems.append("encoder-cache connectors (ec_transfer_config: unverified with the vision encoder "
                        "split over the PCP ranks)")
    if vllm_config.parallel_config.enable_eplb:
        problems.append("expert-parallel load balancing (enable_eplb)")
    passes = vllm_config.compilation_config.pass_config
    if vllm_config.parallel_config.tensor_parallel_size > 1 and (passes.enable_sp or passes.fuse_gemm_comms):
        problems.append("sequence parallelism (pass_config enable_sp / fuse_gemm_comms) with tp > 1")
    if vllm_config.model_config.runner_type != "generate":
        problems.append(f"the {vllm_config.model_config.runner_type!r} runner (PCP serves generation)")
    return problems


# online schemes that quantize activations to FP8, the narrow layers' included
ONLINE_FP8_SCHEMES = ("fp8_per_tensor", "fp8_per_block", "mxfp8")


def fp8_problems(vllm_config) -> list[str]:
    """FP8 forms whose answers would change with pcp; block-wise FP8 checkpoints (the layout of the
    published Qwen3.6-35B-A3B-FP8) pass, and gave pcp=1's bits at pcp=2 on long steps.

    * vLLM's online FP8 schemes (``quantization="fp8"`` on a bf16 checkpoint, ``"fp8_per_tensor"``,
      ``"fp8_per_block"``, ``"mxfp8"``, or ``"online"`` with one of them): they quantize every linear
      layer, the narrow ones too (router, shared-expert gate, GDN ``in_proj_a/b``, which an FP8
      checkpoint keeps in bf16). With ``"fp8"`` and ``"fp8_per_block"`` pcp=2 departed from pcp=1 beyond
      vLLM's logprob rule where the FP8 checkpoint of the same weights was bit for bit; ``mxfp8`` is
      refused with them, unverified. Weight-only online schemes pass (not verified).
    * An FP8 checkpoint with per-tensor expert scales and dynamic activation scales (no
      ``weight_block_size``, ``activation_scheme="dynamic"``): vLLM's fused MoE then takes one
      activation scale over every row the GPU computes, at a split step each rank's own rows, so each
      rank quantizes differently from pcp=1 (the path that online ``"fp8"`` takes, seen end to end).
    """
    mc = vllm_config.model_config
    use = "use a block-wise FP8 checkpoint (weight_block_size, as Qwen3.6-35B-A3B-FP8 is published)"
    schemes = online_schemes(mc)
    if schemes is not None:
        fp8 = sorted({s for s in schemes.values() if s in ONLINE_FP8_SCHEMES})
        if not fp8:
            return []
        return [f"online FP8 quantization (quantization={mc.quantization!r}, {'/'.join(fp8)}: it quantizes "
                f"the narrow layers an FP8 checkpoint keeps in bf16, and pcp would change the answers "
                f"beyond vLLM's logprob rule); {use}"]
    quant = checkpoint_quant_config(mc) if mc.quantization == "fp8" else None
    if quant is None or quant.get("weight_block_size") or not getattr(mc.hf_text_config, "num_experts", 0):
        return []
    if quant.get("activation_scheme", "dynamic") == "dynamic":
        return [f"an FP8 checkpoint with per-tensor scales and dynamic activation scales (the experts' "
                f"activation scale spans the rows a GPU computes, so each PCP rank would quantize "
                f"differently from pcp=1); {use}"]
    return []


def visible_gpu_problems(vllm_config) -> list[str]:
    """One GPU per rank on this node: fewer visible GPUs than tp x pcp would fail later with a message
    about device ordinals. Not judged without a visible GPU (vLLM says so itself), with a custom
    worker class (it places its ranks itself), or with another launcher than vLLM's multiprocessing
    one (whose ranks per node are ``local_world_size``)."""
    pc = vllm_config.parallel_config
    if pc.worker_cls != "auto" or pc.distributed_executor_backend not in (None, "mp"):
        return []  # Ray and external launchers place ranks on other nodes than this one
    count = visible_gpu_count()
    need = pc.local_world_size
    if not count or count >= need:
        return []
    return [few_gpus_problem(count, pc.tensor_parallel_size, pc.prefill_context_parallel_size, need)]


def gdn_prefill_backend(vllm_config) -> str:
    return str((vllm_config.additional_config or {}).get("gdn_prefill_backend", "auto")).strip().lower()


def triton_gdn_prefill_under_pcp(vllm_config) -> None:
    """At pcp > 1 an unset GDN prefill backend means Triton/FLA, not vLLM's 'auto' (FlashInfer on
    SM90): the split steps run the Triton kernels (the relay needs their stages), and every prefill
    step of the engine then runs the same kernels as pcp == 1 with ``gdn_prefill_backend='triton'``."""
    if uses_pcp(vllm_config) and gdn_prefill_backend(vllm_config) == "auto":
        vllm_config.additional_config["gdn_prefill_backend"] = "triton"
        logger.info("qwen36_pcp: GDN prefill backend set to 'triton' for prefill context parallel")


