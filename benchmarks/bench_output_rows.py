# SPDX-License-Identifier: Apache-2.0
"""The rows a PCP rank hands back to vLLM after the model: a split step's final gather and a decode
step's sample-row gather, per rank on one GPU.

    python benchmarks/bench_output_rows.py --out DIR    # one GPU; prints a table, writes JSON + PNG

Split step (one fresh prompt of T tokens over N ranks, Qwen3.6-35B-A3B hidden size, bf16):
``PCPContext.gather_output`` with every row (what a split step did before; still what it does when a
request wants prompt logprobs) and with only the rows vLLM samples from (what it does otherwise). Per
rank: the kernels around the all-gather (measured: CUDA events, median), the bytes it sends, the
all-gather on NVLink (modelled with ``predict_ttft``'s constants: the stand-in group below moves no
bytes), the memory the call allocates at its peak (measured), and the saving against the predicted
TTFT of pcp=N (``predict_ttft``).

Decode step (``step_rows.rank0_rows``: every rank samples from rank 0's rows): kernel time and
host time per call (measured) and the all-gather (modelled), against pcp=1's decode inter-token
latency measured on one H200 with vLLM's compile defaults (``chunk_budget_1xh200_2026-12-02``): the
decode ITL after a PCP prefill, predicted.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo: benchmarks/
from benchmarks.plot import log2_axes, save_figure  # noqa: E402
from benchmarks.predict_ttft import (  # noqa: E402
    COLLECTIVE_LATENCY_S,
    CONFIGS,
    HIDDEN,
    NVLINK_BYTES_PER_S,
    RESULTS,
    StepModel,
    load,
)
from benchmarks.timing import cuda_median_ms  # noqa: E402

TOKENS = (32768, 131072, 1048576)
WORLD_SIZES = (2, 4, 8)
DECODE_BATCHES = (1, 16, 256)
PCP1_ITL = RESULTS / "chunk_budget_1xh200_2026-12-02" / "bench_ttft.json"


class StandInGroup:
    """The PCP group's all-gather contract on one GPU, without the collective: it returns an output of
    the right shape (allocated, not written), so only the kernels around a collective are timed and
    its time is modelled from the bytes."""

    def __init__(self, world_size: int, rank: int = 0):
        self.world_size, self.rank_in_group = world_size, rank

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        assert dim == 0
        return torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)


def all_gather_s(world_size: int, bytes_sent: int) -> float:
    """Modelled NVLink all-gather: every GPU receives the other ranks' bytes."""
    return COLLECTIVE_LATENCY_S + (world_size - 1) * bytes_sent / NVLINK_BYTES_PER_S


def peak_mib(fn) -> float:
    """Memory allocated at the call's peak beyond what was allocated before it (its output included)."""
    gc.collect()  # earlier calls' outputs are gone before the base is read
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def split_step(tokens: int, world_size: int, reps: int) -> dict:
    from qwen36_pcp.layers.context import PCPContext
    from qwen36_pcp.plan import PCPPlan

    # the rank that holds the prompt's last token (zigzag: rank 0) does the most work after the gather
    plan = PCPPlan([0], [tokens], world_size, 0)
    group = StandInGroup(world_size)
    hidden = torch.randn(plan.t_pad, HIDDEN, dtype=torch.bfloat16, device="cuda")
    row = {"tokens": tokens, "world_size": world_size}
    for name, all_rows in (("every_row", True), ("sampled_rows", False)):
        def call():
            # one context per step, as in the runner; the runner's padded batch: one prompt, no padding
            ctx = PCPContext(plan, group, "cuda", num_tokens_padded=tokens)
            out = ctx.gather_output(hidden, all_rows)
            call.bytes_sent = ctx.bytes_sent
            return out

        kernels = cuda_median_ms(call, reps)
        comm = all_gather_s(world_size, call.bytes_sent) * 1e3
        row[name] = {"kernels_ms": kernels, "bytes_sent": call.bytes_sent, "all_gather_ms_modelled": comm,
                     "total_ms": kernels + comm, "peak_mib": peak_mib(call)}
    return row


def saved_share_of_ttft(row: dict, model: StepModel) -> float:
    """What the sampled rows save, over pcp=N's TTFT as predict_ttft predicts it now."""
    saved_s = (row["every_row"]["total_ms"] - row["sampled_rows"]["total_ms"]) / 1e3
    return saved_s / model.ttft(CONFIGS[f"pcp{row['world_size']}"], row["tokens"])


