# SPDX-License-Identifier: Apache-2.0
"""What is refused before an engine's config exists: bad plugin options, no GPU, too few GPUs, PCP across
nodes as vLLM cannot lay it out, on the command line (``vllm serve``), in ``EngineArgs`` and in the
examples (``refusal_here``). vLLM's own checks fail there in words that name neither PCP nor the fix;
these say both, as a ``refusal.Refusal`` (an uncaught one ends the program with its message alone).
The checks of a built config are ``checks``'."""

from __future__ import annotations

import json
import logging
import os

from vllm.utils.argparse_utils import FlexibleArgumentParser

from .config import ARCHITECTURES, OPTIONS_KEY, PCPConfig, below_split_floor, misspelled_option_keys
from .refusal import ConfigRefusal, MachineRefusal, Refusal

logger = logging.getLogger("vllm.qwen36_pcp")  # under vLLM's logger, so that it shows in the engine's log


def option_error(e: Exception) -> str:
    """The message of a bad option's ``ValueError`` / ``TypeError``, naming the plugin."""
    return str(e) if str(e).startswith("qwen36_pcp") else f"qwen36_pcp: {e}"


def visible_gpu_count() -> int:
    """The GPUs vLLM's platform sees in this process (CUDA_VISIBLE_DEVICES applies); 0 without any."""
    try:
        from vllm.platforms import current_platform

        return int(current_platform.device_count() or 0)
    except Exception:  # noqa: BLE001 - a platform without the notion: nothing to count
        return 0


def few_gpus_problem(count: int, tp: int, pcp: int, need: int) -> str:
    return (f"{count} visible GPU(s) for tensor_parallel_size={tp} x prefill_context_parallel_size={pcp} = "
            f"{need} ranks on this node (each rank needs a GPU of its own; check CUDA_VISIBLE_DEVICES)")


def device_type() -> str:
    """vLLM's platform's device type ("" without one)."""
    from vllm import platforms  # resolved when asked: the platform is chosen lazily

    return getattr(platforms.current_platform, "device_type", "") or ""


def options_message(additional_config, pcp: int) -> str | None:
    """The plugin options' error, or None; warns about a misspelled options key and a
    ``min_split_tokens`` under the split floor."""
    if isinstance(additional_config, str):  # vLLM parses it later; a JSON string is read here alike
        try:
            additional_config = json.loads(additional_config)
        except ValueError:
            return None  # vLLM's own message
    if not isinstance(additional_config, dict):
        return None
    for key in misspelled_option_keys(additional_config):
        logger.warning("qwen36_pcp: additional_config key %r is not %r: its options are ignored", key,
                       OPTIONS_KEY)
    try:
        config = PCPConfig.from_additional_config(additional_config)
    except (ValueError, TypeError) as e:
        return option_error(e)
    note = below_split_floor(config, pcp)
    if note is not None:
        logger.warning(note)
    return None


def before_config_error(engine_args) -> Refusal | None:
    """What refuses our model's engine arguments before vLLM builds a config (``refusal_before_config``)."""
    return refusal_before_config(engine_args.prefill_context_parallel_size, engine_args.tensor_parallel_size,
                                 engine_args.additional_config, pp=engine_args.pipeline_parallel_size,
                                 dp=engine_args.data_parallel_size, nnodes=engine_args.nnodes)


def refusal_before_config(pcp: int, tp: int = 1, additional_config=None, *, pp: int = 1, dp: int = 1,
                          nnodes: int = 1) -> Refusal | None:
    """What refuses our model before vLLM builds a config, in the order a user fixes it: the plugin's
    options (on any machine), a GPU (vLLM's own words there name neither PCP nor the fix), then PCP
    across nodes (vLLM's bare assertion leaves PCP out)."""
    message = options_message(additional_config, pcp)
    if message is not None:
        return ConfigRefusal(message)
    if pcp <= 1:
        return None
    message = no_gpu_message(pcp, tp, device_type())
    if message is not None:
        return MachineRefusal(message)
    message = nnodes_message(tp, pp, dp, pcp, nnodes)
    return None if message is None else ConfigRefusal(message)


