"""Is vLLM itself reproducible on the parity prompts? (diagnostic, 2 GPUs)

    python -m tests.gpu.probe_determinism

    python -m tests.gpu.probe_determinism attention

    python -m tests.gpu.probe_determinism processes [--backend B] [--models ours stock] [--preset P]
        [--llm-kwargs '{"async_scheduling": false}']

Runs our class and vLLM's Qwen3_5MoeForConditionalGeneration on the 4097- and 16384-token parity
prompts, each prompt twice in one engine, in two engine processes per model, and prints max |dlogprob|
for every pair (same process, other process, other model). ``attention``: the 4097-token prompt three
times in one engine per attention backend. ``processes``: both models in two engine processes each
(side by side, one per GPU) on one backend (default TRITON_ATTN), prompts of 1000 to 16384 tokens,
each twice in a row: which pairs (same process, other process, other model) agree to the bit.
(vLLM's VLLM_BATCH_INVARIANT=1 mode refuses GDN models.) Results: benchmarks/results/
2026-11-29-h200x2/determinism/ and 2026-11-30-h200x2/determinism_processes/.
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


def main():
    ckpt, prompts = parity_prompts()
    ours, stock = model_kwargs(ckpt)
    batches = [[prompts[2]], [prompts[2]], [prompts[3]], [prompts[3]]]
    outs = _run({f"det_{model}_{run}": ({"llm": llm, "batches": batches}, 1)
                 for run in "ab" for model, llm in (("ours", ours), ("stock", stock))})
    report = {}

    def pair(label, x, i, y, j):
        if x in outs and y in outs:
            c = e2e.compare([outs[x][i]], [outs[y][j]])
            report[label] = c
            print(f"{label:58s} max|dlogprob|={c['max_logprob_diff']:.4g} diverged={c['diverged_at']}")

    for k, length in ((0, 4097), (2, 16384)):
        for m in ("ours", "stock"):
            pair(f"{length}: {m} same process, repeat", f"det_{m}_a", k, f"det_{m}_a", k + 1)
        pair(f"{length}: ours process a vs b", "det_ours_a", k, "det_ours_b", k)
        pair(f"{length}: stock process a vs b", "det_stock_a", k, "det_stock_b", k)
        pair(f"{length}: ours a vs stock a", "det_ours_a", k, "det_stock_a", k)
        pair(f"{length}: ours b vs stock b", "det_ours_b", k, "det_stock_b", k)
    e2e.save("probe_determinism", report)
    return 0


def by_attention_backend():
    """The 4097-token prompt three times in one engine, per attention backend: which part repeats."""
    ckpt, prompts = parity_prompts()
    jobs = {f"det_{backend}": ({"llm": model_kwargs(ckpt, attention_backend=backend)[0],
                                "batches": [[prompts[2]]] * 3}, 1)
            for backend in ("FLASH_ATTN", "TRITON_ATTN")}
    for name, o in _run(jobs).items():
        for i in (1, 2):
            c = e2e.compare([o[0]], [o[i]])
            print(f"{name}: run 0 vs run {i}: max|dlogprob|={c['max_logprob_diff']:.4g} "
                  f"diverged={c['diverged_at']} identical={o[0] == o[i]}")
    return 0


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
    parser.add_argument("mode", nargs="?", default="pairs", choices=("pairs", "attention", "processes"))
    parser.add_argument("--backend", default="TRITON_ATTN", help="processes: attention backend")
    parser.add_argument("--models", nargs="+", default=["ours", "stock"], choices=("ours", "stock"))
    parser.add_argument("--preset", default="tiny", help="processes: checkpoint preset (tiny, tiny-dense)")
    parser.add_argument("--llm-kwargs", type=json.loads, default={}, help="processes: more LLM(...) kwargs (JSON)")
    args = parser.parse_args()
    if args.mode == "attention":
        sys.exit(by_attention_backend())
    if args.mode == "processes":
        sys.exit(across_processes(args.backend, args.models, args.preset, args.llm_kwargs))
    sys.exit(main())
