"""Prefill context parallel end to end on 2 GPUs: pcp=2 vs pcp=1, with tp=2 as the yardstick.

    python -m pytest -q -s tests/gpu/test_pcp_e2e.py          # needs 2 GPUs

PCP passes a case when (a) per prompt the tokens are identical, or identical up to a step where each
side's token is in the other's top-5 (vLLM's check_logprobs_close rule), and (b) the largest |logprob
difference| over the shared prefix is at most 1.5x what tp=2 shows against pcp=1 on the same case.
"""

import concurrent.futures as cf

import pytest
import torch

from . import e2e

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

PARALLEL = {
    "pcp1": dict(tensor_parallel_size=1, prefill_context_parallel_size=1),
    "pcp2": dict(tensor_parallel_size=1, prefill_context_parallel_size=2),
    "tp2": dict(tensor_parallel_size=2, prefill_context_parallel_size=1),
}
REPORT = {}


def _judge(case, runs):
    """runs: {"pcp1": outputs, "pcp2": outputs, "tp2": outputs} -> asserts and records."""
    pcp = e2e.compare(runs["pcp1"], runs["pcp2"])
    tp = e2e.compare(runs["pcp1"], runs["tp2"])
    allowed = 1.5 * tp["max_logprob_diff"]
    # reported: bit for bit on case 1 (one H200 shared by both ranks, 2026-12-01); not where
    # flash-attention splits short steps' keys by the call's shape (cases 2/3, tiny model)
    identical = runs["pcp1"] == runs["pcp2"]
    REPORT[case] = {"pcp2_vs_pcp1": pcp, "tp2_vs_pcp1": tp, "allowed": allowed,
                    "pcp2_identical_to_pcp1": identical}
    print(f"[{case}] pcp2 vs pcp1: ok={pcp['ok']} max|dlogprob|={pcp['max_logprob_diff']:.4g} "
          f"diverged={pcp['diverged_at']} identical={identical} | tp2 vs pcp1: "
          f"max|dlogprob|={tp['max_logprob_diff']:.4g} diverged={tp['diverged_at']} | allowed {allowed:.4g}")
    e2e.save("pcp_e2e", REPORT)
    assert pcp["ok"], REPORT[case]
    assert pcp["max_logprob_diff"] <= allowed, REPORT[case]


def _jobs(case, spec_of, parallel=PARALLEL):
    """One engine job per parallel setting (pcp1, pcp2, tp2 unless given) for one case."""
    jobs = {}
    for name, par in parallel.items():
        spec = spec_of(name)
        spec["llm"].update(par)
        jobs[f"{case}_{name}"] = (spec, par["tensor_parallel_size"] * par["prefill_context_parallel_size"])
    return jobs


def _results(pool, case, parallel=PARALLEL):
    return {name: e2e.result(pool, f"{case}_{name}") for name in parallel}


CASE1_LENGTHS = (1, 3, 1000, 4097, 20000, 65536)


def case1_jobs():
    ckpt = e2e.checkpoint("tiny")
    vocab = e2e.vocab_size(ckpt)
    prompts = e2e.prompt_ids(CASE1_LENGTHS, vocab, seed=2)

    def spec(name):
        # one batch: every engine must cut it into the same steps (see e2e's docstring)
        s = {"llm": e2e.base_llm_kwargs(ckpt, enforce_eager=True), "prompts": prompts,
             "engine_core_in_process": True}
        if name == "pcp2":
            s["actions"] = ["max_tokens_one", "abort_mid_prefill"]
            s["abort_prompt"] = e2e.prompt_ids((30000,), vocab, seed=3)[0]
        return s

    return _jobs("case1_unequal_batch", spec)


