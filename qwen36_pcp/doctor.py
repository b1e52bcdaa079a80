"""``python -m qwen36_pcp doctor``: check a PCP setup before starting an engine.

An engine start takes minutes (weights, compilation) and a wrong setup shows itself only at its end,
in vLLM's words. The doctor answers the usual questions in seconds, without building an engine and
without a network: the vLLM version, whether vLLM will load the plugin, the GPUs, the options, and
whether the MoE experts fit per GPU. It prints one line per check and, for a problem, what to change;
the exit code is 0 when nothing is a problem. "note" lines (no GPU to compare with, an unverified GPU
generation) inform and do not fail.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

from . import SUPPORTED_VLLM_VERSION, vllm_version
from .config import ARCHITECTURE, PCPConfig, below_split_floor, misspelled_option_keys

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
def check_options(text: str | None) -> tuple[list[Check], PCPConfig | None]:
    """The plugin's options as its startup check reads them; vLLM passes other additional_config keys
    on silently, so a misspelled ``qwen36_pcp`` key would leave the options unused without a word."""
    try:
        additional = json.loads(text) if text else {}
    except ValueError as e:
        return [Check(PROBLEM, f"--additional-config is not JSON: {e}",
                      'quote it for the shell: --additional-config \'{"qwen36_pcp": {...}}\'')], None
    if not isinstance(additional, dict):
        return [Check(PROBLEM, "--additional-config must be a JSON object",
                      'pass --additional-config \'{"qwen36_pcp": {...}}\'')], None
    checks = [Check(PROBLEM, f"additional_config key {key!r} looks like a misspelling of 'qwen36_pcp'; vLLM "
                             "ignores unknown keys, so these options would not be used",
                    f"rename {key!r} to 'qwen36_pcp'") for key in misspelled_option_keys(additional)]
    options = additional.get("qwen36_pcp")
    if options is not None and not isinstance(options, dict):
        return checks + [Check(PROBLEM, f"additional_config['qwen36_pcp'] must be a JSON object, got "
                                        f"{options!r}", 'pass {"qwen36_pcp": {"moe_experts": "sharded"}}')], None
    try:
        config = PCPConfig.from_additional_config(additional)
    except (ValueError, TypeError) as e:
        return checks + [Check(PROBLEM, f"options: {e}", "fix the qwen36_pcp options as the message says")], None
    return checks + [Check(OK, f"options: {config}")], config


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
                utilization: float) -> list[Check]:
    """PCP here is for Gated DeltaNet + full-attention hybrids; with ``moe_experts="replicated"`` (the
    default) every expert is whole on every PCP rank, split over tp only, and the engine's startup
    check refuses experts above 80% of the memory gpu_memory_utilization allows."""
    from .expert_memory import experts_storage, whole_experts_bytes

    like = model_config_like(config)
    text = like.hf_text_config
    layer_types = list(getattr(text, "layer_types", None) or [])
    if pcp > 1 and not {"linear_attention", "full_attention"} <= set(layer_types):
        return [Check(PROBLEM, f"not a hybrid model (layer_types={sorted(set(layer_types))}): PCP here is "
                               "for Gated DeltaNet + full-attention models such as Qwen3.6",
                      "use a Qwen3.6 / Qwen3.5 hybrid checkpoint, or -pcp 1")]
    if not getattr(text, "num_experts", 0):
        return [Check(OK, "experts: none (a dense model)")]
    moe = options.moe_experts if options is not None else "replicated"
    split = tp if moe == "replicated" else tp * pcp
    need = whole_experts_bytes(SimpleNamespace(model_config=like), split)
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
    more_tp = whole_experts_bytes(SimpleNamespace(model_config=like), 2 * tp)
    sharded = whole_experts_bytes(SimpleNamespace(model_config=like), tp * pcp)
    return [Check(PROBLEM, f"{held}, more than the {gib(allowed)} the startup check allows (80% of "
                           f"gpu_memory_utilization={utilization} x {gib(total)})",
                  f"pass {SHARDED} ({gib(sharded)} per GPU), or raise tp (-tp {2 * tp}: {gib(more_tp)})")]


# ----------------------------------------------------------------------------- the report
def run(model: str | None, tp: int = 1, pcp: int = 2, additional_config: str | None = None,
        gpu_memory_utilization: float = 0.9, out: Callable[[str], None] = print) -> int:
    """Print every check; 0 when none is a problem, else 1."""
    checks = [check_vllm(), check_plugin()]
    sizes = [Check(PROBLEM, f"-{name} {n}: must be 1 or more", f"pass -{name} 1 or more")
             for name, n in (("tp", tp), ("pcp", pcp)) if n < 1]
    if not 0 < gpu_memory_utilization <= 1:
        sizes.append(Check(PROBLEM, f"--gpu-memory-utilization {gpu_memory_utilization}: must be in (0, 1]",
                           "pass a fraction such as 0.9"))
    option_checks, options = check_options(additional_config)
    if sizes:  # the GPU and memory checks need sane sizes
        return report(checks + sizes + option_checks, out)
    try:
        gpus = visible_gpus()
    except Exception as e:  # noqa: BLE001 - a broken driver is itself the answer
        gpus = []
        checks.append(Check(PROBLEM, f"GPUs could not be queried ({type(e).__name__}: {e})",
                            "check the NVIDIA driver: nvidia-smi should list the GPUs"))
    else:
        checks += check_gpus(gpus, tp, pcp)
    checks += option_checks
    note = below_split_floor(options, pcp) if options is not None else None
    if note is not None:
        checks.append(Check(NOTE, note.removeprefix("qwen36_pcp: ")))
    if model is None:
        checks.append(Check(NOTE, "model checks skipped: no MODEL given (a checkpoint folder or a preset)"))
    else:
        try:
            config = read_model_config(model)
        except (OSError, ValueError) as e:
            checks.append(Check(PROBLEM, f"model: {e}", "pass the checkpoint's folder (it holds config.json)"))
        else:
            try:
                checks += check_model(config, tp, pcp, options, gpus, gpu_memory_utilization)
            except (AttributeError, KeyError, TypeError) as e:
                checks.append(Check(PROBLEM, f"model: its config.json cannot be read as a Qwen3.6 config "
                                             f"({type(e).__name__}: {e})", "pass a Qwen3.6 / Qwen3.5 checkpoint"))
    if report(checks, out):
        return 1
    # a preset names a config, not a checkpoint vLLM could load
    path = model if model is not None and (os.path.exists(model) or "/" in model) else "MODEL_DIR"
    serve = f"vllm serve {path} --hf-overrides '{{\"architectures\": [\"{ARCHITECTURE}\"]}}'"
    extra = f" --additional-config '{additional_config}'" if additional_config else ""
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
