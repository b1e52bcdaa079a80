# SPDX-License-Identifier: Apache-2.0
"""The first output token's detokenization on the front end, vLLM's priming against the prompt tail's.

    python benchmarks/bench_detokenizer.py --out DIR     # CPU; prints a table, writes JSON + PNG

vLLM's ``FastIncrementalDetokenizer`` for one request (the Qwen3.6-35B-A3B checkpoint's tokenizer, as
``make_checkpoint`` writes it; prompts as ``bench_ttft`` makes them): the time from its creation
through its first ``update``, which is on the path of every first token. "whole prompt" is vLLM 0.20.2
as it is; "prompt tail" is with ``qwen36_pcp.prompt_tail`` (what ``qwen36_pcp.patches`` applies in a
front end of a pcp > 1 engine). ``predict_ttft`` reads the first column from this JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo: benchmarks/
from benchmarks.plot import log2_axes, save_figure  # noqa: E402

TOKENS = (32768, 131072, 1048576)


def first_token_s(tokenizer, prompt: list[int], tail: bool, reps: int) -> float:
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    from qwen36_pcp import patches

    request = EngineCoreRequest(
        request_id="r", prompt_token_ids=prompt, mm_features=None, sampling_params=SamplingParams(),
        pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None, data_parallel_rank=None)
    times = []
    with mock.patch.object(patches, "serves_pcp", lambda: tail):
        for _ in range(reps):
            t0 = time.perf_counter()
            FastIncrementalDetokenizer(tokenizer, request).update([prompt[0]], stop_terminated=False)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default="/tmp/qwen36_pcp_bench/bench_detokenizer")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    from benchmarks.bench_ttft import checkpoint, prompt
    from qwen36_pcp import patches

    next(p for p in patches.PATCHES if p.owner is FastIncrementalDetokenizer).install()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint(str(out)))
    rows = []
    for n in TOKENS:
        ids = list(prompt(n)["prompt_token_ids"])
        whole, tail = (first_token_s(tokenizer, ids, t, args.reps) for t in (False, True))
        rows.append({"tokens": n, "whole_prompt_s": whole, "prompt_tail_s": tail})
    (t1, w1), (t2, w2) = ((r["tokens"], r["whole_prompt_s"]) for r in (rows[0], rows[-1]))
    result = {"rows": rows, "whole_prompt_s_per_token": (w2 - w1) / (t2 - t1)}
    (out / "bench_detokenizer.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["first output token's detokenization on the front end (measured, this machine's CPU)",
             f"{'tokens':>8} | {'whole prompt ms':>15} | {'prompt tail ms':>14}"]
    lines += [f"{r['tokens']:>8} | {1e3 * r['whole_prompt_s']:>15.2f} | {1e3 * r['prompt_tail_s']:>14.3f}"
              for r in rows]
    lines.append(f"whole prompt: {1e6 * result['whole_prompt_s_per_token']:.2f} us per prompt token")
    text = "\n".join(lines)
    print(text)
    (out / "table.txt").write_text(text + "\n")

    def draw(ax):
        for key, label in (("whole_prompt_s", "whole prompt (vLLM 0.20.2)"), ("prompt_tail_s", "prompt tail")):
            ax.plot([r["tokens"] for r in rows], [1e3 * r[key] for r in rows], marker="o", label=label)
        log2_axes(ax, "prompt tokens", "first token's detokenization, ms", "Front end, first output token",
                  log_y=True)
    save_figure(str(out / "bench_detokenizer.png"), draw)


if __name__ == "__main__":
    main()
