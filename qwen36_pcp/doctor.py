# SPDX-License-Identifier: Apache-2.0
"""``python -m qwen36_pcp doctor``: check a PCP setup before starting an engine.

An engine start takes minutes (weights, compilation) and a wrong setup shows itself only at its end,
in vLLM's words. The doctor answers the usual questions in seconds, without building an engine and
without a network: the vLLM version, whether vLLM will load the plugin, the GPUs, the options, and
whether the MoE experts fit per GPU. What the engine would refuse at startup it finds with the
engine's own function, ``checks.startup_problems``, run on a stand-in for the engine's config made of
vLLM's config classes and the checkpoint's config.json (``engine_config_like``). It prints one line per
check and, for a problem, what to change; the exit code is 0 when nothing is a problem. "note" lines
(no GPU to compare with, an unverified GPU generation) inform and do not fail.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

from . import SUPPORTED_VLLM_VERSION, vllm_version
from .config import ARCHITECTURE, MTP_METHOD, PCPConfig, below_split_floor, misspelled_option_keys, pcp_config_of

OK, NOTE, PROBLEM = "ok", "note", "PROBLEM"
SHARDED = '--additional-config \'{"qwen36_pcp": {"moe_experts": "sharded"}}\''
# compute capability -> NVIDIA generation: by (major, minor) where a major spans two, else by major
GENERATIONS = {(7, 5): "Turing", (8, 9): "Ada Lovelace", 7: "Volta", 8: "Ampere", 9: "Hopper",
               10: "Blackwell", 11: "Blackwell", 12: "Blackwell"}


@dataclass
class Check:
    status: str  # OK, NOTE or PROBLEM
    text: str
    fix: str = ""


class Gpu(NamedTuple):
    name: str
    capability: tuple[int, int]
    total_memory: int  # bytes


def gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB"


# ----------------------------------------------------------------------------- environment
def check_vllm() -> Check:
    """The plugin patches vLLM 0.20.2 internals; on any other version it loads nothing."""
    found = vllm_version()
    if found.split("+")[0] == SUPPORTED_VLLM_VERSION:
        return Check(OK, f"vLLM {found}")
    return Check(PROBLEM, f"vLLM {found}; the plugin is written for {SUPPORTED_VLLM_VERSION} and loads "
                          "nothing on another version", f"pip install vllm=={SUPPORTED_VLLM_VERSION}")


def check_plugin() -> Check:
    """vLLM finds the plugin only through its entry point (no import in user code), and loads only
    the plugins named in VLLM_PLUGINS when that variable is set."""
    from importlib.metadata import entry_points

    wanted = "qwen36_pcp:register"
    found = [ep.value for ep in entry_points(group="vllm.general_plugins") if ep.name == "qwen36_pcp"]
    if wanted not in found:
        return Check(PROBLEM, "the vllm.general_plugins entry point qwen36_pcp is not installed in this "
                              "environment, so vLLM would not load the plugin",
                     "pip install -e . in the qwen36_pcp source folder, with this environment's pip")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and "qwen36_pcp" not in allowed.split(","):
        return Check(PROBLEM, f"VLLM_PLUGINS={allowed!r} leaves qwen36_pcp out, so vLLM would not load it",
                     "add qwen36_pcp to VLLM_PLUGINS (comma-separated) or unset it")
    return Check(OK, f"plugin registered (vllm.general_plugins: qwen36_pcp = {wanted})")


def visible_gpus() -> list[Gpu]:
    """The CUDA GPUs this process sees (CUDA_VISIBLE_DEVICES applies); [] without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return [Gpu(p.name, (p.major, p.minor), p.total_memory) for p in props]


