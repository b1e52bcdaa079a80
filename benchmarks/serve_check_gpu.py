# SPDX-License-Identifier: Apache-2.0
"""The serving simulator (``serve_sim.py``) against an engine on ONE H100 or H200, in one command:

    python benchmarks/serve_check_gpu.py --out DIR                  # both parts, about 8-9 minutes
    python benchmarks/serve_check_gpu.py --out DIR --parts serve    # part 1 alone (about 5-6 minutes)
    python benchmarks/serve_check_gpu.py --out DIR --parts pcp2     # part 2 alone (about 3 minutes)
    python benchmarks/serve_check_gpu.py --out DIR --report-only    # the tables again from DIR

Qwen3.6-35B-A3B's shape with dummy weights (config and tokenizer from the checkpoint maker, no download),
its first ``--layers`` layers (8: the whole model leaves an H100 almost no KV memory).

1. ``serve`` (first: the more valuable part). ``vllm serve`` at pcp=1 (vLLM's serve defaults: torch.compile,
   CUDA graphs, async scheduling, chunked prefill at ``--budget``; prefix caching off, as vLLM's default for
   this model) and ``vllm bench serve`` (random prompts of ``--input-len`` x (1 -/+ ``--range-ratio``) tokens,
   ``--output-len`` tokens each) at ``--rates`` from light to saturated, after a warm-up pass that is not
   measured (``--warmup-prompts`` requests at once, into ``DIR/warmup``); then ``serve_sim`` on the very trace
   each bench serve sent (its measured start times, the server's prompt lengths, the output lengths), with
   the server's KV cache (read from its log) and the card's step-time model. Measured against predicted
   TTFT, ITL and TPOT p50/p99, error = predicted / measured - 1: ``serve_table.txt``,
   ``serve_comparison.json``, ``serve_check.png``, rewritten after each rate (a run cut short keeps what
   it measured). The step-time model's prefill is fitted on an H200: on an H100 the error holds that too.
2. ``pcp2``. An emulated pcp=2 engine (both ranks on the one GPU, ``harness.shared_gpu.SharedGPUWorker``;
   offline ``LLM``, engine core in this process, eager) on a short trace of long prompts (17k-32k tokens)
   arriving while shorter requests decode, with the harness's step records on
   (``QWEN36_PCP_RECORD_STEPS``: each forward's kind and token counts), against the steps ``serve_sim``
   takes at pcp=2 on the same trace: the steps that compute prompt tokens, those split, the tokens split,
   the long prompts' share split, within ``serve_check_compare.TOLERANCE``. With ``--pcp2-arrivals steps``
   (default) each request reaches the engine after as many ``schedule()`` calls as it reached the
   simulator's scheduler (the emulated engine, its collectives through host memory, runs slower than two
   GPUs: wall-clock arrivals would meet other steps); ``wall``: at its trace time x ``--pcp2-time-scale``.
   The engine's own schedule is compared too (first step that differs). ``pcp2_table.txt``,
   ``pcp2_comparison.json``, ``pcp2_step_mix.png``.

``--time-budget`` (seconds from the start, default 540) bounds the whole run: a rate (or the warm-up pass)
that would not finish in it by ``rate_seconds``' guess is skipped, and part 2 starts only with
``--pcp2-min-s`` (150) left. Wall time on a fresh machine (both parts took 464 s on one H100 with budget 500,
before the warm-up pass existed): the server's start ~150-180 s (Triton JIT, torch.compile, CUDA graphs), the
warm-up pass and each rate 20-35 s (bench serve's own start ~10 s), the server's stop up to ~30 s, part 2
~60-90 s of start (kernels cached by part 1) and ~20-60 s of trace. The default: ~180 s of start, ~160 s of
bench serve (``rate_seconds``: 35 for the warm-up pass, then 47, 41, 38 for the default rates), ~30 s of stop
and part 2's 150 s make ~520 s; 540 leaves part 2 its time with every rate run, and the whole run (part 2's
stop and the report come after the budget) under a 600 s limit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo: benchmarks/, harness/

PARTS = ("serve", "pcp2")
OVERRIDES = {"architectures": ["Qwen3_6ForCausalLM"]}
# part 2's trace: (name, arrival s, prompt tokens, output tokens). The short requests (unsplit: under the
# 4096-token split floor) decode while the long ones arrive, l2 right behind l1 (a step holding l1's last
# chunk beside l2's first)
PCP2_TRACE = (("s0", 0.0, 1000, 160), ("s1", 0.005, 1800, 160), ("s2", 0.01, 2600, 160), ("s3", 0.015, 3400, 160),
              ("l0", 0.10, 17000, 16), ("l1", 0.25, 30000, 16), ("l2", 0.27, 22000, 16), ("l3", 0.55, 32000, 16))
PCP2_WARMUP = 8192  # tokens of the request that runs before the trace (a split step: its kernels built)


# ---------------------------------------------------------------------------------------------- setup
def gpu_kind() -> str:
    """``h100`` or ``h200`` from nvidia-smi's name of GPU 0 (the step-time model's cards)."""
    name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                          capture_output=True, text=True, check=True).stdout.strip()
    if "H200" in name:
        return "h200"
    if "H100" in name:
        return "h100"
    raise SystemExit(f"GPU 0 is {name!r}: the step-time model knows H100 and H200 only")


def checkpoint(work: Path, layers: int) -> str:
    """Qwen3.6-35B-A3B's config and tokenizer (no weights: the engines load dummy ones), its first
    ``layers`` layers (whole periods of 3 GDN + 1 attention)."""
    from qwen36_pcp.tools.make_checkpoint import make_checkpoint

    path = make_checkpoint(work / f"qwen3.6-35b-a3b-{layers}-layers", preset="qwen3.6-35b-a3b")
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    assert layers % text["full_attention_interval"] == 0, "whole periods of the layer pattern"
    text.update(num_hidden_layers=layers, layer_types=text["layer_types"][:layers])
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return str(path)


def left(deadline: float) -> float:
    return deadline - time.monotonic()


def stop_group(proc: subprocess.Popen, grace: float = 30) -> None:
    """A process started with ``start_new_session`` and its whole group (engine core, workers): SIGINT,
    ``grace`` s, then SIGKILL; returns once no process of the group is left (at most 20 s more)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    end = time.monotonic() + 20
    while time.monotonic() < end and _group_alive(proc.pid):
        time.sleep(0.5)


