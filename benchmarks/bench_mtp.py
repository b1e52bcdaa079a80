# SPDX-License-Identifier: Apache-2.0
"""MTP per rank: the drafter's share of one long prompt's split step, and a decode step with and
without MTP.

Qwen3.6-35B-A3B shape with its first 8 layers and its MTP head (dummy weights; four ranks' weights fit
one GPU), eager (``--compiled``: vLLM's default torch.compile + CUDA graphs), every rank on one H200
taking turns (``harness/shared_gpu.py``): a rank's **turn time** is its own step on a GPU of its own,
host included, collectives left out (an upper bound: each collective drains the GPU inside the turn).

- **Split step**: one prompt of 32k / 128k tokens in one step, ``max_tokens=1``. At pcp=1 the median
  turn time of 2 runs after a warm-up; the drafter's time is the MTP config's minus pcp=1's without
  (its first pass over every row and its K - 1 further passes). At pcp > 1 a turn also holds the
  shared GPU's host copies of every collective, so ``--profile`` measures instead: one profile of the
  MTP config's prefills with the first pass whole, then split (``mtp_first_pass``), per rank the GPU
  kernels (host copies left out), the drafter's those launched in vLLM's draft scope; the step is
  the ranks' critical path. Shares at 40 layers and at pcp = 4 / 8 are predicted: the target's part
  scaled by 40 / 8 and by 2 / N, the drafter's kept (whole) or divided by N (split).
- **Decode**: one request after a 1024-token prompt, 32 steps after 4 warm-up steps; per rank the turn
  time per step. Dummy weights give random drafts (none accepted), so the MTP step is its full cost
  and each step gives one token; MTP lowers inter-token latency once more than
  ``step(MTP) / step(no MTP) - 1`` drafts are accepted per step on average (the break-even column).

    python benchmarks/bench_mtp.py --out /tmp/bench_mtp --configs pcp1 pcp1_mtp pcp2 pcp2_mtp   # ~6 min
    python benchmarks/bench_mtp.py --out /tmp/bench_mtp --profile --configs pcp2_mtp             # ~3 min
    python benchmarks/bench_mtp.py --out /tmp/bench_mtp --report-only
    python benchmarks/bench_mtp.py --out /tmp/bench_mixed --configs pcp1_mtp pcp2_mtp --mixed 16 --tokens 32768

- **Mixed step** (``--mixed B``): B requests verifying drafts (1 + K rows each) and a prompt joining
  them; per rank the step's own time (turn time less the shared GPU's host copies of its collectives:
  ``turn_counters``), against the same prompt's step alone and a step of the verifications alone. The
  prompt's steps with the verifications beside it, less the verification steps among them, are the
  mixed step (under async scheduling its output comes a step later).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: benchmarks/, tests/, harness/
from benchmarks import bench_ttft  # noqa: E402
from benchmarks.plot import save_figure  # noqa: E402

LAYERS, FULL_LAYERS = 8, 40
K = 3
CONFIGS = {"pcp2": (2, 0), "pcp2_mtp": (2, K), "pcp1": (1, 0), "pcp1_mtp": (1, K),
           "pcp4_mtp": (4, K), "pcp4": (4, 0)}  # -> (ranks, drafts); the order they run in
TOKENS = (32768, 131072)
FIRST_PASS = ("whole", "split")  # mtp_first_pass, as --profile compares them
MARK, DRAFT_SCOPE = "qwen36_pcp bench: ", "gpu_model_runner: draft"
PREDICT_PCPS = (2, 4, 8)
REPS = 2
DECODE_PROMPT, DECODE_STEPS, DECODE_WARMUP = 1024, 32, 4


def engine_args(config: str) -> dict:
    ranks, drafts = CONFIGS[config]
    # 2 GiB of KV cache per rank holds a 128k-token prompt's (2 attention layers + the head's)
    args = dict(prefill_context_parallel_size=ranks, **{**bench_ttft.shared_gpu_args(ranks),
                                                        "kv_cache_memory_bytes": 2 << 30})
    if drafts:
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": drafts}
    return args


def set_first_pass(mode: str):
    """A ``collective_rpc`` target: the runner's ``mtp_first_pass`` set to ``mode``, and a mark in the
    worker's profile where this mode's run starts (``profile_segments``)."""

    def apply(worker) -> None:
        import dataclasses

        import torch

        runner = worker.model_runner
        runner.pcp_config = dataclasses.replace(runner.pcp_config, mtp_first_pass=mode)
        with torch.profiler.record_function(f"{MARK}{mode}"):
            pass

    return apply


def profile(llm, tokens: tuple[int, ...]) -> list[str]:
    """One profile over a prefill of each length with the first pass whole, then split (each after a
    warm-up); returns the runs' labels in order (the workers mark where each starts)."""
    from vllm import SamplingParams

    one, labels = SamplingParams(max_tokens=1, temperature=0.0), []
    for n in tokens:
        for mode in FIRST_PASS:
            llm.collective_rpc(set_first_pass(mode))
            llm.generate([bench_ttft.prompt(n)], one, use_tqdm=False)
    llm.start_profile()
    for n in tokens:
        for mode in FIRST_PASS:
            llm.collective_rpc(set_first_pass(mode))
            llm.generate([bench_ttft.prompt(n)], one, use_tqdm=False)
            labels.append(f"{mode}/{n}")
    llm.stop_profile()
    return labels


