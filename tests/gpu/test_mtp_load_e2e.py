# SPDX-License-Identifier: Apache-2.0
"""MTP under load: long prompts split beside requests verifying drafts, against pcp=1 with MTP.

    python -m pytest -q -s tests/gpu/test_mtp_load_e2e.py     # one GPU is enough

The draftable tiny checkpoint (``test_mtp_e2e.draftable_checkpoint``: its drafts are mostly accepted),
greedy, top-5 logprobs, vLLM's serve chunk budget (8192 tokens) and the plugin's default split floor
(4096). The load (``e2e._prompts_under_load``): 16 chats of 40 to 1900 tokens decode 48 tokens each;
once every chat verifies drafts, 4 prompts of 24576 tokens join, one every 3 steps (the first with
``max_tokens=1``), each prefilled in chunks beside the chats' verification rows; two chats are aborted
the step after the first long prompt joined. Engines:
- ``load``: K = 3 at pcp = 1, 2, 4, 8, with ``decode="spread"`` at pcp = 2 (its verifying requests
  stay with their owners beside the prompts), tp=2 and tp=2 x pcp=2; without MTP at pcp=2 (the share
  of prompt tokens split, which MTP must now reach);
- ``turns``: prefix caching on, K = 3 at pcp = 1, 2, twice vLLM's budget, seeded sampling: prompts of
  8192 and 65536 tokens join the chats, and every chat that finishes asks again with its answer (a
  prefix hit on decoded blocks, computed beside the others' verification);
- ``k1``: K = 1 at pcp = 1, 2;
- ``preempt``: a KV cache too small for the load at pcp = 1, 2: vLLM preempts and recomputes;
- ``compiled``: vLLM's defaults (torch.compile, CUDA graphs) with MTP at pcp = 1, 2, and without MTP at
  pcp = 2.
Judged: every request answered, within vLLM's rule of pcp=1 (tp=2 for tp=2 x pcp=2) with no NaN/Inf,
the same accepted-token count where the answers are the same bits, every rank's steps with the
verification rows split (``split_verify`` in the step records) and the share of the long prompts'
tokens computed in split steps with MTP within 2 points of the share without.
"""

from __future__ import annotations

import json

import pytest
import torch

from . import e2e

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

MTP = {"method": "mtp", "num_speculative_tokens": 3}
BUDGET = 8192  # vLLM's --max-num-batched-tokens for vllm serve on an H100 / H200
CHATS = 16
CHAT_LENGTHS = [40 + (i * 577) % 1900 for i in range(CHATS)]
LONG, TURNS_LONG = (24576,) * 4, (8192, 65536)
ABORT = (3, 9)
# engine -> (kind, K, tp, pcp, options); kind: the load it runs
# (the order the engine pool starts them in: pcp=1 and the pcp=2 comparisons first)
ENGINES = {
    "load_mtp3_pcp1": ("load", 3, 1, 1, {}), "load_mtp3_pcp2": ("load", 3, 1, 2, {}),
    "load_mtp3_pcp2_spread": ("load", 3, 1, 2, {"decode": "spread"}), "load_nomtp_pcp2": ("load", 0, 1, 2, {}),
    "load_mtp3_pcp4": ("load", 3, 1, 4, {}), "load_mtp3_pcp8": ("load", 3, 1, 8, {}),
    "load_mtp3_tp2": ("load", 3, 2, 1, {}), "load_mtp3_tp2_pcp2": ("load", 3, 2, 2, {}),
    "compiled_mtp3_pcp1": ("compiled", 3, 1, 1, {}), "compiled_mtp3_pcp2": ("compiled", 3, 1, 2, {}),
    "compiled_nomtp_pcp2": ("compiled", 0, 1, 2, {}),
    "turns_mtp3_pcp1": ("turns", 3, 1, 1, {}), "turns_mtp3_pcp2": ("turns", 3, 1, 2, {}),
    "k1_mtp1_pcp1": ("load", 1, 1, 1, {}), "k1_mtp1_pcp2": ("load", 1, 1, 2, {}),
    "preempt_mtp3_pcp1": ("preempt", 3, 1, 1, {}), "preempt_mtp3_pcp2": ("preempt", 3, 1, 2, {}),
}
REFERENCE = {"load_mtp3_pcp2": "load_mtp3_pcp1", "load_mtp3_pcp4": "load_mtp3_pcp1",
             "load_mtp3_pcp8": "load_mtp3_pcp1", "load_mtp3_pcp2_spread": "load_mtp3_pcp1",
             "load_mtp3_tp2_pcp2": "load_mtp3_tp2", "turns_mtp3_pcp2": "turns_mtp3_pcp1",
             "k1_mtp1_pcp2": "k1_mtp1_pcp1", "preempt_mtp3_pcp2": "preempt_mtp3_pcp1",
             "compiled_mtp3_pcp2": "compiled_mtp3_pcp1"}
# the share of the long prompts' tokens split with MTP, against the same load without it
SHARE_OF = {"load_mtp3_pcp2": "load_nomtp_pcp2", "load_mtp3_pcp2_spread": "load_nomtp_pcp2",
            "compiled_mtp3_pcp2": "compiled_nomtp_pcp2"}
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


