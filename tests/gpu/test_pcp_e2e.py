# SPDX-License-Identifier: Apache-2.0
"""Prefill context parallel end to end, every layout against its unsplit counterpart.

    python -m pytest -q -s tests/gpu/test_pcp_e2e.py     # one GPU is enough

Layouts: pcp=2, pcp=4, pcp=8 and pcp=2 with GDN state passing against pcp=1; tp=2 x pcp=2 against
tp=2 x pcp=1; tp=2 against pcp=1 is reported beside them (how far bf16 reordering alone moves the answers).
With fewer GPUs than an engine has ranks every engine runs on GPU 0 (``shared_gpu``: collectives
through host memory, a gather is a copy, so each engine computes what it computes on its own GPUs;
all-reduce sums are taken on the host, the same for both sides of tp=2 x pcp=2 vs tp=2).

Two engines per layout, tiny checkpoint, greedy, 32 tokens, top-5 logprobs:
- ``defaults``: vLLM's chunking, one batch of 1, 3, 1000, 4097, 20000 and 65536 tokens (case 1), one of
  520, 600, 700 and 900 tokens (short splits: NaN at pcp=8 before the split floor), then
  ``max_tokens=1`` on case 1's prompts, prompt logprobs of a 12000-token and a 3-token prompt (a split
  step gathers every row only for these), an abort mid-prefill, shutdown;
- ``chunked``: 2048-token chunks with prefix caching: 20000 tokens (case 2: ten continuations), a
  20000-token prefix twice with different suffixes, the second a cache hit (case 3), and four such
  prefixes at once (case 3, eight requests, four hits).
A case passes when vLLM's check_logprobs_close rule holds for every prompt and no logprob is NaN/Inf.
Bit for bit besides: every layout on case 1 (16384-token steps, long enough that flash-attention does
not split keys at pcp=1 either), and pcp=8 on the short splits (all below its split floor: unsplit).
"""

import pytest
import torch

from . import e2e

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

# layout -> (tensor_parallel_size, prefill_context_parallel_size, qwen36_pcp options)
LAYOUTS = {
    "pcp1": (1, 1, {}),
    "tp2": (2, 1, {}),
    "pcp2": (1, 2, {}),
    "pcp4": (1, 4, {}),
    "pcp8": (1, 8, {}),
    "tp2_pcp2": (2, 2, {}),
    "pcp2_state_passing": (1, 2, {"gdn_mode": "state_passing"}),
}
# PCP layout -> the layout it must match (the same TP, pcp=1); tp=2 vs pcp=1 is reported, not judged
REFERENCE = {"pcp2": "pcp1", "pcp4": "pcp1", "pcp8": "pcp1", "tp2_pcp2": "tp2", "pcp2_state_passing": "pcp1"}
BIT_FOR_BIT = {"case1_unequal_batch": ("pcp2", "pcp4", "pcp8", "tp2_pcp2"), "short_splits": ("pcp8",)}
ENGINES = {"defaults": ("case1_unequal_batch", "short_splits"),
           "chunked": ("case2_chunked_prefill", "case3_prefix_cache", "case3_four_prefixes")}
# case -> the engine's batches (indices of its runs) that make it
CASE_RUNS = {"case1_unequal_batch": ("defaults", [0]), "short_splits": ("defaults", [1]),
             "case2_chunked_prefill": ("chunked", [0]), "case3_prefix_cache": ("chunked", [1, 2]),
             "case3_four_prefixes": ("chunked", [3, 4])}
CASE1_LENGTHS = (1, 3, 1000, 4097, 20000, 65536)
SHORT_SPLIT_LENGTHS = (520, 600, 700, 900)
PROMPT_LOGPROBS_LENGTHS = (12000, 3)  # one step: the first split at every pcp, the second replicated
REPORT = {}


# the cases split prompts from 520 tokens up (the split machinery at its smallest), below the default
# min_split_tokens, which leaves prompts that short unsplit
SPLIT_FROM = {"min_split_tokens": 512}


def _parallel(layout):
    tp, pcp, options = LAYOUTS[layout]
    kw = dict(tensor_parallel_size=tp, prefill_context_parallel_size=pcp)
    if pcp > 1:
        kw["additional_config"] = {"qwen36_pcp": {**SPLIT_FROM, **options}}
    return kw, tp * pcp