def profile_segments(events: list[dict], labels: list[str]) -> dict:
    """{label: {"compute_ms", "drafter_ms", "segments_ms"}} of one rank's trace: GPU work split at the
    marks ``set_first_pass`` left (each run is over before the next mark), the drafter's kernels
    those launched inside vLLM's ``gpu_model_runner: draft`` scope; host copies (a shared GPU's
    collectives) left out of both."""
    from benchmarks.profile_prefill import kind_of, summarize_trace

    annotations = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    marks = sorted(e["ts"] for e in annotations if str(e.get("name", "")).startswith(MARK))
    if len(marks) != len(labels):
        raise ValueError(f"{len(marks)} marks in the trace for {len(labels)} runs")
    # the draft scope's host thread: launches from vLLM's other threads meanwhile are not the drafter's
    drafts = [(e.get("tid"), e["ts"], e["ts"] + e["dur"]) for e in annotations if e.get("name") == DRAFT_SCOPE]
    launched_in_draft = {e["args"]["correlation"] for e in events
                         if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
                         and "correlation" in e.get("args", {})
                         and any(t == e.get("tid") and a <= e["ts"] <= b for t, a, b in drafts)}
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    out = {}
    for i, label in enumerate(labels):
        lo, hi = marks[i], marks[i + 1] if i + 1 < len(marks) else float("inf")
        run = [e for e in gpu if lo <= e["ts"] < hi]
        summary = summarize_trace(run)
        if not summary:
            continue
        drafter = sum(e["dur"] for e in run if e.get("args", {}).get("correlation") in launched_in_draft
                      and kind_of(e["name"]) != "communication") / 1e3
        compute = sum(ms for kind, ms in summary["kinds_ms"].items() if kind != "communication")
        out[label] = {"compute_ms": compute, "drafter_ms": drafter, "segments_ms": summary["segments_ms"]}
    return out


def turns_ms(llm, run) -> list[float]:
    """Each rank's turn time (ms) while ``run()`` runs."""
    from harness.shared_gpu import turn_seconds

    before = llm.collective_rpc(turn_seconds)
    run()
    return [1e3 * (b - a) for a, b in zip(before, llm.collective_rpc(turn_seconds))]


def own_ms(llm, run) -> list[float]:
    """Each rank's own time (ms) while ``run()`` runs: its turn time less its collectives' host copies
    (what NCCL between GPUs would not spend)."""
    from harness.shared_gpu import turn_counters

    before = llm.collective_rpc(turn_counters)
    run()
    after = llm.collective_rpc(turn_counters)
    return [1e3 * ((a["turn"] - a["staging"]) - (b["turn"] - b["staging"])) for b, a in zip(before, after)]