@pytest.mark.engine_jobs(builder=case1_jobs)
def test_unequal_batch_max_tokens_one_abort_and_shutdown(engine_pool):
    """Case 1 (6 prompts of unequal lengths) + case 4 (max_tokens=1, abort mid-prefill, shutdown)."""
    res = _results(engine_pool, "case1_unequal_batch")
    _judge("case1_unequal_batch", {k: e2e.outputs(v) for k, v in res.items()})
    pcp2 = res["pcp2"]
    REPORT["case4"] = {"max_tokens_one": pcp2["max_tokens_one"], "abort": pcp2["abort_mid_prefill"],
                       "shutdown_s": pcp2["shutdown_s"],
                       "startup_s": {k: v["startup_s"] for k, v in res.items()},
                       "batch_s": {k: v["runs"][0]["seconds"] for k, v in res.items()}}
    e2e.save("pcp_e2e", REPORT)
    assert pcp2["max_tokens_one"] == [1] * len(CASE1_LENGTHS)
    assert "victim" not in pcp2["abort_mid_prefill"]["finished"]
    assert pcp2["abort_mid_prefill"]["finished"].get("survivor") == 8
    assert pcp2["shutdown_s"] < 60


# The same single-GPU model with 4096-token instead of 2048-token chunks: how far pcp1 moves from
# itself when only the step shapes change (vLLM's kernels are not batch-invariant). Reported next to
# cases 2 and 3 so their numbers can be read against the noise of the measurement; not judged.
NOISE_FLOOR = {"pcp1_chunk4096": PARALLEL["pcp1"]}


# which batches of the case2_3 engines are case 2 and which case 3
CASE2_3_RUNS = {"case2_chunked_prefill": [0], "case3_prefix_cache": [1, 2]}


def case2_3_jobs():
    ckpt = e2e.checkpoint("tiny")
    vocab = e2e.vocab_size(ckpt)
    long_prompt = e2e.prompt_ids((20000,), vocab, seed=4)
    prefix = e2e.prompt_ids((20000,), vocab, seed=5)[0]
    a, b = e2e.prompt_ids((300, 700), vocab, seed=6)
    return _jobs("case2_3", lambda name: {
        "llm": e2e.base_llm_kwargs(ckpt, max_num_batched_tokens=4096 if name in NOISE_FLOOR else 2048,
                                   enable_prefix_caching=True, enforce_eager=True, max_model_len=21000),
        "batches": [long_prompt, [prefix + a], [prefix + b]]}, {**PARALLEL, **NOISE_FLOOR})


@pytest.mark.engine_jobs(builder=case2_3_jobs)
def test_chunked_prefill_and_prefix_caching(engine_pool):
    """Case 2: max_num_batched_tokens=2048 on a 20000-token prompt (10 chunks, each a continuation).
    Case 3: a 20000-token prefix sent twice with different suffixes; the second is a cache hit.
    One engine per parallel setting runs both (prefix caching on, 2048-token chunks). Reported, not
    judged: the noise floor."""
    res = _results(engine_pool, "case2_3", {**PARALLEL, **NOISE_FLOOR})
    for case, runs in CASE2_3_RUNS.items():
        diff = e2e.compare(e2e.outputs(res["pcp1"], runs), e2e.outputs(res["pcp1_chunk4096"], runs))
        REPORT[f"{case}_pcp1_chunk4096_vs_pcp1"] = diff
        print(f"[{case}] noise floor, pcp1 with 4096-token chunks vs pcp1: "
              f"max|dlogprob|={diff['max_logprob_diff']:.4g} diverged={diff['diverged_at']}")
    res = {k: res[k] for k in PARALLEL}
    _judge("case2_chunked_prefill", {k: e2e.outputs(v, CASE2_3_RUNS["case2_chunked_prefill"])
                                     for k, v in res.items()})
    cached = {k: v["runs"][2]["outputs"][0]["num_cached_tokens"] for k, v in res.items()}
    REPORT["case3_cached_tokens_second_request"] = cached
    assert cached["pcp2"] >= 10000, cached  # the second request really hit the cache
    _judge("case3_prefix_cache", {k: e2e.outputs(v, CASE2_3_RUNS["case3_prefix_cache"])
                                  for k, v in res.items()})


