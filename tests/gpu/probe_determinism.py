"""Is vLLM itself reproducible on the parity prompts? (diagnostic, 2 GPUs)

    python -m tests.gpu.probe_determinism

    python -m tests.gpu.probe_determinism attention

Runs our class and vLLM's Qwen3_5MoeForConditionalGeneration on the 4097- and 16384-token parity
prompts, each prompt twice in one engine, in two engine processes per model, and prints max |dlogprob|
for every pair (same process, other process, other model). ``attention``: the 4097-token prompt three
times in one engine per attention backend. (vLLM's VLLM_BATCH_INVARIANT=1 mode refuses GDN models.)
Results of 2026-11-29: benchmarks/results/2026-11-29-h200x2/determinism/.
"""

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


if __name__ == "__main__":
    sys.exit(by_attention_backend() if sys.argv[1:] == ["attention"] else main())