def _engine_specs():
    """{engine: spec without the parallel settings} for the tiny checkpoint."""
    ckpt = e2e.checkpoint("tiny")
    vocab = e2e.vocab_size(ckpt)
    prefix = e2e.prompt_ids((20000,), vocab, seed=5)[0]
    a, b = e2e.prompt_ids((300, 700), vocab, seed=6)
    prefixes = e2e.prompt_ids((20000,) * 4, vocab, seed=7)
    a4, b4 = e2e.prompt_ids((300,) * 4, vocab, seed=8), e2e.prompt_ids((700,) * 4, vocab, seed=9)
    # the engine core in the engine's process: each batch's prompts all reach the scheduler before
    # its first step, so every layout cuts a batch into the same steps (vLLM's kernels are not
    # batch-invariant)
    return {
        "defaults": {
            "llm": e2e.base_llm_kwargs(ckpt, enforce_eager=True), "engine_core_in_process": True,
            "batches": [e2e.prompt_ids(CASE1_LENGTHS, vocab, seed=2),
                        e2e.prompt_ids(SHORT_SPLIT_LENGTHS, vocab, seed=10)],
            "actions": ["max_tokens_one", "prompt_logprobs", "abort_mid_prefill"],
            "abort_prompt": e2e.prompt_ids((30000,), vocab, seed=3)[0],
            "prompt_logprobs_prompts": e2e.prompt_ids(PROMPT_LOGPROBS_LENGTHS, vocab, seed=11),
        },
        "chunked": {
            "llm": e2e.base_llm_kwargs(ckpt, max_num_batched_tokens=2048, enable_prefix_caching=True,
                                       enforce_eager=True, max_model_len=21000),
            "engine_core_in_process": True,
            "batches": [e2e.prompt_ids((20000,), vocab, seed=4), [prefix + a], [prefix + b],
                        [p + x for p, x in zip(prefixes, a4)], [p + x for p, x in zip(prefixes, b4)]],
        },
    }


# the order engines start in: the references first, then the largest layouts
START_ORDER = ("pcp1", "pcp8", "tp2", "tp2_pcp2", "pcp4", "pcp2", "pcp2_state_passing")


def layout_jobs():
    jobs = {}
    specs = _engine_specs()
    for layout in START_ORDER:
        for engine, spec in specs.items():
            kw, ranks = _parallel(layout)
            jobs[f"{engine}_{layout}"] = ({**spec, "llm": {**spec["llm"], **kw}}, ranks)
    return jobs


def judge(results: dict) -> dict:
    """{case: {layout: comparison with its reference, tp=2 vs pcp=1 beside it, bit identity}}."""
    report = {}
    for case, (engine, runs) in CASE_RUNS.items():
        outs = {layout: e2e.outputs(results[f"{engine}_{layout}"], runs) for layout in LAYOUTS}
        tp2 = e2e.compare(outs["pcp1"], outs["tp2"])
        report[case] = {}
        for layout, ref in REFERENCE.items():
            c = e2e.compare(outs[ref], outs[layout])
            report[case][layout] = {**c, "reference": ref, "identical": outs[ref] == outs[layout],
                                    "tp2_vs_pcp1": tp2["max_logprob_diff"]}
    return report


@pytest.mark.engine_jobs(builder=layout_jobs)
def test_every_layout_matches_its_unsplit_counterpart(engine_pool):
    results = {name: e2e.result(engine_pool, name) for name in layout_jobs()}
    REPORT.update(judge(results))
    cached = results["chunked_pcp2"]["runs"][2]["outputs"][0]["num_cached_tokens"]
    REPORT["case4"] = {layout: {k: results[f"defaults_{layout}"][k] for k in
                                ("max_tokens_one", "abort_mid_prefill", "shutdown_s")} for layout in LAYOUTS}
    REPORT["case3_cached_tokens_pcp2"] = cached
    prompt_lps = {layout: results[f"defaults_{layout}"]["prompt_logprobs"] for layout in LAYOUTS}
    REPORT["prompt_logprobs"] = {
        layout: {**e2e.compare_prompt_logprobs(prompt_lps[ref], prompt_lps[layout]), "reference": ref,
                 "tp2_vs_pcp1": e2e.compare_prompt_logprobs(prompt_lps["pcp1"], prompt_lps["tp2"])[
                     "mean_logprob_diff"]}
        for layout, ref in REFERENCE.items()}
    e2e.save("pcp_e2e", REPORT)
    failed = []
    for case, per_layout in REPORT.items():
        if not case.startswith(("case1", "case2", "case3_prefix", "case3_four", "short")):
            continue
        for layout, c in per_layout.items():
            print(f"[{case}] {layout} vs {c['reference']}: ok={c['ok']} max|dlogprob|="
                  f"{c['max_logprob_diff']:.4g} identical={c['identical']} nonfinite={c['nonfinite']} "
                  f"diverged={c['diverged_at']} | tp2 vs pcp1 {c['tp2_vs_pcp1']:.4g}")
            if not c["ok"]:
                failed.append(f"{case} {layout}")
    assert not failed, failed
    not_identical = [f"{case} {layout}" for case, layouts in BIT_FOR_BIT.items() for layout in layouts
                     if not REPORT[case][layout]["identical"]]
    assert not not_identical, f"expected bit for bit: {not_identical}"
    assert cached >= 10000  # the second request of case 3 really hit the cache
    # prompt logprobs read every row of a split step: the same bits as unsplit where case 1 is, else
    # on average over the prompt no further off than tp=2 is from pcp=1 (the random model gives its
    # prompt tokens logprobs around -37, which move by nats under any reordering of bf16 sums)
    for layout, c in REPORT["prompt_logprobs"].items():
        print(f"[prompt_logprobs] {layout} vs {c['reference']}: {c}")
        assert c["nonfinite"] == 0, (layout, c)
        if layout in BIT_FOR_BIT["case1_unequal_batch"]:
            assert c["identical"], (layout, c)
        assert c["mean_logprob_diff"] <= max(c["tp2_vs_pcp1"], 1e-3), (layout, c)
    for layout, c4 in REPORT["case4"].items():
        assert c4["max_tokens_one"] == [1] * len(CASE1_LENGTHS), (layout, c4)
        assert "victim" not in c4["abort_mid_prefill"]["finished"], (layout, c4)
        assert c4["abort_mid_prefill"]["finished"].get("survivor") == 8, (layout, c4)
        assert c4["shutdown_s"] < 60, (layout, c4)