def case3_repeat_jobs():
    ckpt = e2e.checkpoint("tiny")
    vocab = e2e.vocab_size(ckpt)
    prefixes = e2e.prompt_ids((20000,) * 4, vocab, seed=7)
    a = e2e.prompt_ids((300,) * 4, vocab, seed=8)
    b = e2e.prompt_ids((700,) * 4, vocab, seed=9)
    return _jobs("case3_repeat", lambda name: {
        "llm": e2e.base_llm_kwargs(ckpt, max_num_batched_tokens=2048, enable_prefix_caching=True,
                                   enforce_eager=True, max_model_len=21000),
        # four prompts per batch: the same steps on every engine (see e2e's docstring)
        "engine_core_in_process": True,
        "batches": [[p + x for p, x in zip(prefixes, a)], [p + x for p, x in zip(prefixes, b)]]},
        PARALLEL)


def _first_token_diff(ref, other):
    """|dlogprob| of the reference's first token (None when it is not in the other's top-5)."""
    tok = str(ref["token_ids"][0])
    lp = other["logprobs"][0].get(tok)
    return None if lp is None else round(abs(ref["logprobs"][0][tok] - lp), 4)


@pytest.mark.engine_jobs(builder=case3_repeat_jobs)
def test_prefix_caching_four_prefixes(engine_pool):
    """Case 3 over four prefixes (8 requests, the second four cache hits). Reports each prompt's
    first-token (pure prefill) |dlogprob| per setting."""
    res = _results(engine_pool, "case3_repeat", PARALLEL)
    outs = {k: e2e.outputs(v) for k, v in res.items()}
    first = {k: [_first_token_diff(x, y) for x, y in zip(outs["pcp1"], o)]
             for k, o in outs.items() if k != "pcp1"}
    REPORT["case3_repeat_first_token_dlogprob"] = first
    REPORT["case3_repeat_cached_tokens"] = {k: [x["num_cached_tokens"] for x in o] for k, o in outs.items()}
    print("[case3_repeat] first-token |dlogprob| vs pcp1:", first)
    assert min(REPORT["case3_repeat_cached_tokens"]["pcp2"][4:]) >= 10000
    _judge("case3_repeat", {k: outs[k] for k in PARALLEL})


def _serve_pcp2(gpus, extra_args=(), name="serve_pcp2"):
    ckpt = e2e.checkpoint("tiny")
    words = "the quick brown fox jumps over the lazy dog while context parallel prefill splits prompts"

    def requests(url):
        def one(i):
            prompt = " ".join([words] * (1 + (i * 37) % 400))
            r = e2e.post(f"{url}/v1/completions", {"model": ckpt, "prompt": prompt, "max_tokens": 16,
                                                    "temperature": 0, "ignore_eos": True})
            return r["choices"][0]["text"], r["usage"]
        with cf.ThreadPoolExecutor(64) as pool:
            outs = list(pool.map(one, range(64)))
        chat = e2e.post(f"{url}/v1/chat/completions", {
            "model": ckpt, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "Say something."}]})
        summary = {"returned": len(outs), "empty": sum(1 for t, _ in outs if not t),
                   "prompt_tokens": [u["prompt_tokens"] for _, u in outs], "chat": chat}
        e2e.save(name, summary)  # on record even if the session ends before the test body
        return summary

    return e2e.serve([ckpt, "--hf-overrides", '{"architectures": ["Qwen3_6ForCausalLM"]}',
                      "-pcp", "2", "--gdn-prefill-backend", "triton", "--max-model-len", "16384",
                      "--gpu-memory-utilization", "0.5", *extra_args], requests, name=name, gpus=gpus)


@pytest.mark.engine_jobs(builder=lambda: {"serve_pcp2": (_serve_pcp2, 2)})
def test_serve_64_concurrent(engine_pool):
    """Case 5: vllm serve -pcp 2: 64 concurrent completions of mixed lengths all return, none empty."""
    summary = REPORT["case5_serve"] = e2e.result(engine_pool, "serve_pcp2")
    e2e.save("pcp_e2e", REPORT)
    assert summary["returned"] == 64 and summary["empty"] == 0, summary
    assert summary["chat"]["usage"]["completion_tokens"] > 0, summary["chat"]