def mixed_steps(llm, tokens: tuple[int, ...], chats: int) -> dict:
    """``--mixed``: per rank the own time of a step of ``chats`` requests verifying drafts, of each
    prompt's step alone, and of its step beside the verifications (module docstring)."""
    from vllm import SamplingParams

    engine, counts = llm.llm_engine, {}
    one = SamplingParams(max_tokens=1, temperature=0.0)
    out = {}
    for n in tokens:  # alone (the engine has no other request)
        llm.generate([bench_ttft.prompt(n)], one, use_tqdm=False)
        out[f"alone/{n}"] = statistics.median(max(own_ms(llm, lambda: llm.generate(
            [bench_ttft.prompt(n)], one, use_tqdm=False))) for _ in range(REPS))

    def steps(k: int) -> list[str]:
        done = []
        for _ in range(k):
            for o in engine.step():
                counts[o.request_id] = len(o.outputs[0].token_ids)
                done += [o.request_id] if o.finished else []
        return done

    sp = SamplingParams(max_tokens=100000, ignore_eos=True, temperature=0.0)
    for i in range(chats):
        engine.add_request(f"chat{i}", {"prompt_token_ids": bench_ttft.prompt(512 + i)["prompt_token_ids"]}, sp)
    while len(counts) < chats or min(counts.values()) < 2:
        steps(1)
    steps(DECODE_WARMUP)
    verify = max(own_ms(llm, lambda: steps(DECODE_STEPS))) / DECODE_STEPS
    out["verify_step_ms"] = verify
    for n in tokens:
        for rep in range(REPS):
            name, taken = f"prompt{n}_{rep}", [0]
            engine.add_request(name, {"prompt_token_ids": bench_ttft.prompt(n)["prompt_token_ids"]}, one)

            def until_done(name=name, taken=taken):
                while True:
                    taken[0] += 1
                    if name in steps(1):
                        return
            total = max(own_ms(llm, until_done))
            out.setdefault(f"mixed/{n}", []).append(total - (taken[0] - 1) * verify)
        out[f"mixed/{n}"] = statistics.median(out[f"mixed/{n}"])
        print(f"[mixed] {n} tokens beside {chats} verifying: {out[f'mixed/{n}']:.1f} ms, alone "
              f"{out[f'alone/{n}']:.1f} ms, verification alone {verify:.1f} ms", flush=True)
    engine.abort_request([f"chat{i}" for i in range(chats)])
    return out


def measure(model: str, config: str, tokens: tuple[int, ...], compiled: bool, path: str, mixed: int = 0) -> None:
    """{"prefill/T": {"turn_ms": [per rank]}, "decode": {"step_ms": [per rank], "tokens_per_step": x}}
    into ``path`` after each point; with ``mixed`` (B verifying requests) only ``mixed_steps``' points."""
    from vllm import SamplingParams

    if mixed:  # the budget holds a prompt and every verification row in one step
        llm = bench_ttft.engine(model, "pcp1", max(tokens), compiled, **engine_args(config),
                                max_num_batched_tokens=max(tokens) + mixed * (1 + K))
        data = {"config": config, "mode": bench_ttft.mode(compiled), "chats": mixed,
                **mixed_steps(llm, tokens, mixed)}
        Path(path).write_text(json.dumps(data))
        return
    llm = bench_ttft.engine(model, "pcp1", max(tokens), compiled, **engine_args(config))
    out: dict = {"config": config, "mode": bench_ttft.mode(compiled)}
    one = SamplingParams(max_tokens=1, temperature=0.0)
    for n in tokens:
        p = bench_ttft.prompt(n)
        llm.generate([p], one, use_tqdm=False)  # warm-up (JIT, autotune)
        runs = [turns_ms(llm, lambda: llm.generate([p], one, use_tqdm=False)) for _ in range(REPS)]
        out[f"prefill/{n}"] = {"turn_ms": [statistics.median(r) for r in zip(*runs)]}
        print(f"[{config}] {n} tokens: turn {max(out[f'prefill/{n}']['turn_ms']):.1f} ms (slowest rank)", flush=True)
        Path(path).write_text(json.dumps(out))

    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=100000, ignore_eos=True, temperature=0.0)
    engine.add_request("decode", {"prompt_token_ids": bench_ttft.prompt(DECODE_PROMPT)["prompt_token_ids"]}, sp)
    counted = [0]

    def steps(k: int) -> None:
        for _ in range(k):
            for o in engine.step():
                counted[0] = len(o.outputs[0].token_ids)

    while counted[0] == 0:
        steps(1)
    steps(DECODE_WARMUP)
    first = counted[0]
    ms = turns_ms(llm, lambda: steps(DECODE_STEPS))
    out["decode"] = {"step_ms": [t / DECODE_STEPS for t in ms],
                     "tokens_per_step": (counted[0] - first) / DECODE_STEPS}
    print(f"[{config}] decode: {max(out['decode']['step_ms']):.2f} ms per step, "
          f"{out['decode']['tokens_per_step']:.2f} tokens per step", flush=True)
    engine.abort_request(["decode"])
    Path(path).write_text(json.dumps(out))