def _group_alive(pgid: int) -> bool:
    rows = subprocess.run(["ps", "-eo", "pgid=,stat="], capture_output=True, text=True).stdout.splitlines()
    return any(r.split()[:1] == [str(pgid)] and not r.split()[1].startswith("Z") for r in rows)


# ------------------------------------------------------------------------------------- part 1: serve
def serve_command(args, ckpt: str) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", ckpt, "--load-format", "dummy",
            "--hf-overrides", json.dumps(OVERRIDES), "--gdn-prefill-backend", "triton",
            "--max-model-len", str(args.max_model_len), "--max-num-batched-tokens", str(args.budget),
            "--max-num-seqs", str(args.max_num_seqs), "--no-enable-prefix-caching",
            "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--port", str(args.port),
            "--served-model-name", "model", "--seed", "0"]


def bench_command(args, ckpt: str, rate: float, num_prompts: int, out: Path) -> list[str]:
    """``vllm bench serve`` (vLLM 0.20.2's flags) against the server on ``args.port``: the random dataset,
    every output ``--output-len`` tokens (``--ignore-eos``), the result with per-request detail saved as
    ``out/bench_rate<rate>.json``, percentiles 50, 90, 99."""
    from benchmarks.serve_check_compare import result_name

    ratio = json.dumps({"input": args.range_ratio, "output": 0.0})
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
            "--base-url", f"http://127.0.0.1:{args.port}", "--endpoint", "/v1/completions", "--model", "model",
            "--tokenizer", ckpt, "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", ratio,
            "--num-prompts", str(num_prompts), "--request-rate", f"{rate:g}", "--seed", "0", "--ignore-eos",
            "--num-warmups", str(args.num_warmups), "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(out), "--result-filename", result_name(rate),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]


def start_server(args, ckpt: str, log_path: Path) -> subprocess.Popen:
    cmd = serve_command(args, ckpt)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    print("$", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)


