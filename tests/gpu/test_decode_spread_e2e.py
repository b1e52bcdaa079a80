# SPDX-License-Identifier: Apache-2.0
"""Decode spread over the PCP ranks (``decode="spread"``) end to end, against pcp=1.

    python -m pytest -q -s tests/gpu/test_decode_spread_e2e.py     # one GPU is enough

Tiny checkpoint, greedy, 32 tokens, top-5 logprobs, pcp = 2, 4, 8 with each decoding request on one
rank against pcp=1 (whose decode every rank of ``decode="replicated"`` repeats):
- ``main`` (eager): one request of 3000 tokens, then 64 requests of 1 to 12000 tokens at once (decode
  rows beside split and replicated prompts, ranks owning 8 to 32 rows), ``max_tokens=1``, an abort
  mid-prefill, and two of 8 requests aborted while they decode (a ninth joining two steps later);
- ``preempt`` (eager, pcp = 2, 4): 32 requests of 1620 tokens in a KV cache of 19k tokens: each needs
  another block while it decodes, so vLLM preempts and recomputes requests decoding on one rank;
- ``compiled`` (pcp = 2, 4, 8; vLLM's defaults: torch.compile and CUDA graphs): 24 requests of mixed
  lengths; every rank's spread decode steps replay vLLM's FULL graph of a batch of its own requests
  (each rank records the kind of each step: ``step_kinds``), mixed steps run split, eagerly;
- ``mtp`` (pcp = 2, 4; compiled, prefix caching off) and ``mtp_eager`` (pcp = 2): MTP with K = 3 on the
  draftable head (``test_mtp_e2e.draftable_checkpoint``: most drafts accepted, so verification steps
  with 1 to 4 accepted tokens run) against pcp=1 with MTP: each rank's verification steps of its own
  requests through vLLM's FULL graph of them; the accepted-token counters beside the answers, seeded
  sampling, and ``main``'s abort while decoding, whose late prompt joins verifying requests (which stay
  with their owners: a planned step of the prompt's rows beside their verification rows);
- ``mtp_preempt`` (eager, pcp = 2): ``preempt``'s small KV cache with MTP.
A case passes when vLLM's check_logprobs_close rule holds for every prompt with no NaN/Inf; bit for bit
is not expected (a rank's decode batch is not pcp=1's: flash-attention's split count and the GEMMs'
kernels follow the row count).
"""

import pytest
import torch

from . import e2e

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

SPREAD = {"decode": "spread", "min_split_tokens": 512}
# 12 tokens short of 6 blocks of the tiny checkpoint's 272-token blocks: each request needs a 7th block
# while it decodes, which the full cache does not have
PREEMPT_PROMPT = 6 * 272 - 12
PCPS = (1, 2, 4, 8)
ABORT_DECODE_LENGTHS, ABORT_DECODE_VICTIMS = (3000, 40, 1200, 7, 5000, 600, 2500, 900, 1500), (1, 4)
# engine -> the pcp sizes it runs at
ENGINE_PCPS = {"main": PCPS, "preempt": (1, 2, 4), "compiled": PCPS, "prefix": (1, 2, 4), "mtp": (1, 2, 4),
               "mtp_eager": (1, 2), "mtp_preempt": (1, 2)}
MTP = {"method": "mtp", "num_speculative_tokens": 3}


def mixed_lengths(count: int, longest: int) -> list[int]:
    """``count`` prompt lengths from 1 to ``longest`` tokens, short and long interleaved."""
    return [max(1, (i * 7919) % longest) if i else longest for i in range(count)]