SERVE_MAX_MODEL_LEN = 16384
SERVE_MAX_TOKENS = 16


def serve_prompts() -> list[str]:
    """64 prompts of 91 to 13650 characters (the tiny tokenizer gives about a token per byte): every
    one fits the server's max_model_len with its output."""
    words = "the quick brown fox jumps over the lazy dog while context parallel prefill splits prompts"
    return [" ".join([words] * (1 + (i * 37) % 150)) for i in range(64)]


def _serve_pcp2(gpus, extra_args=(), name="serve_pcp2"):
    ckpt = e2e.checkpoint("tiny")

    def requests(url):
        import concurrent.futures as cf

        def one(prompt):
            r = e2e.post(f"{url}/v1/completions", {"model": ckpt, "prompt": prompt,
                                                    "max_tokens": SERVE_MAX_TOKENS, "temperature": 0,
                                                    "ignore_eos": True})
            return r["choices"][0]["text"], r["usage"]
        with cf.ThreadPoolExecutor(64) as pool:
            outs = list(pool.map(one, serve_prompts()))
        chat = e2e.post(f"{url}/v1/chat/completions", {
            "model": ckpt, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "Say something."}]})
        summary = {"returned": len(outs), "empty": sum(1 for t, _ in outs if not t),
                   "prompt_tokens": [u["prompt_tokens"] for _, u in outs], "chat": chat}
        e2e.save(name, summary)
        return summary

    return e2e.serve([*e2e.pcp_serve_args(ckpt, gpus, 2, SERVE_MAX_MODEL_LEN), *extra_args], requests,
                     name=name, gpus=gpus)


@pytest.mark.engine_jobs(builder=lambda: {"serve_pcp2": (_serve_pcp2, 2)})
def test_serve_64_concurrent(engine_pool):
    """`vllm serve -pcp 2` (compiled, CUDA graphs): 64 concurrent completions of mixed lengths all
    return, none empty, and a chat completion answers."""
    summary = e2e.result(engine_pool, "serve_pcp2")
    assert summary["returned"] == 64 and summary["empty"] == 0, summary
    assert summary["chat"]["usage"]["completion_tokens"] > 0, summary["chat"]


COMPILED_LAYOUTS = ("pcp1", "pcp2")


def compiled_jobs():
    """The defaults engine's batches with vLLM's compile defaults (torch.compile, CUDA graphs): split
    steps run the compiled graph without CUDA graphs, unsplit steps (decode) replay the graphs."""
    spec = _engine_specs()["defaults"]
    llm = {k: v for k, v in spec["llm"].items() if k != "enforce_eager"}
    jobs = {}
    for layout in COMPILED_LAYOUTS:
        kw, ranks = _parallel(layout)
        jobs[f"compiled_{layout}"] = ({"llm": {**llm, **kw}, "engine_core_in_process": True,
                                      "batches": spec["batches"]}, ranks)
    return jobs


@pytest.mark.engine_jobs(builder=compiled_jobs)
def test_compiled_pcp2_matches_compiled_pcp1(engine_pool):
    ref, pcp2 = (e2e.outputs(e2e.result(engine_pool, f"compiled_{layout}")) for layout in COMPILED_LAYOUTS)
    c = e2e.compare(ref, pcp2)
    e2e.save("pcp_e2e_compiled", {**c, "identical": ref == pcp2})
    print(f"[compiled] pcp2 vs pcp1: ok={c['ok']} max|dlogprob|={c['max_logprob_diff']:.4g} "
          f"identical={ref == pcp2} nonfinite={c['nonfinite']} diverged={c['diverged_at']}")
    assert c["ok"], c