def check_gpus(gpus: list[Gpu], tp: int, pcp: int) -> list[Check]:
    """Each rank needs a GPU of its own on this node; PCP runs on vLLM's FLASH_ATTN backend, verified
    with flash-attention 3 on Hopper (sm90)."""
    need = tp * pcp
    where = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = f" (CUDA_VISIBLE_DEVICES={where!r})" if where is not None else ""
    if not gpus:
        return [Check(PROBLEM, f"no GPU visible{visible}; -tp {tp} x -pcp {pcp} needs {need} NVIDIA GPU(s)",
                      f"run on a machine where nvidia-smi lists {need} GPU(s)")]
    kinds: dict[Gpu, int] = {}
    for g in gpus:
        kinds[g] = kinds.get(g, 0) + 1
    listed = ", ".join(f"{n} x {g.name} (sm{g.capability[0]}{g.capability[1]}, {gib(g.total_memory)})"
                       for g, n in kinds.items())
    if len(gpus) < need:
        checks = [Check(PROBLEM, f"{len(gpus)} GPU(s) visible{visible}: {listed}; -tp {tp} x -pcp {pcp} "
                                 f"needs {need} on this node, one per rank",
                        f"lower -tp/-pcp to fit {len(gpus)} GPU(s), or run where {need} are visible")]
    else:
        checks = [Check(OK, f"{len(gpus)} GPU(s): {listed}; -tp {tp} x -pcp {pcp} needs {need}")]
    for cap in sorted({g.capability for g in gpus[:need]}):
        sm = f"sm{cap[0]}{cap[1]} ({GENERATIONS.get(cap) or GENERATIONS.get(cap[0], 'unknown generation')})"
        if cap[0] < 8:
            checks.append(Check(PROBLEM, f"{sm}: vLLM's FLASH_ATTN backend, which PCP needs, runs on sm80 "
                                         "and newer", "use Ampere or newer GPUs (PCP is verified on Hopper)"))
        elif cap != (9, 0):
            checks.append(Check(NOTE, f"{sm}: PCP is verified on sm90 (Hopper, flash-attention 3); "
                                      "flash-attention 3 needs Hopper, so vLLM runs another version here "
                                      "(not verified with PCP)"))
    return checks


# ----------------------------------------------------------------------------- options
def read_json(text: str | None, flag: str, example: str) -> tuple[list[Check], dict | None]:
    """A JSON-object argument as vLLM reads it; a problem line if it is not one."""
    try:
        value = json.loads(text) if text else {}
    except ValueError as e:
        return [Check(PROBLEM, f"{flag} is not JSON: {e}", f"quote it for the shell: {flag} '{example}'")], None
    if not isinstance(value, dict):
        return [Check(PROBLEM, f"{flag} must be a JSON object", f"pass {flag} '{example}'")], None
    return [], value


def check_options(text: str | None) -> tuple[list[Check], dict | None]:
    """The text of ``--additional-config``: JSON, and no misspelled ``qwen36_pcp`` key (vLLM passes
    other additional_config keys on silently, so the options would go unused without a word: the
    engine only warns). The options themselves are judged by the engine's checks (``check_engine``)."""
    checks, additional = read_json(text, "--additional-config", '{"qwen36_pcp": {...}}')
    if additional is None:
        return checks, None
    return checks + [Check(PROBLEM, f"additional_config key {key!r} looks like a misspelling of 'qwen36_pcp'; "
                                    "vLLM ignores unknown keys, so these options would not be used",
                           f"rename {key!r} to 'qwen36_pcp'") for key in misspelled_option_keys(additional)], additional


# ----------------------------------------------------------------------------- the engine's checks
def speculative_like(spec: dict | None, config: dict | None, tp: int) -> SimpleNamespace | None:
    """The ``SpeculativeConfig`` attributes the startup checks read, from ``--speculative-config``:
    vLLM's method names (an MTP alias is "mtp"; none given: "ngram" or a draft model) and, for MTP,
    the drafter vLLM makes of the checkpoint (``SpeculativeConfig.hf_config_override``, vLLM's own)."""
    if not spec:
        return None
    from typing import get_args

    from vllm.config.speculative import MTPModelTypes, SpeculativeConfig

    method = spec.get("method") or ("ngram" if spec.get("model") in ("ngram", "[ngram]") else "draft_model")
    method = MTP_METHOD if method in get_args(MTPModelTypes) else method
    draft = None
    if method == MTP_METHOD and config is not None:
        from transformers import PretrainedConfig

        text = config.get("text_config") or config
        hf = PretrainedConfig(model_type=config.get("model_type"), architectures=config.get("architectures"),
                              mtp_num_hidden_layers=text.get("mtp_num_hidden_layers"))
        draft = SimpleNamespace(hf_config=SpeculativeConfig.hf_config_override(hf))
    return SimpleNamespace(method=method, draft_model_config=draft,  # vLLM's draft tp: the target's unless given
                           draft_tensor_parallel_size=tp if spec.get("draft_tensor_parallel_size") is None
                           else spec["draft_tensor_parallel_size"])