def load_jobs():
    from .test_mtp_e2e import draftable_checkpoint

    model = draftable_checkpoint()
    vocab = e2e.vocab_size(model)
    chats = e2e.prompt_ids(CHAT_LENGTHS, vocab, seed=40)
    jobs = {}
    for name, (kind, k, tp, pcp, options) in ENGINES.items():
        longs = TURNS_LONG if kind == "turns" else LONG
        llm = e2e.base_llm_kwargs(
            model, enforce_eager=kind != "compiled", max_model_len=max(longs) + 2048, disable_log_stats=False,
            tensor_parallel_size=tp, prefill_context_parallel_size=pcp, enable_prefix_caching=kind == "turns",
            max_num_batched_tokens=BUDGET * (2 if kind == "turns" else 1))
        if kind == "preempt":  # the long prompts and the chats do not fit at once
            llm["kv_cache_memory_bytes"] = 160 << 20
        if k:
            llm["speculative_config"] = {**MTP, "num_speculative_tokens": k}
        if pcp > 1 and options:
            llm["additional_config"] = {"qwen36_pcp": options}
        spec = {"llm": llm, "engine_core_in_process": True, "record_steps": True, "vocab": vocab,
                "load_chats": chats, "load_chat_tokens": 48, "load_gap": 3, "load_abort": list(ABORT),
                "load_long": e2e.prompt_ids(longs, vocab, seed=41), "load_turns": kind == "turns",
                "load_seeded": kind == "turns", "actions": ["prompts_under_load", "spec_decode_metrics"]}
        if kind == "preempt":
            spec["actions"].append("preemptions")
        jobs[name] = (spec, tp * pcp)
    return jobs


def split_share(step_tokens: list[dict]) -> float:
    """Rank 0's share of the long prompts' tokens computed in split steps (``record_step_kinds``)."""
    kinds = step_tokens[0]
    long = sum(k.get("long", 0) for k in kinds.values())
    return sum(k.get("long_split", 0) for k in kinds.values()) / max(long, 1)


@pytest.mark.engine_jobs(builder=load_jobs)
def test_prompts_split_beside_verification_match_pcp1(engine_pool):
    results = {name: e2e.result(engine_pool, name) for name in ENGINES}
    report, failed = {}, []
    for name, ref_name in REFERENCE.items():
        ref, res = results[ref_name], results[name]
        a, b = ref["prompts_under_load"], res["prompts_under_load"]
        c = e2e.compare(a["outputs"], b["outputs"])
        accepted = [x["spec_decode_metrics"].get(ACCEPTED) for x in (ref, res)]
        c.update(reference=ref_name, identical=a["outputs"] == b["outputs"], ids=b["ids"] == a["ids"],
                 accepted=accepted, step_kinds=res.get("step_kinds"), share=split_share(res["step_tokens"]),
                 cached=[o["num_cached_tokens"] for o in b["outputs"]], preemptions=res.get("preemptions"))
        report[name] = c
        print(f"[mtp load] {name}: " + json.dumps({k: v for k, v in c.items() if k != "diverged_at"}))
        if not (c["ok"] and c["nonfinite"] == 0):
            failed.append(f"{name}: answers")
        expected = sorted([f"c{i}" for i in range(CHATS) if i not in ABORT] + [f"l{j}" for j in range(
            len(TURNS_LONG if name.startswith("turns") else LONG))] + ([f"t{i}" for i in range(CHATS) if i not in ABORT]
                                                                        if name.startswith("turns") else []))
        if b["ids"] != expected or a["ids"] != expected:
            failed.append(f"{name}: requests answered {b['ids']} (reference {a['ids']})")
        if not accepted[1] or (c["identical"] and accepted[0] != accepted[1]):
            failed.append(f"{name}: accepted tokens {accepted}")
        kinds = res["step_kinds"]
        if len(kinds) != ENGINES[name][2] * ENGINES[name][3] or not all(k.get("split_verify", 0) for k in kinds):
            failed.append(f"{name}: no split step with verification rows on some rank: {kinds}")
        if "spread" in name and any(k.get("handover", 0) for k in kinds):
            failed.append(f"{name}: verifying requests handed over: {kinds}")
        # second turns hit the prefix cache as at the reference (vLLM's GDN states are kept at block ends
        # its steps reached: a short chat's second turn may find none)
        ref_cached = [o["num_cached_tokens"] for o in a["outputs"]]
        if name.startswith("turns") and (c["cached"] != ref_cached or not any(
                n > 0 for o, n in zip(b["ids"], c["cached"]) if o.startswith("t"))):
            failed.append(f"{name}: second turns' prefix hits {c['cached']}, the reference's {ref_cached}")
        if name.startswith("preempt") and not res.get("preemptions"):
            failed.append(f"{name}: nothing was preempted")
    for name, without in SHARE_OF.items():
        share, base = split_share(results[name]["step_tokens"]), split_share(results[without]["step_tokens"])
        report[f"{name}_share"] = {"with_mtp": share, "without": base}
        print(f"[mtp load] {name}: {100 * share:.1f}% of the long prompts' tokens split, {100 * base:.1f}% "
              f"without MTP")
        if share < base - 0.02:
            failed.append(f"{name}: {share:.3f} of the long prompts' tokens split, {base:.3f} without MTP")
    for name in ENGINES:  # the max_tokens=1 prompt got one token, every other its budget
        outs = dict(zip(results[name]["prompts_under_load"]["ids"], results[name]["prompts_under_load"]["outputs"]))
        if len(outs.get("l0", {}).get("token_ids", [])) != 1:
            failed.append(f"{name}: the max_tokens=1 prompt gave {outs.get('l0')}")
    e2e.save("mtp_load_e2e", report)
    assert not failed, failed
