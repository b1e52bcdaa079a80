# SPDX-License-Identifier: Apache-2.0
"""The arithmetic of ``serve_check_gpu.py``, without a GPU: measured against predicted.

- **Latency** (part ``serve``): a ``vllm bench serve --save-result --save-detailed`` result (vLLM 0.20.2's
  keys) gives the trace the simulator replays (``serve_sim_traffic.from_bench_result``) and the measured
  percentiles (``p50_ttft_ms`` ...); ``error_cells`` sets each beside the simulator's, error = predicted /
  measured - 1; ``error_table`` and ``plot_errors`` show them.
- **Step mix** (part ``pcp2``): the step records of an emulated pcp=2 engine (``harness.shared_gpu``'s
  ``QWEN36_PCP_RECORD_STEPS`` lines: a forward's kind and token counts) against the steps the simulator
  takes on the same trace (``simulate_steps``: vLLM's scheduler, each step's split decided as the plugin
  decides it): ``compare_mix`` counts the steps that compute prompt tokens, those split, the tokens split,
  and judges them within ``TOLERANCE``.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: benchmarks/
from benchmarks.serve_sim_engine import Arrival  # noqa: E402

METRICS = (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT"))
PERCENTILES = ("50", "99")
RESULT_NAME = re.compile(r"^bench_rate(?P<rate>[0-9.]+|inf)\.json$")
LONG_PROMPT = 8192  # tokens: as harness.shared_gpu.LONG_PROMPT (a test holds them equal)


# ------------------------------------------------------------------------------------------ latency
def result_name(rate: float) -> str:
    return f"bench_rate{rate:g}.json"


def result_files(folder: Path) -> list[tuple[float, Path]]:
    """(rate, path) of every bench serve result in ``folder`` (``result_name``), by rate."""
    found = [(float(m["rate"]), p) for p in Path(folder).iterdir() if (m := RESULT_NAME.match(p.name))]
    return sorted(found)


def measured_metrics(result: dict) -> dict:
    """{metric: {"p50": ms, "p99": ms}} of a bench serve result: its own percentiles (``p50_ttft_ms``,
    written with ``--metric-percentiles 50,...,99``), else computed as bench serve computes them from the
    per-request lists (``ttfts``, ``itls``; TPOT needs the latencies, which the result lacks)."""
    import numpy as np

    out = {}
    for key, _ in METRICS:
        out[key] = {}
        for p in PERCENTILES:
            value = result.get(f"p{p}_{key}_ms")
            if value is None and key in ("ttft", "itl"):
                ok = [i for i, e in enumerate(result.get("errors") or []) if not e]
                values = ([result["ttfts"][i] for i in ok] if key == "ttft"
                          else [x for i in ok for x in result["itls"][i]])
                value = float(np.percentile(values or [0.0], float(p)) * 1e3)
            out[key][f"p{p}"] = value
    return out


def error_cells(measured: dict, predicted: dict) -> dict:
    """{"ttft_p50_ms": {"measured", "predicted", "error"}, ...}: ``measured`` as ``measured_metrics``,
    ``predicted`` as ``serve_sim.simulate`` returns it (seconds); error = predicted / measured - 1."""
    cells = {}
    for key, _ in METRICS:
        for p in PERCENTILES:
            m, s = measured[key][f"p{p}"], predicted[key][f"p{p}"] * 1e3
            error = s / m - 1 if m else None
            cells[f"{key}_p{p}_ms"] = {"measured": m, "predicted": s, "error": error}
    return cells


def _ms(v) -> str:
    return f"{v:>9.1f}" if v is not None else f"{'-':>9}"


def _error(e) -> str:
    return f"{e:>+6.0%}" if e is not None else f"{'-':>6}"


def error_table(runs: dict, title: str) -> list[str]:
    """``runs``: {rate: {"requests": n, "cells": error_cells(...)}}; one line per rate, then each metric's
    largest error over the rates."""
    heads = " ".join(f"{label + ' ' + p:>26}" for _, label in METRICS for p in ("p50", "p99"))
    lines = [title, f"{'rate/s':>6} {'reqs':>5} " + heads,
             f"{'':>6} {'':>5} " + " ".join(f"{'measured predicted error':>26}" for _ in range(2 * len(METRICS)))]
    for rate, run in sorted(runs.items(), key=lambda kv: float(kv[0])):
        cells = [run["cells"][f"{key}_p{p}_ms"] for key, _ in METRICS for p in PERCENTILES]
        lines.append(f"{float(rate):>6g} {run['requests']:>5} " + " ".join(
            f"{_ms(c['measured'])} {_ms(c['predicted'])} {_error(c['error'])}" for c in cells))
    worst = []
    for key, label in METRICS:
        for p in PERCENTILES:
            errors = [(abs(r["cells"][f"{key}_p{p}_ms"]["error"]), rate) for rate, r in runs.items()
                      if r["cells"][f"{key}_p{p}_ms"]["error"] is not None]
            if errors:
                e, rate = max(errors)
                worst.append(f"{label} p{p} {e:.0%} (at {float(rate):g}/s)")
    if worst:
        lines.append("largest |error| per metric: " + ", ".join(worst))
    return lines


def plot_errors(runs: dict, path: str, title: str) -> None:
    """Measured (solid, filled) and predicted (dashed, hollow) TTFT, ITL and TPOT p50/p99 against the request
    rate (log axes)."""
    from benchmarks.plot import log_log_axes, save_figure

    rates = sorted(runs, key=float)

    def draw(ax):
        import matplotlib.pyplot as plt

        colors = plt.get_cmap("tab10")
        for i, (key, label) in enumerate(METRICS):
            for p, marker in zip(PERCENTILES, "os"):
                cells = [runs[r]["cells"][f"{key}_p{p}_ms"] for r in rates]
                x = [float(r) for r in rates]
                ax.plot(x, [math.nan if c["measured"] is None else c["measured"] for c in cells], marker=marker,
                        color=colors(i),
                        label=f"{label} p{p} measured")
                ax.plot(x, [c["predicted"] for c in cells], marker=marker, color=colors(i), linestyle="--",
                        markerfacecolor="none", label=f"{label} p{p} predicted")
        log_log_axes(ax, "request rate (requests/s)", "ms", title)
        ax.set_xticks([float(r) for r in rates], [f"{float(r):g}" for r in rates])  # the rates run, plainly
        ax.minorticks_off()
    save_figure(path, draw, fontsize=5, ncol=3)


# ----------------------------------------------------------------------------------------- step mix
def parse_step_lines(lines) -> list[dict]:
    """The forwards ``harness.shared_gpu.record_step_kinds`` wrote (one rank's file), in order: {"kind",
    and its counts: "prompt", "split", "long", "long_split", "verify"}; ``handover`` lines are left out."""
    out = []
    for line in lines:
        kind, *fields = line.split()
        if kind == "handover":
            continue
        out.append({"kind": kind, **{k: int(v) for k, v in (f.split("=") for f in fields)}})
    return out


def prompt_steps(forwards: list[dict]) -> list[dict]:
    """The forwards that compute prompt tokens (not decode steps, nor the engine's dummy runs), each as
    {"prompt", "split" (tokens of split requests), "split_step", "long", "long_split"}."""
    return [{"prompt": f["prompt"], "split": f.get("split", 0), "split_step": f["kind"].startswith("split"),
             "long": f.get("long", 0), "long_split": f.get("long_split", 0)}
            for f in forwards if f.get("prompt", 0) > 0]


def step_mix(steps: list[dict]) -> dict:
    """Counts over ``prompt_steps``: steps, split steps, their tokens; the share of the long prompts' tokens
    (prompts of ``LONG_PROMPT`` tokens or more) computed in split steps."""
    long = sum(s["long"] for s in steps)
    return {"prompt_steps": len(steps), "split_steps": sum(s["split_step"] for s in steps),
            "prompt_tokens": sum(s["prompt"] for s in steps), "split_tokens": sum(s["split"] for s in steps),
            "long_tokens": long, "long_split_tokens": sum(s["long_split"] for s in steps),
            "long_split_share": sum(s["long_split"] for s in steps) / long if long else None}


# (relative, absolute) tolerance of engine - simulator; a key within either passes
TOLERANCE = {"prompt_tokens": (0.0, 0), "split_steps": (0.1, 1), "split_tokens": (0.05, 0),
             "long_split_share": (0.0, 0.02)}


def within(engine, sim, rel: float, absolute: float) -> bool:
    if engine is None or sim is None:
        return engine is sim
    return abs(engine - sim) <= max(absolute, rel * abs(sim))


def compare_mix(engine_steps: list[dict], sim_steps: list[dict]) -> dict:
    """The two step mixes, each key's difference and whether it is within ``TOLERANCE``; the first prompt
    step where the two sequences differ (None: the same steps, in the same order)."""
    engine, sim = step_mix(engine_steps), step_mix(sim_steps)
    rows = {}
    for key in engine:
        tol = TOLERANCE.get(key)
        rows[key] = {"engine": engine[key], "sim": sim[key],
                     "ok": within(engine[key], sim[key], *tol) if tol else None}
    keys = ("prompt", "split", "split_step")
    pairs = list(zip(engine_steps, sim_steps))
    first = next((i for i, (a, b) in enumerate(pairs) if any(a[k] != b[k] for k in keys)), None)
    if first is None and len(engine_steps) != len(sim_steps):
        first = len(pairs)
    diff = None if first is None else {
        "step": first, "engine": engine_steps[first] if first < len(engine_steps) else None,
        "sim": sim_steps[first] if first < len(sim_steps) else None}
    return {"rows": rows, "ok": all(r["ok"] is not False for r in rows.values()), "first_difference": diff,
            "tolerance": {k: {"relative": r, "absolute": a} for k, (r, a) in TOLERANCE.items()}}


def mix_table(comparison: dict, title: str) -> list[str]:
    lines = [title, f"{'':<22} {'engine':>10} {'simulator':>10}  within tolerance"]
    for key, r in comparison["rows"].items():
        tol = TOLERANCE.get(key)
        how = ""
        if tol is not None:
            bound = f"{tol[1] * 100:g} points" if key.endswith("share") else f"max({tol[1]}, {tol[0]:.0%} of it)"
            how = ("yes" if r["ok"] else "NO") + f" (|engine - simulator| <= {bound})"
        fmt = (lambda v: "-" if v is None else f"{v:.1%}") if key.endswith("share") else str
        lines.append(f"{key:<22} {fmt(r['engine']):>10} {fmt(r['sim']):>10}  {how}")
    d = comparison["first_difference"]
    lines.append("the same prompt steps in the same order (prompt tokens, split tokens, split or not)" if d is None
                 else f"first prompt step that differs: #{d['step']}: engine {d['engine']}, simulator {d['sim']}")
    lines.append(f"step mix within tolerance: {'yes' if comparison['ok'] else 'NO'}")
    return lines


def schedule_difference(engine_calls: list[dict], sim_calls: list[dict]) -> dict | None:
    """The first scheduled step (of those that schedule tokens) whose tokens per request differ between the
    engine's scheduler and the simulator's: {"step", "engine", "sim"}; None: the same schedule."""
    a = [c for c in engine_calls if c]
    b = [c for c in sim_calls if c]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return {"step": i, "engine": x, "sim": y}
    if len(a) != len(b):
        i = min(len(a), len(b))
        return {"step": i, "engine": a[i] if i < len(a) else None, "sim": b[i] if i < len(b) else None}
    return None


def plot_mix(engine_steps: list[dict], sim_steps: list[dict], path: str, title: str) -> None:
    """Tokens split, summed over the prompt steps in order: the engine's against the simulator's."""
    from benchmarks.plot import save_figure

    def draw(ax):
        import itertools

        for steps, style, label in ((engine_steps, "-", "engine (harness step records)"),
                                    (sim_steps, "--", "simulator (serve_sim)")):
            ax.plot(range(1, len(steps) + 1), list(itertools.accumulate(s["split"] for s in steps)),
                    linestyle=style, marker="o", markersize=3, label=label + ": split tokens")
            ax.plot(range(1, len(steps) + 1), list(itertools.accumulate(s["prompt"] for s in steps)),
                    linestyle=style, marker=".", markersize=2, label=label + ": prompt tokens")
        ax.set_xlabel("step computing prompt tokens (in order)")
        ax.set_ylabel("tokens, summed")
        ax.set_title(title, fontsize=7, wrap=True)
        ax.grid(alpha=0.3)
    save_figure(path, draw, fontsize=6)


# --------------------------------------------------------------------------------- the simulator's steps
def step_record(prompts: list[tuple[int, int]], pcp: int) -> dict:
    """A step of the simulator as ``prompt_steps`` reads the engine's record of it: ``prompts``, per request
    computing prompt tokens, (its new tokens, its prompt's length); a request is split as the plugin's plan
    splits it (``predict_ttft.splits``: the default options' threshold)."""
    from benchmarks.predict_ttft import splits

    split = [splits(n, pcp) for n, _ in prompts]
    long = [length >= LONG_PROMPT for _, length in prompts]
    return {"prompt": sum(n for n, _ in prompts), "split": sum(n for (n, _), s in zip(prompts, split) if s),
            "split_step": any(split), "long": sum(n for (n, _), g in zip(prompts, long) if g),
            "long_split": sum(n for (n, _), s, g in zip(prompts, split, long) if s and g)}


def replica(opt, pcp: int, max_model_len: int):
    """One simulated engine of ``pcp`` ranks (``serve_sim_engine.Replica``) with ``opt``'s settings (a
    ``serve_sim.Options``; its ``kv_bytes`` given); with the step-time model and its config."""
    from benchmarks import serve_sim
    from benchmarks.predict_ttft import Rows
    from benchmarks.serve_sim_engine import EngineShape, Replica

    shape = EngineShape(tp=1, budget=opt.budget, max_num_seqs=opt.max_num_seqs, max_model_len=max_model_len,
                        kv_bytes=opt.kv_bytes, mtp=opt.mtp, prefix_caching=opt.prefix_caching,
                        async_scheduling=opt.async_scheduling, layers=opt.layers)
    model, cfg = serve_sim.step_model(opt.gpu, opt.layers), serve_sim.Layout(pcp=pcp).config()
    return Replica(shape, lambda rows: model.batch_step(cfg, rows, opt.mtp), Rows, opt.accept), model, cfg


def simulate_steps(trace: list[tuple[str, Arrival]], opt, pcp: int, max_model_len: int) -> dict:
    """``trace`` ({name: arrival}) through one engine of ``pcp`` ranks on the simulator (vLLM's scheduler
    as ``serve_sim.simulate`` drives it), recording every ``schedule()`` call: "calls", per call the tokens it
    scheduled per request (empty: nothing scheduled); "steps", per call that scheduled prompt tokens, the
    counts ``prompt_steps`` reads from the engine; "added_at", the calls made before each request arrived
    (an engine that adds each request after as many calls sees the simulator's traffic step for step);
    the latency metrics (``serve_sim.summarize``) and the KV cache's blocks."""
    from benchmarks import serve_sim
    from benchmarks.predict_ttft import Rows
    from benchmarks.serve_sim_engine import step_rows

    rep, model, cfg = replica(opt, pcp, max_model_len)
    calls, steps, schedule = [], [], rep.sched.schedule

    def recorded():
        so = schedule()
        calls.append(dict(so.num_scheduled_tokens))
        rows = step_rows(rep.sched, so, Rows)
        prompts = [(r.new, rep.sched.requests[rid].num_prompt_tokens)
                   for rid, r in zip(so.num_scheduled_tokens, rows) if r.prompt]
        if prompts:
            steps.append(step_record(prompts, pcp))
        return so

    rep.sched.schedule = recorded
    added = {}
    for name, a in sorted(trace, key=lambda x: (x[1].time, x[0])):
        rep.advance(a.time)
        added[name] = len(calls)
        rep.add(name, a)
    rep.advance(math.inf)
    unfinished = [n for n, rec in rep.records.items() if rec.finished is None]
    if unfinished:
        raise RuntimeError(f"the simulator never finished {unfinished}")
    metrics = serve_sim.summarize([rep], model, cfg)
    return {"calls": calls, "steps": steps, "added_at": added, "metrics": metrics,
            "num_blocks": rep.setup["num_blocks"], "block_size": rep.setup["block_size"],
            "prefix_caching": rep.setup["prefix_caching"], "async_scheduling": rep.async_,
            "end_s": max(rec.finished for rec in rep.records.values())}


def load_json(path) -> dict:
    return json.loads(Path(path).read_text())
