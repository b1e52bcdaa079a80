# SPDX-License-Identifier: Apache-2.0
"""The serving simulator against measurement on one GPU: ``vllm serve`` at pcp=1 and ``vllm bench serve`` at
a few request rates from light to saturated, then ``serve_sim`` on the very trace bench serve sent (its
measured start times and prompt/output lengths), measured against predicted TTFT, ITL and TPOT p50/p99.

    python benchmarks/serve_check_gpu.py --out /tmp/serve_check            # one H100 or H200, ~5-7 minutes
    python benchmarks/serve_check_gpu.py --out DIR --report-only            # the table again from DIR

Qwen3.6-35B-A3B's shape with dummy weights (config and tokenizer from the checkpoint maker, no download), its
first ``--layers`` layers (8 by default: the whole model leaves an H100 almost no KV memory), vLLM's serve
defaults (torch.compile, CUDA graphs, async scheduling, chunked prefill at ``--budget``). The simulator runs
with the server's own KV cache size (read from its log), the card's HBM bandwidth and the same layers. The
step-time model's prefill is fitted on an H200: on an H100 the error holds that difference too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo: benchmarks/

KEYS = (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT"))


def gpu_kind() -> str:
    """``h100`` or ``h200`` from nvidia-smi's name of GPU 0 (the step-time model's cards)."""
    name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                          capture_output=True, text=True, check=True).stdout.strip()
    if "H200" in name:
        return "h200"
    if "H100" in name:
        return "h100"
    raise SystemExit(f"GPU 0 is {name!r}: the step-time model knows H100 and H200 only")


def start_server(args, ckpt: str, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", ckpt, "--load-format", "dummy",
           "--hf-overrides", json.dumps({"architectures": ["Qwen3_6ForCausalLM"]}), "--gdn-prefill-backend", "triton",
           "--max-model-len", str(args.max_model_len), "--max-num-batched-tokens", str(args.budget),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--port", str(args.port),
           "--served-model-name", "model", "--seed", "0"]
    if args.mtp:
        cmd += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": args.mtp})]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    print("$", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)


def wait_ready(proc: subprocess.Popen, port: int, log_path: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit("vllm serve exited:\n" + log_path.read_text()[-4000:])
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            if time.time() > deadline:
                raise SystemExit(f"vllm serve not ready in {timeout:.0f} s:\n" + log_path.read_text()[-4000:])
            time.sleep(2)


def stop(proc: subprocess.Popen) -> None:
    """The server's process group (it was started with ``start_new_session``), SIGINT then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench(args, ckpt: str, rate: float, out: Path) -> Path:
    name = f"bench_rate{rate:g}.json"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
           "--base-url", f"http://127.0.0.1:{args.port}", "--model", "model", "--tokenizer", ckpt,
           "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--random-range-ratio", str(args.range_ratio), "--num-prompts", str(args.num_prompts),
           "--request-rate", f"{rate:g}", "--seed", "0", "--ignore-eos", "--save-result", "--save-detailed",
           "--result-dir", str(out), "--result-filename", name, "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,90,99"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=REPO, timeout=args.bench_timeout)
    return out / name


def server_kv_gib(log_path: Path) -> float | None:
    """The KV cache memory vLLM's profile left (its log's ``Available KV cache memory: X GiB``)."""
    found = re.findall(r"Available KV cache memory: ([0-9.]+) GiB", log_path.read_text())
    return float(found[-1]) if found else None


def compare(out: Path, gpu: str, layers: int, kv_gib: float | None, mtp: int, accept: float, budget: int) -> list[str]:
    from benchmarks import serve_sim
    from benchmarks.serve_sim_traffic import from_trace

    opt = serve_sim.Options(budget=budget, mtp=mtp, accept=accept, gpu=gpu, layers=layers,
                            kv_bytes=int(kv_gib * 2**30) if kv_gib else None)
    heads = " ".join(f"{label + ' ' + p:>26}" for _, label in KEYS for p in ("p50", "p99"))
    lines = [(f"measured (vllm bench serve against vllm serve, pcp=1, one {gpu.upper()}, {layers} layers, dummy "
              f"weights) against predicted (serve_sim on the same trace, KV {kv_gib} GiB); error = predicted / "
              "measured - 1"),
             f"{'rate':>6} {'reqs':>5} " + heads,
             f"{'':>6} {'':>5} " + " ".join(f"{'measured  predicted  error':>26}" for _ in range(2 * len(KEYS)))]
    summary = {}
    for path in sorted(out.glob("bench_rate*.json"), key=lambda p: float(p.stem.removeprefix("bench_rate"))):
        measured = json.loads(path.read_text())
        arrivals = from_trace(str(path))
        predicted = serve_sim.simulate(serve_sim.Layout(), arrivals, opt)
        cells, rate = [], path.stem.removeprefix("bench_rate")
        for key, _ in KEYS:
            for p in ("50", "99"):
                m = measured[f"p{p}_{key}_ms"]  # bench serve's --metric-percentiles 50,90,99
                s = predicted[key][f"p{p}"] * 1e3
                cells.append(f"{m:>8.1f} {s:>10.1f} {s / m - 1:>+6.0%}")
                summary.setdefault(rate, {})[f"{key}_p{p}_ms"] = {"measured": m, "predicted": s}
        lines.append(f"{rate:>6} {len(arrivals):>5} " + " ".join(f"{c:>26}" for c in cells))
    (out / "comparison.json").write_text(json.dumps(summary, indent=1) + "\n")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default="/tmp/qwen36_pcp_serve_check")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0, 16.0],
                    help="requests/s: light, loaded, saturated (8 layers, one H100)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=8192)
    ap.add_argument("--range-ratio", type=float, default=0.5, help="prompts of input-len x (1 -/+ this)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--budget", type=int, default=8192, help="--max-num-batched-tokens (vllm serve's default)")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--mtp", type=int, default=0, help="MTP drafts (dummy weights: none accepted, --accept 0)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--bench-timeout", type=float, default=240)
    ap.add_argument("--report-only", action="store_true", help="compare the bench results already in --out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = out / "settings.json"
    if args.report_only:
        saved = json.loads(settings.read_text())
    else:
        from benchmarks.bench_ttft import checkpoint

        ckpt = checkpoint(str(out), layers=args.layers)
        log_path = out / "vllm_serve.log"
        proc = start_server(args, ckpt, log_path)
        try:
            wait_ready(proc, args.port, log_path, args.ready_timeout)
            for rate in args.rates:
                bench(args, ckpt, rate, out)
        finally:
            stop(proc)
        saved = {"gpu": gpu_kind(), "layers": args.layers, "kv_gib": server_kv_gib(log_path), "mtp": args.mtp,
                 "budget": args.budget, "command": " ".join(sys.argv)}
        settings.write_text(json.dumps(saved, indent=1) + "\n")
    lines = compare(out, saved["gpu"], saved["layers"], saved["kv_gib"], saved["mtp"], 0.0, saved["budget"])
    text = "\n".join([f"$ {saved['command']}", *lines])
    (out / "table.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