def mixed_report(out: str) -> list[str]:
    """``--mixed``'s table: per layout and prompt length the slowest rank's own time (ms, measured)."""
    data = {c: json.loads((Path(out) / f"{c}.json").read_text()) for c in CONFIGS
            if (Path(out) / f"{c}.json").exists()}
    data = {c: d for c, d in data.items() if "chats" in d}
    if not data:
        return []
    d0 = next(iter(data.values()))
    lines = [f"mixed step per rank (K={K}), {d0['chats']} requests verifying beside one prompt, Qwen3.6-35B-A3B "
             f"shape, first {LAYERS} layers + MTP head, dummy weights, {d0['mode']}, one GPU, ranks taking turns; "
             "measured: own time of the slowest rank (ms), collectives' host copies left out",
             f"{'config':>9} {'tokens':>7} {'alone':>9} {'verify':>9} {'mixed':>9} {'mixed/(alone+verify)':>21}"]
    for config, d in data.items():
        for key in sorted(k for k in d if k.startswith("mixed/")):
            n = int(key.split("/")[1])
            alone, verify, mixed = d[f"alone/{n}"], d["verify_step_ms"], d[key]
            lines.append(f"{config:>9} {n:>7} {alone:9.1f} {verify:9.1f} {mixed:9.1f} {mixed / (alone + verify):21.2f}")
    return lines