def _specs() -> dict:
    from .test_mtp_e2e import draftable_checkpoint

    ckpt = e2e.checkpoint("tiny")
    vocab = e2e.vocab_size(ckpt)
    draftable = draftable_checkpoint()
    return {  # compiled first: the engine pool starts jobs in this order
        "mtp": {
            "llm": e2e.base_llm_kwargs(draftable, max_model_len=24000, enable_prefix_caching=False,
                                       speculative_config=MTP, disable_log_stats=False,
                                       worker_cls="harness.shared_gpu.StepRecordingWorker"),
            "engine_core_in_process": True, "record_steps": True,
            "batches": [e2e.prompt_ids(mixed_lengths(24, 12000), vocab, seed=27)],
            "actions": ["spec_decode_metrics", "seeded_sampling", "abort_mid_decode"],
            # verifying requests, two aborted, then a prompt joining them: a hand-over of the others
            "abort_decode_prompts": e2e.prompt_ids(ABORT_DECODE_LENGTHS, vocab, seed=26),
            "abort_decode_victims": ABORT_DECODE_VICTIMS,
        },
        "mtp_eager": {
            "llm": e2e.base_llm_kwargs(draftable, enforce_eager=True, max_model_len=24000,
                                       enable_prefix_caching=False, speculative_config=MTP,
                                       disable_log_stats=False),
            "engine_core_in_process": True,
            "batches": [e2e.prompt_ids((3000,), vocab, seed=28),
                        e2e.prompt_ids(mixed_lengths(40, 8000), vocab, seed=29)],
            "actions": ["spec_decode_metrics", "max_tokens_one", "abort_mid_decode"],
            "abort_decode_prompts": e2e.prompt_ids(ABORT_DECODE_LENGTHS, vocab, seed=26),
            "abort_decode_victims": ABORT_DECODE_VICTIMS,
        },
        "mtp_preempt": {
            "llm": e2e.base_llm_kwargs(draftable, enforce_eager=True, max_model_len=4096, disable_log_stats=False,
                                       enable_prefix_caching=False, speculative_config=MTP,
                                       kv_cache_memory_bytes=96 << 20),
            "engine_core_in_process": True, "max_tokens": 48,
            "batches": [e2e.prompt_ids((PREEMPT_PROMPT,) * 32, vocab, seed=24)],
            "actions": ["preemptions", "spec_decode_metrics"],
        },
        "compiled": {
            # each rank records the kind of each step (on the shared GPU its worker does)
            "llm": e2e.base_llm_kwargs(ckpt, max_model_len=24000,
                                       worker_cls="harness.shared_gpu.StepRecordingWorker"),
            "engine_core_in_process": True, "record_steps": True,
            "batches": [e2e.prompt_ids(mixed_lengths(24, 12000), vocab, seed=25)],
        },
        "main": {
            "llm": e2e.base_llm_kwargs(ckpt, enforce_eager=True, max_model_len=24000),
            "engine_core_in_process": True,
            "batches": [e2e.prompt_ids((3000,), vocab, seed=21),
                        e2e.prompt_ids(mixed_lengths(64, 12000), vocab, seed=22)],
            "actions": ["max_tokens_one", "abort_mid_prefill", "abort_mid_decode"],
            "abort_prompt": e2e.prompt_ids((20000,), vocab, seed=23)[0],
            # 8 requests decoding, 2 aborted, then one more of 1500 tokens (split beside the decode rows)
            "abort_decode_prompts": e2e.prompt_ids(ABORT_DECODE_LENGTHS, vocab, seed=26),
            "abort_decode_victims": ABORT_DECODE_VICTIMS,
        },
        "prefix": {
            # prefix caching, compiled (FULL graphs): answers decoded spread fill a block, which
            # follow-ups hit (its GDN states made by the answers' owners); the follow-ups again
            # without the hit
            "llm": e2e.base_llm_kwargs(ckpt, max_model_len=4096, enable_prefix_caching=True),
            "engine_core_in_process": True,
            "batches": [e2e.prompt_ids((300,), vocab, seed=30)],
            "actions": ["answer_prefix_hits"], "vocab": vocab, "answer_prefix_count": 6,
            "answer_prefix_short": 12, "answer_prefix_decode": 40, "answer_prefix_keep": 24,
        },
        "preempt": {
            "llm": e2e.base_llm_kwargs(ckpt, enforce_eager=True, max_model_len=4096, disable_log_stats=False,
                                       kv_cache_memory_bytes=96 << 20),
            "engine_core_in_process": True, "max_tokens": 48,
            "batches": [e2e.prompt_ids((PREEMPT_PROMPT,) * 32, vocab, seed=24)],
            "actions": ["preemptions"],
        },
    }


def spread_jobs():
    jobs = {}
    for name, spec in _specs().items():
        for pcp in ENGINE_PCPS[name]:
            kw = {"prefill_context_parallel_size": pcp}
            if pcp > 1:
                kw["additional_config"] = {"qwen36_pcp": SPREAD}
            jobs[f"spread_{name}_pcp{pcp}"] = ({**spec, "llm": {**spec["llm"], **kw}}, pcp)
    return jobs


def prefix_report(ref: dict, res: dict) -> dict:
    """``answer_prefix_hits`` of a spread engine against pcp=1's: the answers, and the follow-ups that
    hit blocks the answers filled against the same follow-ups without the hit (pcp=1's as a reference:
    a state made token by token and one made by a prefill round apart)."""
    def brief(c):
        return {k: c[k] for k in ("ok", "max_logprob_diff", "nonfinite")}

    return {"block_size": res["block_size"], "cached": [o["num_cached_tokens"] for o in res["hit"]],
            "state_digests": res["state_digests"],
            "answers": brief(e2e.compare(ref["answers"], res["answers"])),
            "hit_vs_miss": brief(e2e.compare(res["miss"], res["hit"])),
            "hit_vs_miss_pcp1": brief(e2e.compare(ref["miss"], ref["hit"]))}