def wait_ready(proc: subprocess.Popen, port: int, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError("vllm serve exited:\n" + log_path.read_text()[-4000:])
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve not ready in {timeout:.0f} s:\n" + log_path.read_text()[-4000:])
            time.sleep(2)


def server_settings(log_text: str) -> dict:
    """What the simulator needs of the server, from its log: the KV cache memory its profile left
    (``Available KV cache memory: X GiB``) and whether it schedules asynchronously."""
    kv = re.findall(r"Available KV cache memory: ([0-9.]+) GiB", log_text)
    sched = re.findall(r"Asynchronous scheduling is (enabled|disabled)", log_text)
    return {"kv_gib": float(kv[-1]) if kv else None,
            "async_scheduling": sched[-1] == "enabled" if sched else None}


def rate_plan(rates: list[float], num_prompts: list[int]) -> list[tuple[float, int]]:
    if len(num_prompts) not in (1, len(rates)):
        raise SystemExit(f"--num-prompts: one count, or one per rate ({len(rates)})")
    return list(zip(rates, num_prompts * len(rates) if len(num_prompts) == 1 else num_prompts))


def rate_seconds(rate: float, num_prompts: int) -> float:
    """A generous guess of one bench serve's wall time: its start (~10 s: vLLM's import, the dataset), the
    arrivals, and the queue's drain."""
    # rate inf (the warm-up pass): every request arrives at once, so no arrival term, and 35 s in all. Enough
    # for the default 160 prompts: the 48/s pass of the same 160 prompt lengths lasted 7 s on one H100 at 8
    # layers (saturated, so all at once drains about as fast), and a cold server's first prompts add a few
    # seconds of Triton compiles (0.4-1.6 s for each of the first 7 in the 2026-12-07 run), inside the 20 s
    # drain. It does not grow with --warmup-prompts: several hundred prompts would need more.
    return 15 + (0 if math.isinf(rate) else num_prompts / rate) + 20


def bench_plan(args) -> list[tuple[float, int]]:
    """bench serve's runs in order, (rate, prompts): the warm-up pass (rate inf) with ``--warmup-prompts``,
    then ``rate_plan``'s."""
    warmup = [(math.inf, args.warmup_prompts)] if args.warmup_prompts else []
    return warmup + rate_plan(args.rates, args.num_prompts)


def bench_rates(args, ckpt: str, out: Path, deadline: float, on_result=None) -> list[str]:
    """Every rate of ``--rates`` against the running server, each as far as the time left allows;
    ``on_result()`` after each. What was skipped or failed, in words. First, with ``--warmup-prompts``,
    a warm-up pass, not measured, of that many requests at once (its result and log in ``out/warmup``):
    bench serve's random dataset with the same seed draws the same first prompt lengths for every count
    (the lengths before the tokens), so it meets each rate's first lengths; a fresh server compiles Triton
    kernels for the prompt lengths it meets first (the first requests of a cold run took 0.4-1.6 s for a
    0.05-0.1 s prefill), which the simulator does not model."""
    notes = []
    for i, (rate, n) in enumerate(bench_plan(args)):
        warmup = bool(args.warmup_prompts) and i == 0
        what = "the warm-up pass" if warmup else f"rate {rate:g}/s"
        need = rate_seconds(rate, n)
        if left(deadline) < need:
            notes.append(f"{what} skipped: {left(deadline):.0f} s left, ~{need:.0f} s needed")
            print(notes[-1], flush=True)
            continue
        folder = out / "warmup" if warmup else out
        folder.mkdir(exist_ok=True)
        cmd = bench_command(args, ckpt, rate, n, folder)
        print("$", " ".join(cmd), flush=True)
        log = folder / ("serve_bench_warmup.log" if warmup else f"serve_bench_rate{rate:g}.log")
        try:
            with open(log, "w") as f:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env={
                    **os.environ, "HF_HUB_OFFLINE": "1"}, timeout=max(10.0, min(args.bench_timeout,
                                                                                 left(deadline) - 5))).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc != 0:
            notes.append(f"{what}: bench serve ended with {rc} (see {log.relative_to(out)})")
            print(notes[-1] + "\n" + log.read_text()[-3000:], flush=True)
        if on_result is not None and not warmup:
            try:
                on_result()
            except Exception as e:  # noqa: BLE001 - a report that fails must not stop the measurements
                notes.append(f"{what}: the comparison failed: {type(e).__name__}: {e}")
                print(notes[-1], flush=True)
    return notes


