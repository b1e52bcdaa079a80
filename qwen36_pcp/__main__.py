# SPDX-License-Identifier: Apache-2.0
"""``python -m qwen36_pcp SUBCOMMAND``: the plugin's command line (vLLM loads the plugin by itself;
this is for the user around it).

    python -m qwen36_pcp doctor [MODEL] [--pcp N] [--tp N] [--additional-config JSON]
                                [--speculative-config JSON] [--enable-prefix-caching]
"""

from __future__ import annotations

import argparse
import sys


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m qwen36_pcp",
                                 description="Prefill Context Parallel for Qwen3.6 hybrid models on vLLM.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    doc = sub.add_parser(
        "doctor", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="check a setup (vLLM, plugin, GPUs, options, expert memory) without starting an engine",
        description="Check a PCP setup without starting an engine: the vLLM version, the plugin's "
                    "registration, the GPUs, the options and whether the MoE experts fit per GPU, and "
                    "everything the engine's startup check would refuse (the same check, on the arguments "
                    "below and the checkpoint's config.json). One line per check; exit code 0 when nothing "
                    "is a problem, 1 otherwise.")
    doc.add_argument("model", nargs="?", metavar="MODEL",
                     help="checkpoint folder (holds config.json), a Hugging Face name already downloaded, "
                          "or a preset of qwen36_pcp.tools.make_checkpoint (e.g. qwen3.6-35b-a3b); "
                          "left out: the model checks are skipped")
    doc.add_argument("--pcp", "-pcp", "--prefill-context-parallel-size", type=int, default=2, metavar="N",
                     help="prefill context parallel size")
    doc.add_argument("--tp", "-tp", "--tensor-parallel-size", type=int, default=1, metavar="N",
                     help="tensor parallel size")
    doc.add_argument("--additional-config", metavar="JSON",
                     help='vLLM\'s additional_config as JSON, e.g. \'{"qwen36_pcp": {"moe_experts": "sharded"}}\'')
    doc.add_argument("--speculative-config", metavar="JSON",
                     help='vLLM\'s speculative_config as JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\'')
    doc.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                     help="vLLM's enable_prefix_caching (off by default for hybrid models in vLLM 0.20.2)")
    doc.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                     help="vLLM's gpu_memory_utilization, which the expert memory check scales")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.command == "doctor":
        from .doctor import run

        return run(args.model, tp=args.tp, pcp=args.pcp, additional_config=args.additional_config,
                   gpu_memory_utilization=args.gpu_memory_utilization,
                   speculative_config=args.speculative_config, enable_prefix_caching=args.enable_prefix_caching)
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