@pytest.mark.engine_jobs(builder=spread_jobs)
def test_spread_decode_matches_pcp1(engine_pool):
    report, failed = {}, []
    for name in _specs():
        ref = e2e.result(engine_pool, f"spread_{name}_pcp1")
        for pcp in ENGINE_PCPS[name][1:]:
            res = e2e.result(engine_pool, f"spread_{name}_pcp{pcp}")
            c = e2e.compare(e2e.outputs(ref), e2e.outputs(res))
            c["identical"] = e2e.outputs(ref) == e2e.outputs(res)
            for action in ("max_tokens_one", "abort_mid_prefill", "preemptions", "spec_decode_metrics"):
                if action in res:
                    c[action] = res[action]
            report[f"{name}_pcp{pcp}"] = c
            print(f"[spread] {name} pcp{pcp} vs pcp1: ok={c['ok']} max|dlogprob|={c['max_logprob_diff']:.4g} "
                  f"identical={c['identical']} nonfinite={c['nonfinite']} diverged={c['diverged_at'][:4]}")
            if not c["ok"]:
                failed.append(f"{name} pcp{pcp}")
            if name == "main":
                assert res["max_tokens_one"] == [1], res["max_tokens_one"]
                assert "victim" not in res["abort_mid_prefill"]["finished"], res["abort_mid_prefill"]
                assert res["abort_mid_prefill"]["finished"].get("survivor") == 8, res["abort_mid_prefill"]
            if "abort_mid_decode" in res:
                # requests aborted while ranks own them: the others and a request joining after (with
                # MTP: computed beside their verification on their owners) go on as at pcp=1
                kept = [f"r{i}" for i in range(len(ABORT_DECODE_LENGTHS) - 1) if i not in ABORT_DECODE_VICTIMS]
                ref_abort, abort = ref["abort_mid_decode"], res["abort_mid_decode"]
                c["abort_mid_decode"] = e2e.compare(ref_abort["outputs"], abort["outputs"])
                assert abort["ids"] == ref_abort["ids"] == sorted([*kept, "late"]), (ref_abort["ids"], abort["ids"])
                if name == "main":  # (with MTP the tokens per step follow the drafts accepted)
                    assert abort["aborted_at"] == ref_abort["aborted_at"], (ref_abort, abort)  # the same batches
                assert c["abort_mid_decode"]["ok"], c["abort_mid_decode"]
            if name in ("preempt", "mtp_preempt"):
                assert res["preemptions"] > 0, "the small KV cache preempted nothing"
            if name.startswith("mtp"):
                c["spec_decode_metrics_pcp1"] = ref["spec_decode_metrics"]
                print(f"[spread] {name} pcp{pcp} spec decode: {res['spec_decode_metrics']} "
                      f"(pcp1: {ref['spec_decode_metrics']})")
            if name == "mtp":
                c["seeded_identical"] = ref["seeded_sampling"] == res["seeded_sampling"]  # (reported)
            if name == "prefix":
                c["prefix"] = prefix_report(ref["answer_prefix_hits"], res["answer_prefix_hits"])
                print(f"[spread] prefix pcp{pcp}: {c['prefix']}")
                assert all(n >= c["prefix"]["block_size"] for n in c["prefix"]["cached"]), c["prefix"]
                assert c["prefix"]["answers"]["ok"] and c["prefix"]["hit_vs_miss"]["ok"], c["prefix"]
                # the blocks the answers filled hold the same states, bit for bit, on every rank
                digests = res["answer_prefix_hits"]["state_digests"]
                assert len({tuple(d) for d in digests}) == 1 and digests[0][1] >= 6, digests
            if name == "mtp":  # the prompt joining verifying requests: they stay with their owners, which
                # verify them in steps the prompt's rows share; nothing is handed over
                assert all(k.get("split_verify", 0) > 0 and not k.get("handover") for k in res["step_kinds"]), \
                    res["step_kinds"]
            if name in ("compiled", "mtp"):
                c["step_kinds"] = res["step_kinds"]
                print(f"[spread] compiled pcp{pcp} step kinds per rank: {res['step_kinds']}")
                # every rank ran its spread decode steps through vLLM's FULL graph of its own requests
                assert len(res["step_kinds"]) == pcp and all(k.get("owned_full", 0) > 0 for k in res["step_kinds"])
    e2e.save("decode_spread_e2e", report)
    assert not failed, failed