def refusal_here(pcp: int, tp: int = 1, additional_config=None, *, pp: int = 1, dp: int = 1,
                 nnodes: int = 1) -> Refusal | None:
    """``refusal_before_config`` for a start on this machine (vLLM's multiprocessing executor, as the
    examples start it), and this node's share of the ranks against its visible GPUs, at any pcp: what
    an example checks before it writes a checkpoint or imports vLLM's engine."""
    refusal = refusal_before_config(pcp, tp, additional_config, pp=pp, dp=dp, nnodes=nnodes)
    if refusal is not None:
        return refusal
    need = -(-tp * pp * dp * pcp // max(nnodes, 1))
    kind = device_type()
    if kind != "cuda":
        return MachineRefusal(no_gpu_message(pcp, tp, kind, any_pcp=True))
    count = visible_gpu_count()
    if count < need:
        return MachineRefusal(f"qwen36_pcp: {few_gpus_problem(count, tp, pcp, need)}.")
    return None


# ------------------------------------------------------------------------------ no GPU at all
def no_gpu_message(pcp: int, tp: int, device_type: str, any_pcp: bool = False) -> str | None:
    """The startup error for PCP where vLLM found no NVIDIA GPU platform, or None (pcp == 1 unless
    ``any_pcp``, or a CUDA platform: from there on the config checks and ``visible_gpu_problems``
    judge). vLLM's own words there name neither the GPUs nor PCP ("Device string must not be empty",
    "Failed to infer device type"); ``before_config_error`` returns this one instead, for our model only."""
    if (pcp <= 1 and not any_pcp) or device_type == "cuda":
        return None
    if device_type:
        where = f"this vLLM runs on its {device_type!r} platform, not on NVIDIA GPUs"
    else:
        where = f"no GPU is visible (CUDA not available: {_nvidia_driver_status()})"
    gpus = f"{pcp * tp} NVIDIA GPU{'s' if pcp * tp > 1 else ''}"
    return (f"qwen36_pcp: prefill_context_parallel_size={pcp} x tensor_parallel_size={tp} needs {gpus} (one "
            f"per rank); {where}. Start it on a machine where nvidia-smi lists {gpus.replace(' NVIDIA', '')}.")


def _nvidia_driver_status() -> str:
    """What NVML, which vLLM's CUDA platform detection asks, says about this machine."""
    try:
        from vllm.utils.import_utils import import_pynvml

        nvml = import_pynvml()
        nvml.nvmlInit()
        try:
            return f"the NVIDIA driver reports {nvml.nvmlDeviceGetCount()} GPU(s)"
        finally:
            nvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 - any failure here means: no usable driver
        return f"no NVIDIA driver found, {e}"


# ------------------------------------------------------------------------- nodes and ranks
def nnodes_message(tp: int, pp: int, dp: int, pcp: int, nnodes: int) -> str | None:
    """The startup error for PCP over nodes that vLLM 0.20.2's argument check refuses, or None.

    ``EngineArgs.create_engine_config`` asserts that tp x pp x dp (PCP left out) divides by nnodes, so
    ``-tp 1 -pcp 2 --nnodes 2`` dies with a bare "world_size=1 must be divisible by nnodes=2", which
    names neither PCP nor the way out; ``before_config_error`` returns this one
    before it, for our model only. tp a multiple of nnodes always passes that check; where nnodes also
    divides pcp, each node then holds whole TP groups and only PCP crosses nodes (docs/multi-node.md)."""
    counted = tp * pp * dp
    if pcp <= 1 or nnodes <= 1 or counted % nnodes == 0:
        return None
    tp_fix = -(-tp // nnodes) * nnodes
    if pcp % nnodes == 0:
        how = "keep TP inside a node: make tensor_parallel_size a multiple of nnodes"
        then = (f"each node then runs {tp_fix * pp * dp * pcp // nnodes} ranks, whole TP groups, and only PCP "
                "crosses nodes")
    else:
        how = "make tensor_parallel_size a multiple of nnodes"
        then = (f"TP groups then span nodes, as nnodes={nnodes} does not divide "
                f"prefill_context_parallel_size={pcp}")
    return (f"qwen36_pcp: vLLM 0.20.2 needs tensor_parallel_size x pipeline_parallel_size x "
            f"data_parallel_size to be a multiple of nnodes (it leaves prefill_context_parallel_size out "
            f"of that check): {tp} x {pp} x {dp} = {counted} is not a multiple of nnodes={nnodes} "
            f"(prefill_context_parallel_size={pcp}). To run PCP across nodes, {how}, "
            f"e.g. -tp {tp_fix} -pcp {pcp} --nnodes {nnodes} ({then}); see docs/multi-node.md.")


def names_our_architecture(model, hf_overrides) -> bool:
    """Whether engine arguments ask for our model before vLLM has read the checkpoint: ``hf_overrides``
    (a dict, or its JSON text from a command line) names it, or else a local checkpoint's
    config.json does (a callable ``hf_overrides`` or a remote checkpoint count as not ours)."""
    if isinstance(hf_overrides, str):
        try:
            hf_overrides = json.loads(hf_overrides)
        except ValueError:
            hf_overrides = None
    archs = hf_overrides.get("architectures") if isinstance(hf_overrides, dict) else None
    if archs is None and model:
        try:
            with open(os.path.join(str(model), "config.json"), encoding="utf-8") as f:
                archs = json.load(f).get("architectures")
        except (OSError, ValueError, AttributeError):
            archs = None
    return isinstance(archs, (list, tuple)) and any(a in ARCHITECTURES for a in archs)


def cli_before_config_error(argv: list[str], device_type: str) -> Refusal | None:
    """``before_config_error`` for a command line such as ``vllm serve MODEL --hf-overrides ... -pcp 2``
    on a machine where vLLM fails before parsing it (no GPU): the plugin options' error, else
    ``no_gpu_message``; None if it does not ask for our model at pcp > 1 or cannot be read."""
    args = _read_command_line(argv)
    if args is None:
        return None
    if args.additional_config is not None:
        message = options_message(args.additional_config, args.prefill_context_parallel_size)
        if message is not None:
            return ConfigRefusal(message)
    message = no_gpu_message(args.prefill_context_parallel_size, args.tensor_parallel_size, device_type)
    return None if message is None else MachineRefusal(message)


def command_line_refusal(argv: list[str]) -> Refusal | None:
    """``refusal_here`` for a ``vllm serve`` command line (its words after ``vllm``), or None if it does
    not ask for our model: what examples/serve.sh checks before it starts vLLM, whose own start on a
    machine without a GPU prints a screen of log lines before the plugin's message."""
    args = _read_command_line(argv)
    if args is None:
        return None
    return refusal_here(args.prefill_context_parallel_size, args.tensor_parallel_size, args.additional_config,
                        pp=args.pipeline_parallel_size, dp=args.data_parallel_size, nnodes=args.nnodes)


def cli_no_gpu_message(argv: list[str], device_type: str) -> str | None:
    """``no_gpu_message`` for a command line, or None (see ``cli_before_config_error``)."""
    args = _read_command_line(argv)
    if args is None:
        return None
    return no_gpu_message(args.prefill_context_parallel_size, args.tensor_parallel_size, device_type)


def _read_command_line(argv: list[str]):
    """What a command line asks of our model, read with vLLM's own argument rules (dashes or
    underscores, ``--model``, ``--config`` files, dotted JSON keys); None if it does not name our model
    or cannot be read."""
    class Reader(FlexibleArgumentParser):
        def parse_known_args(self, args=None, namespace=None):
            return super().parse_known_args(args, namespace)[0], []  # the rest is vLLM's to judge

        def error(self, message):
            raise ValueError(message)

    reader = Reader(add_help=False, allow_abbrev=False)
    reader.add_argument("subcommand", nargs="?")
    reader.add_argument("model_tag", nargs="?")
    reader.add_argument("--model")
    reader.add_argument("--hf-overrides")
    reader.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    reader.add_argument("--prefill-context-parallel-size", "-pcp", type=int, default=1)
    reader.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    reader.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    reader.add_argument("--nnodes", "-n", type=int, default=1)
    reader.add_argument("--additional-config")
    try:
        args = reader.parse_args(list(argv))
    except (Exception, SystemExit):  # noqa: BLE001 - unreadable: vLLM's own message stands
        return None
    return args if names_our_architecture(args.model or args.model_tag, args.hf_overrides) else None
