"""Is vLLM itself reproducible on long prompts? (diagnostic, 1 or 2 GPUs)

    python -m tests.gpu.probe_determinism [--backend B] [--models ours stock] [--preset P]
        [--llm-kwargs '{"async_scheduling": false}']

Runs our class and/or vLLM's Qwen3_5MoeForConditionalGeneration in two engine processes each (side by
side, one per GPU, or one after the other on one GPU) on one attention backend (default
TRITON_ATTN), prompts of 1000 to 16384 tokens, each twice in a row, and prints which pairs (same
process, other process, other model) agree to the bit and max |dlogprob| otherwise. (vLLM's
VLLM_BATCH_INVARIANT=1 mode refuses GDN models.)

The engines run without vLLM 0.20.2's GDN kernel race (``e2e.CHILD_ENV``): every pair then agrees to
the bit (benchmarks/results/2026-12-01-h200/determinism_root_cause/). With
QWEN36_PCP_DETERMINISTIC_GDN=0 it shows vLLM as it is: up to 0.53 apart past ~2k tokens
(2026-11-30-h200x2/determinism_processes/). probe_layer_determinism and probe_gdn_kernels found why.
"""

import argparse
import json
import sys

from . import e2e
from .test_model_parity import model_kwargs, parity_prompts


def _run(jobs: dict) -> dict:
    """{name: outputs} of the jobs that finished; a failed one prints the tail of its error."""
    outs = {}
    for name, r in e2e.engines(jobs).items():
        if isinstance(r, BaseException):
            print(f"{name}: failed: {str(r)[-1500:]}")
        else:
            outs[name] = e2e.outputs(r)
    return outs


def across_processes(backend: str, models: list[str], preset: str, llm_kwargs: dict):
    """Each prompt twice in a row in each process: same process (repeat) and other process pairs."""
    ckpt, prompts = parity_prompts(preset)
    extra = e2e.prompt_ids((2048, 2049, 3000), vocab=e2e.vocab_size(ckpt), seed=2)
    chosen = [prompts[1], *extra, prompts[2], prompts[3]]
    batches = [[p] for p in chosen for _ in range(2)]
    ours, stock = model_kwargs(ckpt, attention_backend=backend, **llm_kwargs)
    outs = _run({f"proc_{model}_{run}": ({"llm": llm, "batches": batches}, 1)
                 for model, llm in (("ours", ours), ("stock", stock)) if model in models for run in "ab"})
    report = {"backend": backend, "preset": preset, "llm_kwargs": llm_kwargs,
              "lengths": [len(p) for p in chosen]}
    pairs = [(f"{m} {r} repeat", f"proc_{m}_{r}", 0, f"proc_{m}_{r}", 1) for m in models for r in "ab"]
    pairs += [("ours a vs ours b", "proc_ours_a", 0, "proc_ours_b", 0),
              ("stock a vs stock b", "proc_stock_a", 0, "proc_stock_b", 0),
              ("ours a vs stock a", "proc_ours_a", 0, "proc_stock_a", 0),
              ("ours b vs stock b", "proc_ours_b", 0, "proc_stock_b", 0)]
    for label, x, i, y, j in pairs:
        if x in outs and y in outs:
            rows = []
            for k, p in enumerate(chosen):
                a, b = outs[x][2 * k + i], outs[y][2 * k + j]
                c = e2e.compare([a], [b])
                rows.append({"tokens": len(p), "identical": a == b, **c})
                print(f"{backend} {label:20s} {len(p):6d} tokens: identical={a == b} "
                      f"max|dlogprob|={c['max_logprob_diff']:.4g} diverged={c['diverged_at']}")
            report[label] = rows
    e2e.save(f"probe_processes_{preset}_{backend}_{'_'.join(models)}", report)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="TRITON_ATTN", help="attention backend")
    parser.add_argument("--models", nargs="+", default=["ours", "stock"], choices=("ours", "stock"))
    parser.add_argument("--preset", default="tiny", help="checkpoint preset (tiny, tiny-dense)")
    parser.add_argument("--llm-kwargs", type=json.loads, default={}, help="more LLM(...) kwargs (JSON)")
    args = parser.parse_args()
    sys.exit(across_processes(args.backend, args.models, args.preset, args.llm_kwargs))