def report(out: str) -> dict:
    data = {c: json.loads((Path(out) / f"{c}.json").read_text()) for c in CONFIGS
            if (Path(out) / f"{c}.json").exists()}
    mixed = mixed_report(out)
    if mixed:
        table = "\n".join(mixed)
        print(table)
        (Path(out) / "table.txt").write_text(table + "\n")
        return {}
    mode = next((d["mode"] for d in data.values()), "?")
    lines = [f"MTP (K={K}) per rank, Qwen3.6-35B-A3B shape, first {LAYERS} layers + MTP head, dummy weights, "
             f"{mode}, one H200, ranks taking turns; measured: turn time of the slowest rank (ms)",
             "prefill step at pcp=1: one prompt in one step; drafter = with MTP - without; share at "
             f"{FULL_LAYERS} layers predicted: drafter / (drafter + target x {FULL_LAYERS // LAYERS})",
             f"{'layout':>7} {'tokens':>7} {'no MTP':>9} {'MTP':>9} {'drafter':>8} "
             f"{'share (8 layers)':>17} {'share (40, predicted)':>22}"]
    rows = []
    # pcp=1 only: at pcp > 1 a turn holds the shared GPU's host copies (the profile measures instead)
    plain, mtp = data.get("pcp1", {}), data.get("pcp1_mtp", {})
    for n in TOKENS:
        key = f"prefill/{n}"
        if key not in plain or key not in mtp:
            continue
        t, m = plain[key]["turn_ms"][0], mtp[key]["turn_ms"][0]
        d = m - t
        row = {"ranks": 1, "tokens": n, "plain_ms": t, "mtp_ms": m, "drafter_ms": d,
               "share": d / m, "share_full": d / (d + t * FULL_LAYERS / LAYERS)}
        rows.append(row)
        lines.append(f"{'pcp=1':>7} {n:>7} {t:9.1f} {m:9.1f} {d:8.1f} {100 * row['share']:16.1f}% "
                     f"{100 * row['share_full']:21.1f}%")
    lines += ["", f"decode, one request after {DECODE_PROMPT} tokens: step per rank (ms, measured; slowest rank), "
              "tokens per step (random drafts: none accepted), and the accepted drafts per step at which MTP's "
              "step gives a lower inter-token latency (break-even = step(MTP) / step(no MTP) - 1)",
              f"{'layout':>7} {'no MTP':>9} {'MTP':>9} {'tokens/step':>12} {'break-even':>11}"]
    decode = []
    for ranks in sorted({r for r, _ in CONFIGS.values()}):
        plain, mtp = data.get(f"pcp{ranks}", {}).get("decode"), data.get(f"pcp{ranks}_mtp", {}).get("decode")
        if plain and mtp:
            t, m = max(plain["step_ms"]), max(mtp["step_ms"])
            decode.append({"ranks": ranks, "plain_ms": t, "mtp_ms": m, "break_even": m / t - 1})
            lines.append(f"{'pcp=' + str(ranks):>7} {t:9.2f} {m:9.2f} {mtp['tokens_per_step']:12.2f} "
                         f"{m / t - 1:11.2f}")
    profiled_lines, profiled = profile_report(out)
    lines += profiled_lines
    table = "\n".join(lines)
    print(table)
    (Path(out) / "table.txt").write_text(table + "\n")

    # (label, step ms, drafter ms): pcp=1's turn times, the profiled configs' critical paths
    bars = [(f"pcp=1\n{r['tokens'] // 1024}k", r["mtp_ms"], r["drafter_ms"]) for r in rows]
    bars += [(f"pcp={r['ranks']}\n{r['tokens'] // 1024}k {r['first_pass']}", r["step_ms"], r["drafter_ms"])
             for r in profiled]

    def draw(ax):
        x = [float(i) for i in range(len(bars))]
        scale = FULL_LAYERS / LAYERS
        ax.bar([i - 0.2 for i in x], [100 * d / step for _, step, d in bars], 0.4, color="C1",
               label=f"{LAYERS} layers (measured)")
        ax.bar([i + 0.2 for i in x], [100 * d / (d + (step - d) * scale) for _, step, d in bars], 0.4,
               color="C1", alpha=0.45, hatch="//", label=f"{FULL_LAYERS} layers (predicted)")
        ax.set_xticks(x, [b[0] for b in bars], fontsize=8)
        ax.set_ylabel("MTP drafter's share of the step per rank (%)")
        ax.set_title("MTP drafter's share of a prefill step")
        ax.grid(axis="y", alpha=0.3)

    if bars:
        save_figure(str(Path(out) / "mtp_split_step.png"), draw, fontsize=8)
    return {"split": rows, "profiled": profiled, "decode": decode}


def profile_child(model: str, config: str, tokens: tuple[int, ...], compiled: bool, out: str) -> None:
    """``profile`` in one engine of ``config``; each rank's runs summarized into ``{config}_profile.json``."""
    from benchmarks.profile_prefill import traces

    trace_dir = Path(out) / f"{config}_traces"
    llm = bench_ttft.engine(model, "pcp1", max(tokens), compiled, **engine_args(config),
                            **bench_ttft.profiler_args(str(trace_dir)))
    labels = profile(llm, tokens)
    del llm
    data = {"config": config, "mode": bench_ttft.mode(compiled), "labels": labels,
            "ranks": {label: profile_segments(events, labels) for label, events in traces(str(trace_dir))}}
    (Path(out) / f"{config}_profile.json").write_text(json.dumps(data))