def engine_config_like(config: dict | None, tp: int, pcp: int, additional: dict, spec: dict | None = None,
                       enable_prefix_caching: bool = False, gpu_memory_utilization: float = 0.9) -> SimpleNamespace:
    """A stand-in for the ``VllmConfig`` of ``vllm serve MODEL -tp TP -pcp PCP`` with our architecture and
    these arguments, everything else at vLLM's defaults (one node, vLLM's multiprocessing executor): the
    attributes the startup checks read, the model's from config.json (``model_config_like``; None: no
    model, only the options can be judged). Plain values rather than vLLM's config classes, which take
    seconds to import; tests/test_refusals.py holds them to the real config of the same arguments."""
    model = SimpleNamespace(architectures=[ARCHITECTURE], runner_type="generate", quantization=None,
                            enable_return_routed_experts=False, quantization_config=None, hf_text_config=None)
    if config is not None:
        model.__dict__.update(vars(model_config_like(config)))
    parallel = SimpleNamespace(
        tensor_parallel_size=tp, prefill_context_parallel_size=pcp, decode_context_parallel_size=1,
        pipeline_parallel_size=1, data_parallel_size=1, local_world_size=tp * pcp, worker_cls="auto",
        distributed_executor_backend="mp" if tp * pcp > 1 else "uni", enable_eplb=False,
        enable_expert_parallel=False, cp_kv_cache_interleave_size=1)
    cache = SimpleNamespace(cache_dtype="auto", enable_prefix_caching=enable_prefix_caching,
                            gpu_memory_utilization=gpu_memory_utilization, kv_offloading_size=None)
    compilation = SimpleNamespace(pass_config=SimpleNamespace(enable_sp=False, fuse_gemm_comms=False),
                                  cudagraph_mm_encoder=False)
    return SimpleNamespace(
        model_config=model, parallel_config=parallel, cache_config=cache, compilation_config=compilation,
        attention_config=SimpleNamespace(backend=None), additional_config=dict(additional),
        speculative_config=speculative_like(spec, config, tp), lora_config=None, kv_transfer_config=None,
        ec_transfer_config=None)


def check_engine(like: SimpleNamespace) -> list[Check]:
    """What the engine's startup check refuses, each as a line: the options (their values at any pcp,
    their combinations at pcp > 1: ``checks.option_problems``), and with a model everything else
    ``checks.startup_problems`` judges, but for this machine's GPUs (``check_gpus``, ``check_model``)."""
    from .checks import option_problems, startup_problems
    from .config import uses_pcp

    options = option_problems(like)
    checks = [Check(PROBLEM, f"options: {p}", "change the qwen36_pcp options as the message says") for p in options]
    if not options:
        checks.append(Check(OK, f"options: {pcp_config_of(like)}"))
    if like.model_config.hf_text_config is not None and uses_pcp(like):
        pcp = like.parallel_config.prefill_context_parallel_size
        checks += [Check(PROBLEM, f"-pcp {pcp} does not support {p}")  # each names its way out
                   for p in startup_problems(like, machine=False) if p not in options]
    return checks


# ----------------------------------------------------------------------------- the model
def read_model_config(model: str) -> dict:
    """config.json of a local checkpoint folder, of a Hugging Face name already in the local cache, or
    of a preset of ``make_checkpoint`` (the real full-size configs); never downloads."""
    from .tools.make_checkpoint import PRESETS, build_config

    path = os.path.join(model, "config.json")
    if not os.path.isfile(path) and model.count("/") == 1 and not os.path.exists(model):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json")
        except Exception:  # noqa: BLE001 - not a valid repository name: judged as a path below
            cached = None
        path = cached if isinstance(cached, str) else path
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    if model in PRESETS:
        return build_config(model)
    raise ValueError(f"{model!r} is neither a folder with a config.json, a downloaded Hugging Face "
                     f"checkpoint, nor a preset ({', '.join(PRESETS)})")