def run_serve(args, ckpt: str, gpu: str, out: Path, deadline: float) -> list[str]:
    log_path = out / "serve_vllm.log"
    t0 = time.monotonic()
    proc = start_server(args, ckpt, log_path)
    notes = []
    try:
        wait_ready(proc, args.port, log_path, min(args.ready_timeout, left(deadline)))
        found = server_settings(log_path.read_text())
        settings = {"gpu": gpu, "layers": args.layers, "budget": args.budget, "max_num_seqs": args.max_num_seqs,
                    "prefix_caching": False, "mtp": 0, "ready_s": round(time.monotonic() - t0, 1),
                    "rates": args.rates, "num_prompts": args.num_prompts, "input_len": args.input_len,
                    "range_ratio": args.range_ratio, "output_len": args.output_len, "command": " ".join(sys.argv),
                    **found}
        print(f"vllm serve ready after {settings['ready_s']} s: {found}", flush=True)
        (out / "serve_settings.json").write_text(json.dumps(settings, indent=1) + "\n")
        notes = bench_rates(args, ckpt, out, deadline - 30, on_result=lambda: report_serve(out, quiet=True))
    except RuntimeError as e:
        notes.append(f"part serve: {e}".splitlines()[0])
        print(e, flush=True)
    finally:
        stop_group(proc)
    if notes:
        (out / "serve_notes.txt").write_text("\n".join(notes) + "\n")
    return notes


_predicted: dict = {}  # (path, mtime, settings) -> serve_sim's metrics: a report after each rate simulates once


def report_serve(out: Path, quiet: bool = False) -> list[str]:
    """Every bench serve result in ``out`` against the simulator on its trace: the table, the JSON, the
    plot (rewritten each time)."""
    from benchmarks import serve_sim
    from benchmarks.serve_check_compare import error_cells, error_table, measured_metrics, plot_errors, result_files
    from benchmarks.serve_sim_traffic import from_bench_result

    settings_path = out / "serve_settings.json"
    if not settings_path.exists():
        return []
    s = json.loads(settings_path.read_text())
    kv = s.get("kv_gib")
    opt = serve_sim.Options(budget=s["budget"], mtp=s.get("mtp", 0), accept=0.0, gpu=s["gpu"], layers=s["layers"],
                            max_num_seqs=s.get("max_num_seqs", 1024), prefix_caching=s.get("prefix_caching", False),
                            async_scheduling=s.get("async_scheduling") is not False,
                            kv_bytes=int(kv * 2**30) if kv else None)
    runs = {}
    for rate, path in result_files(out):
        result = json.loads(path.read_text())
        arrivals = from_bench_result(result)
        key = (str(path), path.stat().st_mtime, opt)
        if key not in _predicted:
            _predicted[key] = serve_sim.simulate(serve_sim.Layout(), arrivals, opt)
        predicted = _predicted[key]
        if not predicted.get("fits", True):
            raise RuntimeError(f"the simulator refuses the server's shape: {predicted}")
        runs[f"{rate:g}"] = {"requests": len(arrivals), "failed": len(result["start_times"]) - len(arrivals),
                             "duration_s": result.get("duration"), "cells": error_cells(measured_metrics(result),
                                                                                         predicted),
                             "predicted_kv_usage_max": predicted["kv_usage"]["max"],
                             "predicted_steps": predicted["steps"]}
    title = (f"measured (vllm bench serve against vllm serve, pcp=1, one {s['gpu'].upper()}, {s['layers']} layers, "
             f"dummy weights, budget {s['budget']}) against predicted (serve_sim on the trace bench serve sent, KV "
             + (f"{kv} GiB from the server's log" if kv else "as the simulator's memory model leaves it")
             + "); ms; error = predicted / measured - 1")
    lines = error_table(runs, title) if runs else [title, "no bench serve result yet"]
    (out / "serve_comparison.json").write_text(json.dumps({"settings": s, "rates": runs}, indent=1) + "\n")
    (out / "serve_table.txt").write_text(f"$ {s.get('command', '')}\n" + "\n".join(lines) + "\n")
    if runs:
        plot_errors(runs, str(out / "serve_check.png"), f"serve_sim vs vllm bench serve, pcp=1, {s['gpu'].upper()}, "
                                                        f"{s['layers']} layers: solid measured, dashed predicted")
    if not quiet:
        print("\n".join(lines), flush=True)
    return lines


# -------------------------------------------------------------------------------------- part 2: pcp2
def pcp2_trace(path: str | None):
    """[(name, Arrival)]: ``PCP2_TRACE``, or a serve_sim JSONL trace ({time, prompt, output} a line)."""
    from benchmarks.serve_sim_engine import Arrival
    from benchmarks.serve_sim_traffic import from_trace

    if path:
        return [(f"r{i}", a) for i, a in enumerate(from_trace(path))]
    return [(name, Arrival(t, p, o)) for name, t, p, o in PCP2_TRACE]


