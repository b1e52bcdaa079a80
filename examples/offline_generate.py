# SPDX-License-Identifier: Apache-2.0
"""Offline generation with prefill context parallel: a long prompt split over N GPUs.

    python examples/offline_generate.py --pcp 2                  # a tiny random checkpoint, made here
    python examples/offline_generate.py MODEL_DIR --pcp 2 --prompt-tokens 100000

Without MODEL_DIR it writes the tiny random-weight checkpoint (real Qwen3.6 layout) to
``--checkpoint-dir`` first. The plugin is found through vLLM's ``vllm.general_plugins`` entry point:
nothing to import for it to work; the one import from it here checks the GPUs and the options before
anything is written or the engine starts (one line and exit code 1 if they do not fit). Needs as many
GPUs as ``--pcp`` (Hopper or newer: flash-attention 3).
"""

import argparse
import json
import sys
from pathlib import Path


def main():
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("model", nargs="?", help="checkpoint directory (default: a tiny random one)")
    parser.add_argument("--pcp", type=int, default=2, help="prefill_context_parallel_size")
    parser.add_argument("--prompt-tokens", type=int, default=20000, help="about this many prompt tokens")
    parser.add_argument("--checkpoint-dir", default="/tmp/qwen36-tiny", help="where the tiny checkpoint goes")
    parser.add_argument("--llm-kwargs", type=json.loads, default={},
                        help='further LLM(...) arguments as JSON, e.g. \'{"enforce_eager": true}\'')
    args = parser.parse_args()

    from qwen36_pcp.early_refusals import refusal_here

    kw = args.llm_kwargs
    refusal = refusal_here(args.pcp, kw.get("tensor_parallel_size", 1), kw.get("additional_config"),
                           pp=kw.get("pipeline_parallel_size", 1), dp=kw.get("data_parallel_size", 1),
                           nnodes=kw.get("nnodes", 1))
    if refusal is not None:
        sys.exit(str(refusal))  # its message on stderr, exit code 1

    model = args.model
    if model is None:
        from qwen36_pcp.tools.make_checkpoint import make_checkpoint

        if not (Path(args.checkpoint_dir) / "model.safetensors").exists():
            make_checkpoint(args.checkpoint_dir, preset="tiny", seed=0)
        model = args.checkpoint_dir

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        hf_overrides={"architectures": ["Qwen3_6ForCausalLM"]},
        prefill_context_parallel_size=args.pcp,
        max_model_len=args.prompt_tokens + 1024,
        # options: additional_config={"qwen36_pcp": {"gdn_mode": "relay", "min_split_tokens": 4096}}
        **args.llm_kwargs,
    )
    tokenizer = llm.get_tokenizer()
    sentence = "The quick brown fox jumps over the lazy dog. "
    repeats = max(1, args.prompt_tokens // len(tokenizer.encode(sentence)))
    prompts = [sentence * repeats + "\nSummary:", "Hello, my name is"]
    for out in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32)):
        print(f"{len(out.prompt_token_ids)} prompt tokens -> {out.outputs[0].text!r}")


if __name__ == "__main__":
    main()