def model_config_like(config: dict) -> SimpleNamespace:
    """The few ``ModelConfig`` attributes ``expert_memory.whole_experts_bytes`` reads, from config.json: the
    text model (under ``text_config`` in the published Qwen3.6 layout, or the whole file), the
    checkpoint's quantization method, and the dtype vLLM's ``--dtype auto`` picks (float32 checkpoints are
    downcast to bfloat16; a name torch does not know is read as bfloat16)."""
    import torch

    text = config.get("text_config") or config
    quant = config.get("quantization_config") or text.get("quantization_config")
    name = next((c.get(k) for c in (text, config) for k in ("dtype", "torch_dtype") if c.get(k)), "bfloat16")
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or dtype == torch.float32:
        dtype = torch.bfloat16
    hf_config = SimpleNamespace(quantization_config=config.get("quantization_config"),
                                text_config=SimpleNamespace(quantization_config=text.get("quantization_config")))
    return SimpleNamespace(quantization=(quant or {}).get("quant_method"), hf_text_config=SimpleNamespace(**text),
                           dtype=dtype, hf_config=hf_config)


def check_model(config: dict, tp: int, pcp: int, options: PCPConfig | None, gpus: list[Gpu],
                utilization: float, speculative: SimpleNamespace | None = None) -> list[Check]:
    """PCP here is for Gated DeltaNet + full-attention hybrids; with ``moe_experts="replicated"`` (the
    default) every expert is whole on every PCP rank, split over tp only, and the engine's startup
    check refuses experts above 80% of the memory gpu_memory_utilization allows."""
    from .expert_memory import experts_storage, whole_experts_bytes

    like = model_config_like(config)
    text = like.hf_text_config
    layer_types = list(getattr(text, "layer_types", None) or [])
    if pcp > 1 and not {"linear_attention", "full_attention"} <= set(layer_types):
        return []  # the engine refuses it (check_engine says so): the experts do not matter
    if not getattr(text, "num_experts", 0):
        return [Check(OK, "experts: none (a dense model)")]
    moe = options.moe_experts if options is not None else "replicated"
    split = tp if moe == "replicated" else tp * pcp
    served = SimpleNamespace(model_config=like, speculative_config=speculative)  # the MTP drafter's experts too
    need = whole_experts_bytes(served, split)
    if need is None:
        return [Check(NOTE, f"experts: no memory estimate for quantization={like.quantization!r}; make sure "
                            f"they fit, or pass {SHARDED}")]
    held = (f"moe_experts={moe!r}: {gib(need)} of experts per GPU ({experts_storage(like)[0]}, "
            f"split over {'tp' if moe == 'replicated' else 'tp x pcp'} = {split})")
    if moe != "replicated" or pcp == 1:
        return [Check(OK, held)]  # vLLM's own sharding; the plugin's check is for whole experts
    if not gpus:
        return [Check(NOTE, f"{held}; no GPU to compare with")]
    total = min(g.total_memory for g in gpus[:tp * pcp])
    allowed = 0.8 * utilization * total
    if need <= allowed:
        return [Check(OK, f"{held}, within the {gib(allowed)} the startup check allows (80% of "
                          f"gpu_memory_utilization={utilization} x {gib(total)})")]
    more_tp = whole_experts_bytes(served, 2 * tp)
    sharded = whole_experts_bytes(served, tp * pcp)
    return [Check(PROBLEM, f"{held}, more than the {gib(allowed)} the startup check allows (80% of "
                           f"gpu_memory_utilization={utilization} x {gib(total)})",
                  f"pass {SHARDED} ({gib(sharded)} per GPU), or raise tp (-tp {2 * tp}: {gib(more_tp)})")]