def pcp2_options(args, gpu: str):
    from benchmarks import serve_sim

    return serve_sim.Options(budget=args.budget, mtp=0, accept=0.0, gpu=gpu, layers=args.layers,
                             max_num_seqs=args.pcp2_max_num_seqs, async_scheduling=True, prefix_caching=False,
                             kv_bytes=int(args.pcp2_kv_gib * 2**30))


def pcp2_max_model_len(trace) -> int:
    """As ``serve_sim.simulate`` sizes it: the longest request rounded up to 1024 tokens."""
    return -(-(max(a.prompt + a.output for _, a in trace) + 1) // 1024) * 1024


def pcp2_llm_kwargs(args, ckpt: str, max_model_len: int) -> dict:
    return dict(model=ckpt, load_format="dummy", hf_overrides=OVERRIDES, gdn_prefill_backend="triton",
                enforce_eager=True, max_model_len=max_model_len, max_num_batched_tokens=args.budget,
                max_num_seqs=args.pcp2_max_num_seqs, seed=0, enable_prefix_caching=False,
                prefill_context_parallel_size=2, disable_log_stats=True,
                async_scheduling=True,  # as the simulator schedules (vLLM's default; named: it fails loudly if not)
                # both ranks on GPU 0, collectives through host memory, a fixed KV cache per rank
                worker_cls="harness.shared_gpu.SharedGPUWorker", distributed_executor_backend="mp",
                gpu_memory_utilization=args.pcp2_gpu_memory_utilization,
                kv_cache_memory_bytes=int(args.pcp2_kv_gib * 2**30))


def pcp2_prepare(args, ckpt: str, gpu: str, out: Path) -> Path:
    """The simulator first (when each request reaches its scheduler), then the engine's spec: written to
    ``out`` (``pcp2_sim.json``, ``pcp2_spec.json``: the latter's path returned); old step records removed."""
    from benchmarks.serve_check_compare import simulate_steps

    trace = pcp2_trace(args.pcp2_trace)
    max_model_len = pcp2_max_model_len(trace)
    opt = pcp2_options(args, gpu)
    sim = simulate_steps(trace, opt, 2, max_model_len)
    (out / "pcp2_sim.json").write_text(json.dumps({"options": opt._asdict(), **sim}) + "\n")
    vocab = json.loads((Path(ckpt) / "config.json").read_text())["text_config"]["vocab_size"]
    spec = {"llm": pcp2_llm_kwargs(args, ckpt, max_model_len), "arrivals": args.pcp2_arrivals,
            "time_scale": args.pcp2_time_scale, "warmup": PCP2_WARMUP, "vocab": vocab,
            "trace": [{"name": n, "time": a.time, "prompt": a.prompt, "output": a.output,
                       "added_at": sim["added_at"][n]} for n, a in trace],
            "gpu": gpu, "sim_options": opt._asdict()}
    spec_path = out / "pcp2_spec.json"
    spec_path.write_text(json.dumps(spec, indent=1) + "\n")
    for old in out.glob("pcp2_steps.[0-9]*"):
        old.unlink()
    return spec_path


def run_pcp2(args, ckpt: str, gpu: str, out: Path, deadline: float) -> list[str]:
    spec_path = pcp2_prepare(args, ckpt, gpu, out)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "QWEN36_PCP_RECORD_STEPS": str(out / "pcp2_steps"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--pcp2-child", str(spec_path), str(out / "pcp2_engine.json")]
    print("$", " ".join(cmd), flush=True)
    log = out / "pcp2_engine.log"
    notes = []
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            rc = proc.wait(max(10.0, left(deadline)))
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            stop_group(proc, grace=10)
    if rc != 0:
        notes.append(f"part pcp2: the engine ended with {rc} (see {log.name})")
        print(notes[-1] + "\n" + log.read_text()[-4000:], flush=True)
        (out / "pcp2_notes.txt").write_text("\n".join(notes) + "\n")
    return notes


def _prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    """Random token ids (no two prompts share a prefix; ids 10.. vocab-300 avoid the special tokens)."""
    import numpy as np

    return np.random.default_rng(seed).integers(10, vocab - 300, n).tolist()


def record_schedule(sched, clock) -> tuple[list[dict], list[float], callable]:
    """Each ``sched.schedule()`` call from now on: the tokens it scheduled per request (vLLM's internal
    request ids less the suffix vLLM adds to each) and ``clock()`` after it; the third item puts vLLM's
    method back."""
    calls, times, schedule = [], [], sched.schedule

    def recorded():
        so = schedule()
        calls.append({rid.rsplit("-", 1)[0]: n for rid, n in so.num_scheduled_tokens.items()})
        times.append(clock())
        return so

    sched.schedule = recorded
    return calls, times, lambda: setattr(sched, "schedule", schedule)


def replay(engine, trace: list[dict], calls: list, by_steps: bool, time_scale: float, add, clock=time.perf_counter):
    """The trace through ``engine`` (vLLM's ``LLMEngine``: ``has_unfinished_requests``, ``step``): each
    request handed to ``add(request)`` once ``len(calls)`` (the scheduler's calls so far) reaches its
    ``added_at`` (``by_steps``), or at its ``time`` x ``time_scale`` on ``clock`` from the start. With
    ``by_steps``, an engine left without work adds the next request at once (listed as early). Returns
    {"added": {name: {"call", "t"}}, "early", "first_token_s", "finished_s"}."""
    trace = sorted(trace, key=lambda r: (r["added_at"], r["time"], r["name"]) if by_steps else (r["time"], r["name"]))
    t0 = clock()

    def ready(r) -> bool:
        return len(calls) >= r["added_at"] if by_steps else clock() - t0 >= r["time"] * time_scale

    added, early, first, finished = {}, [], {}, {}
    while trace or engine.has_unfinished_requests():
        busy = engine.has_unfinished_requests()
        while trace and (ready(trace[0]) or (by_steps and not busy)):
            r = trace.pop(0)
            if not ready(r):  # the engine ran out of work before the simulator's scheduler did
                early.append(r["name"])
            add(r)
            added[r["name"]] = {"call": len(calls), "t": clock() - t0}
            busy = True
        if not busy:  # wall-clock arrivals: nothing to run until the next one
            time.sleep(min(0.01, max(0.0, trace[0]["time"] * time_scale - (clock() - t0))))
            continue
        for o in engine.step():
            now = clock() - t0
            if o.outputs and o.outputs[0].token_ids:
                first.setdefault(o.request_id, now)
            if o.finished:
                finished[o.request_id] = now
    return {"added": added, "early": early, "first_token_s": first, "finished_s": finished}


def pcp2_child(spec_path: str, out_path: str) -> int:
    """In the engine's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, QWEN36_PCP_RECORD_STEPS set): the engine,
    a warm-up request, then the trace (``replay``); writes what the engine did."""
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from harness.shared_gpu import STEPS_ENV

    t_start = time.perf_counter()
    llm = LLM(**spec["llm"])
    startup_s = time.perf_counter() - t_start
    engine = llm.llm_engine
    sched, vc = engine.engine_core.engine_core.scheduler, engine.vllm_config  # the engine core is in this process
    vocab = spec["vocab"]
    llm.generate([TokensPrompt(prompt_token_ids=_prompt_ids(spec["warmup"], vocab, 999))],
                 SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.collective_rpc("check_health")  # every rank done with the warm-up's steps (their records written)
    steps_log = Path(os.environ[STEPS_ENV])
    offsets = {p.name: len(p.read_text().splitlines())
               for p in sorted(steps_log.parent.glob(steps_log.name + ".[0-9]*"))}
    prompts = {r["name"]: TokensPrompt(prompt_token_ids=_prompt_ids(r["prompt"], vocab, i))
               for i, r in enumerate(spec["trace"])}

    def add(r):
        engine.add_request(r["name"], prompts[r["name"]],
                           SamplingParams(max_tokens=r["output"], temperature=0.0, ignore_eos=True))

    t0 = time.perf_counter()
    calls, call_times, restore = record_schedule(sched, lambda: time.perf_counter() - t0)
    done = replay(engine, spec["trace"], calls, spec["arrivals"] == "steps", spec["time_scale"], add)
    trace_s = time.perf_counter() - t0
    llm.collective_rpc("check_health")
    restore()
    kv_cfg = getattr(sched, "kv_cache_config", None)
    result = {"startup_s": startup_s, "trace_s": trace_s, "calls": calls, "call_times": call_times, **done,
              "step_offsets": offsets,
              "config": {"async_scheduling": vc.scheduler_config.async_scheduling,
                         "prefix_caching": vc.cache_config.enable_prefix_caching,
                         "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
                         "max_num_seqs": vc.scheduler_config.max_num_seqs,
                         "max_model_len": vc.model_config.max_model_len,
                         "num_blocks": getattr(kv_cfg, "num_blocks", None),
                         "pcp": vc.parallel_config.prefill_context_parallel_size,
                         "worker_cls": vc.parallel_config.worker_cls}}
    Path(out_path).write_text(json.dumps(result) + "\n")
    print(f"pcp2 engine: started in {startup_s:.0f} s, trace in {trace_s:.1f} s, {len(calls)} schedule calls",
          flush=True)
    engine.engine_core.shutdown()
    return 0


def report_pcp2(out: Path, quiet: bool = False) -> list[str]:
    """The engine's step records and schedule against the simulator's: the table, the JSON, the plot."""
    from collections import Counter

    from benchmarks.serve_check_compare import (
        compare_mix,
        mix_table,
        parse_step_lines,
        plot_mix,
        prompt_steps,
        schedule_difference,
    )

    if not (out / "pcp2_engine.json").exists() or not (out / "pcp2_sim.json").exists():
        return []
    engine, sim = (json.loads((out / f"pcp2_{k}.json").read_text()) for k in ("engine", "sim"))
    spec = json.loads((out / "pcp2_spec.json").read_text())
    offsets = engine["step_offsets"]  # lines of the engine's profile run and the warm-up, per rank
    ranks = {p.name: parse_step_lines(p.read_text().splitlines()[offsets.get(p.name, 0):])
             for p in sorted(out.glob("pcp2_steps.[0-9]*"))}
    if not ranks:
        raise RuntimeError(f"no step records in {out} (pcp2_steps.<rank>): was the harness's worker used?")
    names = sorted(ranks)
    engine_steps = prompt_steps(ranks[names[0]])
    comparison = compare_mix(engine_steps, sim["steps"])
    ranks_agree = all(ranks[n] == ranks[names[0]] for n in names)
    schedule = schedule_difference(engine["calls"], sim["calls"])
    cfg, opt = engine["config"], spec["sim_options"]
    settings = {"engine": {k: cfg.get(k) for k in ("async_scheduling", "prefix_caching", "max_num_batched_tokens",
                                                   "max_num_seqs", "num_blocks")},
                "sim": {"async_scheduling": sim["async_scheduling"], "prefix_caching": sim["prefix_caching"],
                        "max_num_batched_tokens": opt["budget"], "max_num_seqs": opt["max_num_seqs"],
                        "num_blocks": sim["num_blocks"]}}
    same_settings = settings["engine"] == settings["sim"]
    kinds = {n: dict(Counter(f["kind"] for f in ranks[n])) for n in names}  # every forward of the trace
    comparison.update(ranks=len(names), ranks_agree=ranks_agree, kinds=kinds, schedule_difference=schedule,
                      settings=settings,
                      same_settings=same_settings, early=engine["early"], arrivals=spec["arrivals"],
                      engine_steps=engine_steps, sim_steps=sim["steps"],
                      engine_trace_s=engine["trace_s"], sim_trace_s=sim["end_s"], startup_s=engine["startup_s"])
    arrivals = ("each request added after as many schedule() calls as the simulator's scheduler had made"
                if spec["arrivals"] == "steps" else f"wall-clock arrivals x {spec['time_scale']:g}")
    title = (f"step mix: emulated pcp=2 engine (both ranks on one {spec['gpu'].upper()}, harness step records of "
             f"{len(names)} ranks) against serve_sim at pcp=2, the same trace ({len(spec['trace'])} requests; "
             f"{arrivals}); steps computing prompt tokens")
    lines = mix_table(comparison, title)
    lines.append(f"every rank recorded the same forwards: {'yes' if ranks_agree else 'NO'} (rank 0's, by kind: "
                 f"{kinds[names[0]]})")
    lines.append("the engine's scheduler scheduled what the simulator's did, step for step" if schedule is None else
                 f"first scheduled step that differs: #{schedule['step']}: engine {schedule['engine']}, "
                 f"simulator {schedule['sim']}")
    if not same_settings:
        lines.append(f"settings differ: {settings}")
    if engine["early"]:
        lines.append(f"added before the simulator's step (the engine had nothing left to run): {engine['early']}")
    lines.append(f"emulated engine: {engine['trace_s']:.1f} s for the trace (start {engine['startup_s']:.0f} s); "
                 f"simulated two GPUs: {sim['end_s']:.2f} s")
    (out / "pcp2_comparison.json").write_text(json.dumps(comparison, indent=1) + "\n")
    (out / "pcp2_table.txt").write_text("\n".join(lines) + "\n")
    plot_mix(engine_steps, sim["steps"], str(out / "pcp2_step_mix.png"), title)
    if not quiet:
        print("\n".join(lines), flush=True)
    return lines


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default="/tmp/qwen36_pcp_serve_check", help="results (tables, JSON, plots, logs)")
    ap.add_argument("--work", default="/tmp/qwen36_pcp_serve_check_work", help="the checkpoint (config, tokenizer)")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="in this order")
    ap.add_argument("--report-only", action="store_true", help="the tables again from what --out holds")
    ap.add_argument("--time-budget", type=float, default=540,
                    help="seconds for the whole run (the default leaves part pcp2 its --pcp2-min-s after part serve)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--budget", type=int, default=8192, help="--max-num-batched-tokens (vllm serve's default)")
    g = ap.add_argument_group("part serve")
    g.add_argument("--rates", type=float, nargs="+", default=[2.0, 16.0, 48.0],
                   help="requests/s: light, loaded, saturated (8 layers: ~25/s saturate one H100, predicted)")
    g.add_argument("--num-prompts", type=int, nargs="+", default=[24, 96, 160], help="one, or one per rate")
    g.add_argument("--input-len", type=int, default=8192)
    g.add_argument("--range-ratio", type=float, default=0.5, help="prompts of input-len x (1 -/+ this)")
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--num-warmups", type=int, default=2, help="bench serve's warm-up requests before each rate")
    g.add_argument("--warmup-prompts", type=int, default=160,
                   help="a warm-up pass of this many requests (the rates' first prompt lengths), all at once and "
                        "not measured (0: none)")
    g.add_argument("--max-model-len", type=int, default=16384)
    g.add_argument("--max-num-seqs", type=int, default=1024, help="vllm serve's default on H100/H200")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--port", type=int, default=8391)
    g.add_argument("--ready-timeout", type=float, default=300)
    g.add_argument("--bench-timeout", type=float, default=150, help="seconds for one rate")
    g = ap.add_argument_group("part pcp2")
    g.add_argument("--pcp2-arrivals", choices=["steps", "wall"], default="steps")
    g.add_argument("--pcp2-time-scale", type=float, default=10.0, help="wall s per trace s (--pcp2-arrivals wall)")
    g.add_argument("--pcp2-trace", default=None, help="a serve_sim JSONL trace instead of the built-in one")
    g.add_argument("--pcp2-kv-gib", type=float, default=4.0, help="KV cache per rank (kv_cache_memory_bytes)")
    g.add_argument("--pcp2-max-num-seqs", type=int, default=256)
    g.add_argument("--pcp2-gpu-memory-utilization", type=float, default=0.4, help="per rank")
    g.add_argument("--pcp2-min-s", type=float, default=150, help="part pcp2 starts only with this much time left")
    ap.add_argument("--pcp2-child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def report(out: Path, parts) -> list[str]:
    lines = []
    for part, fn, notes in (("serve", report_serve, "serve_notes.txt"), ("pcp2", report_pcp2, "pcp2_notes.txt")):
        if part in parts:
            got = fn(out, quiet=True)
            if (out / notes).exists():
                got = got + (out / notes).read_text().splitlines()
            lines += [f"== part {part}", *(got or ["no result"]), ""]
    (out / "table.txt").write_text("\n".join(lines))
    print("\n".join(lines), flush=True)
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.pcp2_child:
        return pcp2_child(*args.pcp2_child)
    deadline = time.monotonic() + args.time_budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        report(out, args.parts)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a time limit's SIGTERM: servers stopped, tables kept
    gpu = gpu_kind()
    ckpt = checkpoint(Path(args.work), args.layers)
    try:
        for part in args.parts:
            if part == "serve":
                for stale in [*out.glob("bench_rate*.json"), out / "serve_notes.txt", out / "serve_settings.json"]:
                    stale.unlink(missing_ok=True)
                run_serve(args, ckpt, gpu, out, deadline)
            elif left(deadline) < args.pcp2_min_s:
                (out / "pcp2_notes.txt").write_text(f"part pcp2 skipped: {left(deadline):.0f} s left, "
                                                    f"--pcp2-min-s {args.pcp2_min_s:.0f}\n")
            else:
                for stale in ("engine.json", "notes.txt"):
                    (out / f"pcp2_{stale}").unlink(missing_ok=True)
                run_pcp2(args, ckpt, gpu, out, deadline)
    finally:  # also when a time limit cuts the run short: the tables of what it measured
        try:
            report(out, args.parts)
        except Exception as e:  # noqa: BLE001 - the run's own error, if any, is the one to see
            print(f"report: {type(e).__name__}: {e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