def decode_step(num_reqs: int, world_size: int, reps: int, pcp1_itl_ms: float) -> dict:
    from qwen36_pcp.step_rows import rank0_rows

    group = StandInGroup(world_size)
    hidden = torch.randn(num_reqs, HIDDEN, dtype=torch.bfloat16, device="cuda")
    rows = torch.arange(num_reqs, device="cuda")
    kernels = cuda_median_ms(lambda: rank0_rows(group, hidden, rows), reps)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        rank0_rows(group, hidden, rows)
    host = (time.perf_counter() - t0) / reps * 1e3
    torch.cuda.synchronize()
    comm = all_gather_s(world_size, num_reqs * HIDDEN * 2) * 1e3
    # launched after the step's CUDA graph, so its kernels or its host time (whichever is longer) and
    # the collective come on top of the step
    extra = max(kernels, host) + comm
    return {"num_reqs": num_reqs, "world_size": world_size, "kernels_ms": kernels, "host_ms": host,
            "all_gather_ms_modelled": comm, "extra_ms": extra, "pcp1_itl_ms": pcp1_itl_ms,
            "itl_ratio_predicted": (pcp1_itl_ms + extra) / pcp1_itl_ms}


def report(result: dict, model: StepModel) -> str:
    lines = ["Split step: the final gather per rank, one prompt (every row: before, and with prompt logprobs;"
             " sampled rows: after)",
             f"{'tokens':>8} {'N':>2} | {'kernels ms':>17} | {'sent MiB':>15} | {'all-gather ms*':>15} | "
             f"{'peak MiB':>17} | {'saved, % of TTFT*':>17}",
             f"{'':>8} {'':>2} | {'before':>8} {'after':>8} | {'before':>7} {'after':>7} | "
             f"{'before':>7} {'after':>7} | {'before':>8} {'after':>8} |"]
    for r in result["split"]:
        b, a = r["every_row"], r["sampled_rows"]
        lines.append(
            f"{r['tokens']:>8} {r['world_size']:>2} | {b['kernels_ms']:>8.3f} {a['kernels_ms']:>8.3f} | "
            f"{b['bytes_sent'] / 2**20:>7.1f} {a['bytes_sent'] / 2**20:>7.3f} | "
            f"{b['all_gather_ms_modelled']:>7.3f} {a['all_gather_ms_modelled']:>7.3f} | "
            f"{b['peak_mib']:>8.0f} {a['peak_mib']:>8.0f} | {100 * saved_share_of_ttft(r, model):>16.2f}%")
    lines += ["", "Decode step: every rank samples from rank 0's rows (pcp1 ITL measured, compiled)",
              f"{'reqs':>5} {'N':>2} | {'kernels ms':>10} {'host ms':>8} {'all-gather ms*':>15} | "
              f"{'pcp1 ITL ms':>11} {'ITL ratio*':>10}"]
    for r in result["decode"]:
        lines.append(f"{r['num_reqs']:>5} {r['world_size']:>2} | {r['kernels_ms']:>10.4f} {r['host_ms']:>8.4f} "
                     f"{r['all_gather_ms_modelled']:>15.4f} | {r['pcp1_itl_ms']:>11.2f} "
                     f"{r['itl_ratio_predicted']:>9.3f}x")
    lines.append("* modelled: NVLink all-gather from its bytes (predict_ttft's constants); TTFT predicted by "
                 "predict_ttft; the rest measured on one GPU")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    def draw(ax):
        for n in WORLD_SIZES:
            rows = [r for r in result["split"] if r["world_size"] == n]
            t = [r["tokens"] for r in rows]
            line, = ax.plot(t, [r["every_row"]["total_ms"] for r in rows], marker="o",
                            label=f"pcp{n}, every row (before)")
            ax.plot(t, [r["sampled_rows"]["total_ms"] for r in rows], marker="s", linestyle="--",
                    color=line.get_color(), label=f"pcp{n}, sampled rows")
        log2_axes(ax, "prompt tokens (one step)", "final gather per rank, ms (kernels + NVLink model)",
                  "Split step's final gather, H200", log_y=True)
    save_figure(path, draw)


def main():
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default="/tmp/qwen36_pcp_bench/bench_output_rows")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--report-only", action="store_true", help="print the table of --out's JSON")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_output_rows.json"
    if not args.report_only:
        itl = load(PCP1_ITL)["pcp1"]["itl_ms"]
        result = {"device": torch.cuda.get_device_name(),
                  "split": [split_step(t, n, args.reps) for t in TOKENS for n in WORLD_SIZES],
                  "decode": [decode_step(b, n, args.reps, itl) for b in DECODE_BATCHES for n in WORLD_SIZES]}
        path.write_text(json.dumps(result, indent=1) + "\n")
    result = load(path)
    text = report(result, StepModel())
    print(text)
    (out / "table.txt").write_text(text + "\n")
    plot(result, str(out / "bench_output_rows.png"))


if __name__ == "__main__":
    main()
