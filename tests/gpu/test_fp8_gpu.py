# SPDX-License-Identifier: Apache-2.0
"""FP8 end to end: a block-wise FP8 checkpoint at pcp=2 against pcp=1, on the defaults engine's batches.

    python -m pytest -q -s tests/gpu/test_fp8_gpu.py      # one GPU is enough (shared-GPU worker)

The tiny checkpoint's weights written in the layout of the published Qwen3.6-35B-A3B-FP8
(``make_checkpoint --fp8``: 128x128 weight blocks, activations scaled per 128-wide group of a row, the
narrow layers in bf16), at pcp=1 and pcp=2 (eager, greedy, 32 tokens, top-5), and the bf16 checkpoint
at pcp=1 for contrast. Passes when vLLM's check_logprobs_close rule holds for every prompt with no
NaN/Inf, the FP8 engines ran with their quantization and answered differently from bf16 (their FP8
kernels ran), and case 1 (16384-token steps) is bit for bit, as in bf16.

Online FP8 (``quantization="fp8"``, ``"fp8_per_tensor"``, ``"fp8_per_block"``) is refused at pcp > 1
(``checks.fp8_problems``, ``tests/test_fp8.py``): with it pcp=2 departed from pcp=1 beyond the rule.
"""

import pytest
import torch

from . import e2e
from .test_pcp_e2e import CASE1_LENGTHS, CASE_RUNS, _engine_specs, _parallel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

LAYOUTS = ("pcp1", "pcp2")


def fp8_jobs():
    spec = _engine_specs()["defaults"]
    model = e2e.checkpoint("tiny", fp8=True)
    jobs = {}
    for layout in LAYOUTS:
        parallel, ranks = _parallel(layout)
        jobs[f"fp8_checkpoint_{layout}"] = ({**spec, "llm": {**spec["llm"], "model": model, **parallel}}, ranks)
    jobs["fp8_bf16_pcp1"] = ({**spec, "actions": []}, 1)  # the unquantized answers, for contrast
    return jobs


@pytest.mark.engine_jobs(builder=fp8_jobs)
def test_fp8_checkpoint_pcp2_matches_pcp1(engine_pool):
    results = {layout: e2e.result(engine_pool, f"fp8_checkpoint_{layout}") for layout in LAYOUTS}
    ref, pcp2 = (e2e.outputs(results[layout]) for layout in LAYOUTS)
    bf16 = e2e.outputs(e2e.result(engine_pool, "fp8_bf16_pcp1"))
    case1 = CASE_RUNS["case1_unequal_batch"][1]
    c = e2e.compare(ref, pcp2)
    report = {**c, "identical": ref == pcp2,
              "case1_identical": e2e.outputs(results["pcp1"], case1) == e2e.outputs(results["pcp2"], case1),
              "fp8_vs_bf16_pcp1": e2e.compare(bf16, ref)["max_logprob_diff"],
              "quantization": {k: r["quantization"] for k, r in results.items()}}
    print(f"[fp8 checkpoint] pcp2 vs pcp1: ok={c['ok']} max|dlogprob|={c['max_logprob_diff']:.4g} "
          f"case 1 identical={report['case1_identical']} nonfinite={c['nonfinite']} "
          f"diverged={c['diverged_at']} | fp8 vs bf16 at pcp1 {report['fp8_vs_bf16_pcp1']:.4g}")
    e2e.save("fp8_e2e", report)
    assert c["ok"], c
    assert report["case1_identical"], report
    assert all(q == "fp8" for q in report["quantization"].values()), report
    assert ref != bf16, "the FP8 engine answered exactly as bf16 (no FP8 kernel ran?)"
    for layout, r in results.items():
        assert r["max_tokens_one"] == [1] * len(CASE1_LENGTHS), (layout, r["max_tokens_one"])
        assert r["abort_mid_prefill"]["finished"].get("survivor") == 8, (layout, r["abort_mid_prefill"])