# ----------------------------------------------------------------------------- the report
def run(model: str | None, tp: int = 1, pcp: int = 2, additional_config: str | None = None,
        gpu_memory_utilization: float = 0.9, speculative_config: str | None = None,
        enable_prefix_caching: bool = False, out: Callable[[str], None] = print) -> int:
    """Print every check; 0 when none is a problem, else 1."""
    checks = [check_vllm(), check_plugin()]
    sizes = [Check(PROBLEM, f"-{name} {n}: must be 1 or more", f"pass -{name} 1 or more")
             for name, n in (("tp", tp), ("pcp", pcp)) if n < 1]
    if not 0 < gpu_memory_utilization <= 1:
        sizes.append(Check(PROBLEM, f"--gpu-memory-utilization {gpu_memory_utilization}: must be in (0, 1]",
                           "pass a fraction such as 0.9"))
    option_checks, additional = check_options(additional_config)
    spec_checks, spec = read_json(speculative_config, "--speculative-config",
                                  '{"method": "mtp", "num_speculative_tokens": 3}')
    if sizes:  # the GPU and memory checks need sane sizes
        return report(checks + sizes + option_checks + spec_checks, out)
    try:
        gpus = visible_gpus()
    except Exception as e:  # noqa: BLE001 - a broken driver is itself the answer
        gpus = []
        checks.append(Check(PROBLEM, f"GPUs could not be queried ({type(e).__name__}: {e})",
                            "check the NVIDIA driver: nvidia-smi should list the GPUs"))
    else:
        checks += check_gpus(gpus, tp, pcp)
    checks += option_checks + spec_checks
    config, like, options = None, None, None
    if model is not None:
        try:
            config = read_model_config(model)
        except (OSError, ValueError) as e:
            checks.append(Check(PROBLEM, f"model: {e}", "pass the checkpoint's folder (it holds config.json)"))
    unreadable = "model: its config.json cannot be read as a Qwen3.6 config ({}: {})"
    if additional is not None and spec is not None:
        like = engine_config_like(config, tp, pcp, additional, spec, enable_prefix_caching, gpu_memory_utilization)
        try:
            checks += check_engine(like)
        except (AttributeError, KeyError, TypeError) as e:
            checks.append(Check(PROBLEM, unreadable.format(type(e).__name__, e), "pass a Qwen3.6 / Qwen3.5 checkpoint"))
            config = None
        try:
            options = pcp_config_of(like)
        except (ValueError, TypeError):
            pass  # a problem line already
        note = below_split_floor(options, pcp) if options is not None else None
        if note is not None:
            checks.append(Check(NOTE, note.removeprefix("qwen36_pcp: ")))
    if model is None:
        checks.append(Check(NOTE, "model checks skipped: no MODEL given (a checkpoint folder or a preset)"))
    elif config is not None:
        try:
            checks += check_model(config, tp, pcp, options, gpus, gpu_memory_utilization,
                                  like.speculative_config if like is not None else None)
        except (AttributeError, KeyError, TypeError) as e:
            checks.append(Check(PROBLEM, unreadable.format(type(e).__name__, e), "pass a Qwen3.6 / Qwen3.5 checkpoint"))
    if report(checks, out):
        return 1
    # a preset names a config, not a checkpoint vLLM could load
    path = model if model is not None and (os.path.exists(model) or "/" in model) else "MODEL_DIR"
    serve = f"vllm serve {path} --hf-overrides '{{\"architectures\": [\"{ARCHITECTURE}\"]}}'"
    extra = f" --additional-config '{additional_config}'" if additional_config else ""
    extra += f" --speculative-config '{speculative_config}'" if speculative_config else ""
    extra += " --enable-prefix-caching" if enable_prefix_caching else ""
    out(f"no problem found; start it with: {serve} -tp {tp} -pcp {pcp}{extra}")
    return 0


def report(checks: list[Check], out: Callable[[str], None]) -> int:
    """Print the checks, each problem with what to change; 1 if any is a problem, else 0."""
    for c in checks:
        out(f"{c.status:8s}{c.text}")
        if c.fix and c.status == PROBLEM:
            out(f"{'':8s}-> {c.fix}")
    problems = sum(c.status == PROBLEM for c in checks)
    if problems:
        out(f"{problems} problem(s) found")
    return 1 if problems else 0
