"""Offline generation with Prefill Context Parallel.

    python -m qwen36_pcp.tools.make_checkpoint /tmp/qwen36-tiny --preset tiny
    python examples/offline_generate.py /tmp/qwen36-tiny --pcp 2      # needs 2 GPUs

The plugin is found through vLLM's ``vllm.general_plugins`` entry point: no import needed.
"""

import argparse

from vllm import LLM, SamplingParams


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--pcp", type=int, default=2, help="prefill_context_parallel_size")
    parser.add_argument("--prompt-tokens", type=int, default=20000)
    args = parser.parse_args()

    llm = LLM(
        model=args.model,
        hf_overrides={"architectures": ["Qwen3_6ForCausalLM"]},
        prefill_context_parallel_size=args.pcp,
        gdn_prefill_backend="triton",  # FlashInfer's GDN prefill is not needed (nor always installed)
        max_model_len=args.prompt_tokens + 1024,
        # optional: additional_config={"qwen36_pcp": {"layout": "zigzag", "gdn_mode": "state_passing",
        #                                             "min_split_tokens": 512}},
    )
    long_doc = "The quick brown fox jumps over the lazy dog. " * (args.prompt_tokens // 10)
    prompts = [long_doc[: 4 * args.prompt_tokens] + "\nSummary:", "Hello, my name is"]
    for out in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32)):
        print(f"{len(out.prompt_token_ids)} prompt tokens -> {out.outputs[0].text!r}")


if __name__ == "__main__":
    main()
