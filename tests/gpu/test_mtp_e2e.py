# SPDX-License-Identifier: Apache-2.0
"""MTP speculative decoding at pcp > 1 against the same layout's pcp=1 with MTP.

    python -m pytest -q -s tests/gpu/test_mtp_e2e.py     # one GPU is enough

The tiny checkpoint with its own MTP head (``mtp.*``), ``--speculative-config '{"method": "mtp",
"num_speculative_tokens": K}'``, greedy, 32 tokens, top-5 logprobs, one batch of 1, 3, 1000, 5000 and
20000 tokens (the last in two chunks of vLLM's 16384-token budget), then vLLM's speculative-decoding
counters, ``max_tokens=1``, seeded sampling and an abort mid-prefill. Two heads:
- the checkpoint's random head, K = 3 at pcp = 1, 2, 4, 8: its drafts are almost never accepted, so
  the answers alone cannot show a wrong drafter; every step's drafts are logged
  (``harness.shared_gpu.record_drafts``) and compared draft for draft. The drafter's first pass over a
  split prompt writes its K/V of the whole prompt, so a missing or wrong row changes the drafts;
- a *draftable* head (``draftable_checkpoint``: the same checkpoint changed so that the head guesses
  the target's next token), K = 1 at pcp = 1 and 2, K = 3 at tp=2 and tp=2 x pcp=2: its drafts are
  mostly accepted, so verification steps with accepted drafts run, and their counts are compared.
The drafter's first pass over a split prompt runs each rank's rows (``mtp_first_pass="split"``, the
default); at pcp=2 also on every row (``"whole"``).
Judged: answers within vLLM's rule (bit for bit, drafts included, at pcp = 2 and 4 and tp=2 x pcp=2;
at pcp=8 the 5000-token prompt's blocks are 320 tokens, short enough to round differently, as short
splits do in test_pcp_e2e), accepted-token counts equal, greedy MTP at pcp=2 within the rule of greedy without MTP,
no NaN.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from . import e2e

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

LENGTHS = (1, 3, 1000, 5000, 20000)
SPLIT_FROM = {"min_split_tokens": 512}
# name -> (head, K, tensor_parallel_size, prefill_context_parallel_size); None: no speculative decoding
ENGINES = {
    "mtp3_pcp1": ("random", 3, 1, 1), "mtp3_pcp8": ("random", 3, 1, 8), "mtp3_pcp2": ("random", 3, 1, 2),
    "mtp3_pcp4": ("random", 3, 1, 4),
    "mtp1_pcp1": ("random", 1, 1, 1), "mtp1_pcp4": ("random", 1, 1, 4), "mtp1_pcp8": ("random", 1, 1, 8),
    "draft1_pcp1": ("draftable", 1, 1, 1), "draft1_pcp2": ("draftable", 1, 1, 2),
    "draft3_tp2": ("draftable", 3, 2, 1), "draft3_tp2_pcp2": ("draftable", 3, 2, 2),
    "nomtp_pcp2": (None, 0, 1, 2),
    # the drafter's first pass on every row (mtp_first_pass="whole")
    "mtp3_pcp2_whole": ("random", 3, 1, 2), "draft1_pcp2_whole": ("draftable", 1, 1, 2),
}
# engine -> the engine it must match
REFERENCE = {"mtp3_pcp2": "mtp3_pcp1", "mtp3_pcp4": "mtp3_pcp1", "mtp3_pcp8": "mtp3_pcp1",
             "mtp1_pcp4": "mtp1_pcp1", "mtp1_pcp8": "mtp1_pcp1",
             "draft1_pcp2": "draft1_pcp1", "draft3_tp2_pcp2": "draft3_tp2",
             "mtp3_pcp2_whole": "mtp3_pcp1", "draft1_pcp2_whole": "draft1_pcp1"}
# pcp=8 cuts the 5000-token prompt into blocks of 320 tokens, short enough that flash-attention's
# splits differ from pcp=1's (as for the short splits in test_pcp_e2e): within the rule, not bit for bit
BIT_FOR_BIT = ("mtp3_pcp2", "mtp3_pcp4", "mtp1_pcp4", "draft1_pcp2", "draft3_tp2_pcp2", "mtp3_pcp2_whole",
               "draft1_pcp2_whole")


# the draftable checkpoint: the target's residual branches scaled by this, the final norm unit
DRAFTABLE_BRANCH_SCALE = 0.01
TARGET_BRANCH_OUTPUTS = ("o_proj.weight", "out_proj.weight", "experts.down_proj", "shared_expert.down_proj.weight")
UNIT_NORMS = ("model.language_model.norm.weight", "mtp.pre_fc_norm_embedding.weight",
              "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")


def draftable_checkpoint() -> str:
    """The tiny checkpoint changed so that its MTP head guesses the target's next token.

    Random weights give random drafts, never accepted, so verification with accepted drafts would
    never run. Here the target's residual branches (attention, GDN and expert output projections) are
    scaled down, so its next token is mostly a function of the current token, ``argmax lm_head(
    norm(embed(token)))``, nudged by the context through every layer (the answers and logprobs still
    depend on every layer's split computation). The head computes ``norm(layer(fc([norm(embed(t)),
    norm(hidden)])))`` with the target's lm_head: ``fc`` passes the embedding half, the layer adds
    nothing (its output projections zero) and the norms are unit (Qwen3.5's norms are ``1 + w``), so
    it proposes exactly that function of the token it is given: accepted unless the context nudged
    the target elsewhere.
    """
    from safetensors.torch import load_file, save_file

    src = Path(e2e.checkpoint("tiny"))
    dst = src.parent / "tiny-draftable"
    if (dst / "config.json").exists():
        return str(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
            continue
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if name == "mtp.fc.weight":
                hidden = t.shape[0]
                t.zero_()
                t[:, :hidden] = torch.eye(hidden, dtype=t.dtype)
            elif name in UNIT_NORMS or (name.startswith("mtp.layers.")
                                        and name.endswith(("o_proj.weight", "down_proj.weight"))):
                t.zero_()
            elif name.startswith("model.language_model.layers.") and name.endswith(TARGET_BRANCH_OUTPUTS):
                t.mul_(DRAFTABLE_BRANCH_SCALE)
        save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
    return str(dst)


def mtp_llm(model: str, k: int, tp: int = 1, pcp: int = 1, pcp_options: dict | None = None, **kw) -> dict:
    """LLM arguments: eager, speculative-decoding counters on, MTP with ``k`` drafts (none: ``k=0``),
    ``pcp_options`` beside the split floor of these tests."""
    llm = e2e.base_llm_kwargs(model, **{"enforce_eager": True, "max_model_len": 32768, "disable_log_stats": False,
                                        "tensor_parallel_size": tp, "prefill_context_parallel_size": pcp, **kw})
    if pcp > 1:
        llm["additional_config"] = {"qwen36_pcp": SPLIT_FROM}
    if k:
        llm["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    return llm


def mtp_jobs():
    ckpt = e2e.checkpoint("tiny")
    vocab = e2e.vocab_size(ckpt)
    prompts = e2e.prompt_ids(LENGTHS, vocab, seed=12)
    jobs = {}
    for name, (head, k, tp, pcp) in ENGINES.items():
        llm = mtp_llm(draftable_checkpoint() if head == "draftable" else ckpt, k, tp, pcp,
                      {"mtp_first_pass": "whole"} if name.endswith("_whole") else None)
        jobs[name] = ({"llm": llm, "engine_core_in_process": True, "batches": [prompts],
                       "record_drafts": head is not None, "abort_prompt": e2e.prompt_ids((30000,), vocab, seed=3)[0],
                       "actions": ["spec_decode_metrics", "max_tokens_one", "seeded_sampling",
                                   "abort_mid_prefill"]}, tp * pcp)
    return jobs


@pytest.mark.engine_jobs(builder=mtp_jobs)
def test_mtp_at_pcp_matches_pcp1(engine_pool):
    results = {name: e2e.result(engine_pool, name) for name in ENGINES}
    report, failed = {}, []
    for name, ref in REFERENCE.items():
        a, b = results[ref], results[name]
        c = e2e.compare(e2e.outputs(a), e2e.outputs(b))
        report[name] = {
            **c, "reference": ref, "identical": e2e.outputs(a) == e2e.outputs(b),
            "drafts_identical": a["drafts"] == b["drafts"],
            "draft_steps": sum(len(d) for d in b["drafts"]),
            "spec_decode": b["spec_decode_metrics"], "spec_decode_ref": a["spec_decode_metrics"],
            "seeded_identical": a["seeded_sampling"] == b["seeded_sampling"],
            "max_tokens_one": b["max_tokens_one"], "abort_mid_prefill": b["abort_mid_prefill"],
        }
    without = e2e.compare(e2e.outputs(results["nomtp_pcp2"]), e2e.outputs(results["mtp3_pcp2"]))
    report["mtp3_pcp2_vs_no_mtp"] = without
    e2e.save("mtp_e2e", report)
    for name, r in report.items():
        print(f"[mtp] {name}: " + json.dumps({k: v for k, v in r.items() if k not in ("diverged_at",)}))
    for name in REFERENCE:
        r = report[name]
        if not (r["ok"] and r["nonfinite"] == 0):
            failed.append(f"{name}: answers")
        if name in BIT_FOR_BIT and not (r["identical"] and r["drafts_identical"]):
            failed.append(f"{name}: not bit for bit (answers {r['identical']}, drafts {r['drafts_identical']})")
        if r["draft_steps"] == 0:
            failed.append(f"{name}: no drafts logged")
        logged = results[name]
        if not (logged["drafts_ranks_agree"] and logged["drafts_ranks"] == ENGINES[name][2] * ENGINES[name][3]):
            failed.append(f"{name}: the ranks fed different drafts ({logged['drafts_ranks']} ranks logged)")
        accepted = "vllm:spec_decode_num_accepted_tokens"
        if r["spec_decode"].get(accepted) != r["spec_decode_ref"].get(accepted):
            failed.append(f"{name}: accepted tokens {r['spec_decode'].get(accepted)} vs "
                          f"{r['spec_decode_ref'].get(accepted)}")
        if ENGINES[name][0] == "draftable" and not r["spec_decode"].get(accepted):
            failed.append(f"{name}: the draftable head's drafts were never accepted")
        if not r["seeded_identical"] and name in BIT_FOR_BIT:
            failed.append(f"{name}: seeded sampling")
        if r["max_tokens_one"] != [1] * len(LENGTHS):
            failed.append(f"{name}: max_tokens=1 gave {r['max_tokens_one']}")
        if "victim" in r["abort_mid_prefill"]["finished"] or r["abort_mid_prefill"]["finished"].get("survivor") != 8:
            failed.append(f"{name}: abort {r['abort_mid_prefill']}")
    if not (without["ok"] and without["nonfinite"] == 0):
        failed.append("greedy MTP vs greedy without MTP at pcp=2")
    assert not failed, failed


# a 65536-token prompt beside short ones, the accepting head at K = 3: chunked by vLLM's step budget,
# each chunk split over pcp=4's ranks, the short prompts beside it
LONG = {"long_mtp_pcp1": 1, "long_mtp_pcp4": 4}
LONG_LENGTHS = (65536, 1, 3000)


def long_jobs():
    vocab = e2e.vocab_size(e2e.checkpoint("tiny"))
    prompts = e2e.prompt_ids(LONG_LENGTHS, vocab, seed=16)
    return {name: ({"llm": mtp_llm(draftable_checkpoint(), 3, pcp=pcp, max_model_len=65536 + 64),
                    "engine_core_in_process": True, "batches": [prompts], "record_drafts": True,
                    "actions": ["spec_decode_metrics"]}, pcp) for name, pcp in LONG.items()}


@pytest.mark.engine_jobs(builder=long_jobs)
def test_mtp_65536_token_prompt(engine_pool):
    """pcp=4 with MTP on a 65536-token prompt beside short ones: within vLLM's rule of pcp=1 with MTP,
    the ranks' drafts the same, drafts accepted, and pcp=1's accepted count where the answers are the
    same bits."""
    ref, r = e2e.result(engine_pool, "long_mtp_pcp1"), e2e.result(engine_pool, "long_mtp_pcp4")
    c = e2e.compare(e2e.outputs(ref), e2e.outputs(r))
    accepted = "vllm:spec_decode_num_accepted_tokens"
    report = {**c, "identical": e2e.outputs(ref) == e2e.outputs(r),
              "accepted": [x["spec_decode_metrics"].get(accepted) for x in (ref, r)]}
    e2e.save("mtp_long", report)
    print(f"[mtp 65536] {report}")
    assert c["ok"] and c["nonfinite"] == 0, report
    assert report["accepted"][1] and (report["accepted"][0] == report["accepted"][1] or not report["identical"]), report
    assert r["drafts_ranks_agree"] and r["drafts_ranks"] == 4, report


# one 12000-token prompt in 4096-token chunks (every chunk split: continuing chunks with MTP on), at
# pcp=1, at pcp=2, and at pcp=2 after other requests have used the caches (answers must not depend on
# what the caches held before)
CHUNKED = {"chunked_pcp1": 1, "chunked_pcp2": 2, "chunked_after_history_pcp2": 2}


def chunked_jobs():
    vocab = e2e.vocab_size(e2e.checkpoint("tiny"))
    prompt = e2e.prompt_ids((12000,), vocab, seed=14)
    history = e2e.prompt_ids((2000, 5000), vocab, seed=15)
    jobs = {}
    for name, pcp in CHUNKED.items():
        llm = mtp_llm(draftable_checkpoint(), 3, pcp=pcp, max_num_batched_tokens=4096)
        batches = ([history] if "history" in name else []) + [prompt]
        jobs[name] = ({"llm": llm, "engine_core_in_process": True, "batches": batches, "record_drafts": True,
                       "actions": ["spec_decode_metrics"]}, pcp)
    return jobs


@pytest.mark.engine_jobs(builder=chunked_jobs)
def test_mtp_chunked_prompt_alone(engine_pool):
    """Continuing chunks split with MTP on: within vLLM's rule of pcp=1 with the same accepted drafts,
    and the same bits fresh or after other requests. Not bit for bit with pcp=1: a 4096-token chunk
    over a cached prefix is a step short enough that flash-attention's key splits at pcp=1 differ
    from a rank's (as for chunked prefill without MTP in test_pcp_e2e)."""
    ref = e2e.result(engine_pool, "chunked_pcp1")
    outs = {name: e2e.outputs(r, [len(r["runs"]) - 1]) for name, r in
            ((n, e2e.result(engine_pool, n)) for n in ("chunked_pcp2", "chunked_after_history_pcp2"))}
    report = {name: {**e2e.compare(e2e.outputs(ref), out), "identical": e2e.outputs(ref) == out}
              for name, out in outs.items()}
    accepted = "vllm:spec_decode_num_accepted_tokens"
    report["accepted"] = [e2e.result(engine_pool, n)["spec_decode_metrics"].get(accepted)
                          for n in ("chunked_pcp1", "chunked_pcp2")]
    e2e.save("mtp_chunked", report)
    print(f"[mtp chunked] {report}")
    for name in outs:
        assert report[name]["ok"] and report[name]["nonfinite"] == 0, (name, report[name])
    assert outs["chunked_pcp2"] == outs["chunked_after_history_pcp2"]
    accepted = report["accepted"]
    assert accepted[1] and (accepted[0] == accepted[1] or not report["identical"]), accepted


# prefix-cache hits with MTP: a 12000-token prompt, then two requests that continue it (the accepting
# head, K = 3, prefix caching on), at pcp=1 and pcp=2
PREFIX = {"prefix_mtp_pcp1": 1, "prefix_mtp_pcp2": 2}


def prefix_jobs():
    vocab = e2e.vocab_size(e2e.checkpoint("tiny"))
    prompt, more, other = e2e.prompt_ids((12000, 600, 300), vocab, seed=16)
    jobs = {}
    for name, pcp in PREFIX.items():
        llm = mtp_llm(draftable_checkpoint(), 3, pcp=pcp, enable_prefix_caching=True)
        jobs[name] = ({"llm": llm, "engine_core_in_process": True, "record_drafts": True,
                       "batches": [[prompt], [prompt + more, prompt + other]], "actions": ["spec_decode_metrics"]}, pcp)
    return jobs


@pytest.mark.engine_jobs(builder=prefix_jobs)
def test_mtp_prefix_cache_hits(engine_pool):
    """Requests that hit the prefix cache with MTP on: pcp=2 within vLLM's rule of pcp=1, the same hits,
    the ranks' drafts the same, and pcp=1's accepted drafts where the answers are the same bits (a
    12000-token prompt in 16384-token steps runs the chunk after a hit short, which rounds apart)."""
    ref, r = e2e.result(engine_pool, "prefix_mtp_pcp1"), e2e.result(engine_pool, "prefix_mtp_pcp2")
    c = e2e.compare(e2e.outputs(ref), e2e.outputs(r))
    accepted = "vllm:spec_decode_num_accepted_tokens"
    report = {**c, "identical": e2e.outputs(ref) == e2e.outputs(r),
              "cached": [[o["num_cached_tokens"] for o in e2e.outputs(x, [1])] for x in (ref, r)],
              "accepted": [x["spec_decode_metrics"].get(accepted) for x in (ref, r)]}
    e2e.save("mtp_prefix", report)
    print(f"[mtp prefix] {report}")
    assert c["ok"] and c["nonfinite"] == 0, report
    assert report["cached"][0] == report["cached"][1] and all(n > 0 for n in report["cached"][1]), report
    assert report["accepted"][1] and (report["accepted"][0] == report["accepted"][1] or not report["identical"]), report
    assert r["drafts_ranks_agree"] and r["drafts_ranks"] == 2, report


if __name__ == "__main__":  # the draftable checkpoint alone (to look at it)
    print(draftable_checkpoint(), os.listdir(draftable_checkpoint()))