def profile_report(out: str) -> tuple[list[str], list[dict]]:
    """The profiled configs' table and rows: per run, the step's GPU compute on N GPUs (the ranks'
    critical path) and the drafter's kernel time on the rank where it is longest, first pass whole
    and split."""
    from benchmarks.profile_prefill import critical_path_ms

    lines, rows = [], []
    for path in sorted(Path(out).glob("*_profile.json")):
        data = json.loads(path.read_text())
        ranks = list(data["ranks"].values())
        if not lines:
            lines += ["", f"profiled (GPU kernels per rank, host copies left out; {data['mode']}): step = the "
                      "ranks' critical path, drafter = its kernel time on the rank where it is longest; share at "
                      f"{FULL_LAYERS} layers predicted: drafter / (drafter + (step - drafter) x "
                      f"{FULL_LAYERS // LAYERS})",
                      f"{'config':>9} {'tokens':>7} {'first pass':>10} {'step':>8} {'drafter':>8} "
                      f"{'share':>6} {'share (40, predicted)':>22}"]
        for label in data["labels"]:
            runs = [r[label] for r in ranks if label in r]
            if not runs:
                continue
            mode, n = label.split("/")
            step, _ = critical_path_ms(runs)
            drafter = max(r["drafter_ms"] for r in runs)
            full = drafter / (drafter + (step - drafter) * FULL_LAYERS / LAYERS)
            rows.append({"config": data["config"], "ranks": CONFIGS[data["config"]][0], "tokens": int(n),
                         "first_pass": mode, "step_ms": step, "drafter_ms": drafter})
            lines.append(f"{data['config']:>9} {n:>7} {mode:>10} {step:8.1f} {drafter:8.1f} "
                         f"{100 * drafter / step:5.1f}% "
                         f"{100 * full:21.1f}%")
    whole = [r for r in rows if r["first_pass"] == "whole"]
    if whole:
        lines += [f"predicted share of a split step at {FULL_LAYERS} layers, per rank, from the runs above: target "
                  f"(whole run's step - drafter) x 40/8 x (its pcp)/N; drafter: the whole run's kept, the split "
                  "run's x (its pcp)/N (without a split run: the whole run's / N)",
                  f"{'tokens':>7} " + " ".join(f"{'pcp=' + str(n) + ' whole':>12} {'split':>6}" for n in PREDICT_PCPS)]
        for r in whole:
            target = (r["step_ms"] - r["drafter_ms"]) * FULL_LAYERS / LAYERS
            split = next((s for s in rows if s["first_pass"] == "split" and s["config"] == r["config"]
                          and s["tokens"] == r["tokens"]), None)
            split_ms = split["drafter_ms"] * split["ranks"] if split else r["drafter_ms"]  # x pcp: 1 rank's
            cells = []
            for n in PREDICT_PCPS:
                t = target * r["ranks"] / n
                cells.append(f"{100 * r['drafter_ms'] / (t + r['drafter_ms']):11.1f}% "
                             f"{100 * split_ms / n / (t + split_ms / n):5.1f}%")
            lines.append(f"{r['tokens']:>7} " + " ".join(cells))
    return lines, rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/qwen36_pcp_bench/mtp")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--compiled", action="store_true", help="torch.compile + CUDA graphs (vLLM's default)")
    parser.add_argument("--profile", action="store_true",
                        help="profile the MTP configs' first pass whole and split instead (see above)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--mixed", type=int, default=0, metavar="B",
                        help="the mixed step instead: a prompt beside B requests verifying drafts (MTP configs)")
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.child:
        config, model = args.child
        if args.profile:
            profile_child(model, config, tuple(args.tokens), args.compiled, args.out)
        else:
            measure(model, config, tuple(args.tokens), args.compiled, str(Path(args.out) / f"{config}.json"),
                    args.mixed)
        return
    if args.mixed and any(not CONFIGS[c][1] for c in args.configs):
        parser.error("--mixed measures verification rows beside a prompt: give MTP configs")
    if args.profile and any(not CONFIGS[c][1] or CONFIGS[c][0] < 2 for c in args.configs):
        parser.error("--profile compares the first pass whole and split: give MTP configs at pcp > 1")
    if not args.report_only:
        model = bench_ttft.checkpoint(args.out, layers=LAYERS)
        for config in args.configs:
            argv = [__file__, "--out", args.out, "--tokens", *map(str, args.tokens),
                    *(["--profile"] if args.profile else []),
                    "--mixed", str(args.mixed),
                    *(["--compiled"] if args.compiled else []), "--child", config, model]
            bench_ttft.run_child(argv, str(Path(args.out) / f"{config}.log"), "race_free", in_process=True,
                                 turns_lock=str(Path(args.out) / "turns.lock"),
                                 env={"VLLM_CUSTOM_SCOPES_FOR_PROFILING": "1"} if args.profile else None)
    report(args.out)


if __name__ == "__main__":
    main()
