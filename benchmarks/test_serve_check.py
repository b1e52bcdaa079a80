# SPDX-License-Identifier: Apache-2.0
"""The parts of the one-GPU serving check (benchmarks/serve_check_gpu.py) that run without a GPU: the flags
it passes are vLLM 0.20.2's, ``vllm bench serve`` against a stand-in server writes the result the trace and
the error table are read from, the harness's step records read as the simulator's steps, and replaying a
trace by scheduler calls gives the simulator's schedule step for step."""

from __future__ import annotations

import inspect
import json
import math
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import serve_check_compare as compare  # noqa: E402
from benchmarks import serve_check_gpu as check  # noqa: E402
from benchmarks.serve_sim_engine import Arrival  # noqa: E402
from benchmarks.serve_sim_traffic import from_bench_result  # noqa: E402


def vllm_cli(argv: list[str]):
    """``argv`` (``python -m vllm.entrypoints.cli.main SUB ...``) parsed and validated by vLLM's own CLI, as
    its ``main`` does (on the CPU platform: vLLM's engine flags need a device type)."""
    assert argv[1:3] == ["-m", "vllm.entrypoints.cli.main"], argv
    saved, sys.argv = sys.argv, ["vllm", *argv[3:]]  # vLLM's bench parser builds its subcommands from it
    try:
        return _vllm_cli(argv[3:])
    finally:
        sys.argv = saved


def _vllm_cli(argv: list[str]):
    from benchmarks.serve_sim_engine import cpu_platform

    with cpu_platform():
        import vllm.entrypoints.cli.benchmark.main
        import vllm.entrypoints.cli.serve
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = FlexibleArgumentParser()
        sub = parser.add_subparsers(dest="subparser")
        cmds = {}
        for module in (vllm.entrypoints.cli.serve, vllm.entrypoints.cli.benchmark.main):
            for cmd in module.cmd_init():
                cmd.subparser_init(sub)
                cmds[cmd.name] = cmd
        args = parser.parse_args(argv)
        cmds[args.subparser].validate(args)
    return args


def test_the_flags_passed_are_vllm_0_20_2s(tmp_path):
    args = check.parse_args([])
    serve = vllm_cli(check.serve_command(args, "/ckpt"))
    assert (serve.model_tag, serve.load_format, serve.gdn_prefill_backend) == ("/ckpt", "dummy", "triton")
    assert (serve.max_num_batched_tokens, serve.max_num_seqs, serve.enable_prefix_caching) == (8192, 1024, False)
    assert serve.hf_overrides == check.OVERRIDES and serve.served_model_name == ["model"]
    bench = vllm_cli(check.bench_command(args, "/ckpt", 16.0, 96, tmp_path))
    assert (bench.bench_type, bench.dataset_name) == ("serve", "random")
    assert (bench.request_rate, bench.num_prompts, bench.seed) == (16.0, 96, 0)
    assert bench.save_result and bench.save_detailed and bench.ignore_eos
    assert (bench.result_dir, bench.result_filename) == (str(tmp_path), "bench_rate16.json")
    assert bench.metric_percentiles == "50,90,99" and "ttft" in bench.percentile_metrics.split(",")
    from vllm.benchmarks.datasets.datasets import _parse_range_ratio

    assert _parse_range_ratio(bench.random_range_ratio) == {"input": 0.5, "output": 0.0}
    from vllm.engine.arg_utils import EngineArgs  # every LLM(...) keyword of part 2 is an engine argument

    kw = check.pcp2_llm_kwargs(args, "/ckpt", 32768)
    engine = EngineArgs(**kw)
    assert engine.prefill_context_parallel_size == 2 and engine.worker_cls == "harness.shared_gpu.SharedGPUWorker"
    assert engine.kv_cache_memory_bytes == 4 << 30 and engine.enable_prefix_caching is False


def test_a_bench_serve_result_becomes_the_trace_and_the_measured_percentiles():
    """vLLM 0.20.2's result keys (read off its source); a failed request is no arrival."""
    from vllm.benchmarks import serve as bench_serve

    source = inspect.getsource(bench_serve)
    for key in ("start_times", "input_lens", "output_lens", "errors", "ttfts", "itls"):
        assert f'"{key}":' in source, key
    assert 'f"p{p_word}_{metric_attribute_name}_ms"' in source
    result = {"start_times": [100.5, 100.0, 101.25, 100.75], "input_lens": [900, 800, 700, 600],
              "output_lens": [7, 8, 0, 9], "errors": ["", "", "boom", ""], "ttfts": [0.1, 0.2, 0.0, 0.3],
              "itls": [[0.01, 0.03], [0.02], [], [0.04]], "p50_ttft_ms": 200.0, "p99_ttft_ms": 298.0,
              "p50_itl_ms": 25.0, "p99_itl_ms": 39.7, "p50_tpot_ms": 20.0, "p99_tpot_ms": 30.0}
    assert from_bench_result(result) == [Arrival(0.0, 800, 8), Arrival(0.5, 900, 7), Arrival(0.75, 600, 9)]
    measured = compare.measured_metrics(result)
    assert measured["ttft"] == {"p50": 200.0, "p99": 298.0} and measured["tpot"]["p99"] == 30.0
    for key in ("p50_ttft_ms", "p99_itl_ms"):  # without bench serve's percentiles: computed as it computes them
        del result[key]
    measured = compare.measured_metrics(result)
    assert measured["ttft"]["p50"] == pytest.approx(200.0) and measured["itl"]["p99"] == pytest.approx(39.7)
    with pytest.raises(ValueError, match="save-detailed"):
        from_bench_result({"p50_ttft_ms": 1.0})


def test_the_error_table_states_predicted_over_measured():
    predicted = {"ttft": {"p50": 0.150, "p99": 0.300}, "itl": {"p50": 0.004, "p99": 0.030},
                 "tpot": {"p50": 0.005, "p99": 0.006}}
    measured = {"ttft": {"p50": 100.0, "p99": 400.0}, "itl": {"p50": 5.0, "p99": 30.0},
                "tpot": {"p50": 5.0, "p99": 0.0}}
    cells = compare.error_cells(measured, predicted)
    assert cells["ttft_p50_ms"] == {"measured": 100.0, "predicted": pytest.approx(150.0), "error": pytest.approx(0.5)}
    assert cells["ttft_p99_ms"]["error"] == pytest.approx(-0.25) and cells["itl_p99_ms"]["error"] == pytest.approx(0)
    assert cells["tpot_p99_ms"]["error"] is None  # nothing measured: no error
    other = {k: {**c, "error": c["error"] and c["error"] / 5} for k, c in cells.items()}
    lines = compare.error_table({"2": {"requests": 24, "cells": cells}, "16": {"requests": 96, "cells": other}},
                                "title")
    assert lines[0] == "title" and lines[3].split()[:5] == ["2", "24", "100.0", "150.0", "+50%"]
    assert lines[4].split()[:2] == ["16", "96"] and lines[4].split()[4] == "+10%"
    assert "TTFT p50 50% (at 2/s)" in lines[-1] and "TTFT p99 25% (at 2/s)" in lines[-1]


class StandIn(BaseHTTPRequestHandler):
    """vLLM's OpenAI completions endpoint as bench serve reads it: a stream of one token per event, then the
    usage (the prompt's tokens as the server counted them)."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            time.sleep(0.002)
            self.wfile.write(b'data: {"choices": [{"index": 0, "text": " x", "finish_reason": null}]}\n\n')
            self.wfile.flush()
        usage = {"prompt_tokens": len(body["prompt"]) + 1, "completion_tokens": body["max_tokens"]}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args):
        pass


def test_bench_serve_against_a_stand_in_server_feeds_the_comparison(tmp_path):
    """vllm bench serve as part 1 runs it (its flags, its result file) against a stand-in of vllm serve; the
    comparison reads the result: the measured percentiles as bench serve wrote them, the simulator on the
    trace it sent, the table, the JSON; the warm-up pass before it (the same dataset's first prompt lengths)
    kept apart."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ckpt = check.checkpoint(tmp_path / "work", 8)
        out = tmp_path / "out"
        out.mkdir()
        args = check.parse_args(["--rates", "40", "--num-prompts", "6", "--input-len", "600", "--output-len", "5",
                                 "--num-warmups", "1", "--warmup-prompts", "3",
                                 "--port", str(server.server_address[1])])
        (out / "serve_settings.json").write_text(json.dumps({
            "gpu": "h100", "layers": 8, "budget": 8192, "max_num_seqs": 1024, "prefix_caching": False, "mtp": 0,
            "kv_gib": 20.0, "async_scheduling": True, "command": "serve_check_gpu.py"}))
        notes = check.bench_rates(args, ckpt, out, time.monotonic() + 300, on_result=lambda: check.report_serve(out))
    finally:
        server.shutdown()
    assert notes == [], (notes, (out / "serve_bench_rate40.log").read_text()[-3000:])
    result = json.loads((out / "bench_rate40.json").read_text())
    assert result["completed"] == 6 and result["output_lens"] == [5] * 6
    assert all(300 <= n <= 901 for n in result["input_lens"])  # 600 x (1 -/+ 0.5), as the stand-in counted
    warmup = json.loads((out / "warmup" / "bench_rateinf.json").read_text())  # the first pass, not compared
    assert warmup["completed"] == 3 and warmup["input_lens"] == result["input_lens"][:3]
    assert (out / "warmup" / "serve_bench_warmup.log").exists() and not (out / "serve_bench_warmup.log").exists()
    rates = json.loads((out / "serve_comparison.json").read_text())["rates"]
    assert list(rates) == ["40"]
    comparison = rates["40"]
    assert comparison["requests"] == 6 and comparison["failed"] == 0
    cells = comparison["cells"]
    assert cells["ttft_p99_ms"]["measured"] == result["p99_ttft_ms"] and cells["ttft_p99_ms"]["predicted"] > 0
    assert cells["itl_p50_ms"]["error"] == pytest.approx(cells["itl_p50_ms"]["predicted"] / result["p50_itl_ms"] - 1)
    table = (out / "serve_table.txt").read_text()
    assert "error = predicted / measured - 1" in table and table.splitlines()[4].split()[:2] == ["40", "6"]
    # the report alone, from what the run left
    assert check.main(["--out", str(out), "--report-only", "--parts", "serve"]) == 0
    assert "largest |error| per metric" in (out / "table.txt").read_text()


def test_the_warmup_pass_runs_before_the_rates_and_is_not_compared(tmp_path, monkeypatch):
    """bench serve's runs in order: the warm-up pass (every request at once, into ``out/warmup`` with its log)
    first, then each rate; the comparison after each rate, not after the warm-up pass; a failed warm-up pass
    named so in the notes."""
    runs, compared = [], []

    def fake_run(cmd, stdout, **kwargs):
        flag = {k: v for k, v in zip(cmd, cmd[1:]) if k.startswith("--")}
        runs.append((flag["--request-rate"], int(flag["--num-prompts"]), Path(flag["--result-dir"]), stdout.name))
        return SimpleNamespace(returncode=1 if flag["--request-rate"] == "inf" else 0)

    monkeypatch.setattr(check.subprocess, "run", fake_run)
    args = check.parse_args(["--rates", "2", "16", "--num-prompts", "4", "8", "--warmup-prompts", "5"])
    notes = check.bench_rates(args, "ckpt", tmp_path, time.monotonic() + 300,
                              on_result=lambda: compared.append(runs[-1][0]))
    assert [r[:3] for r in runs] == [("inf", 5, tmp_path / "warmup"), ("2", 4, tmp_path), ("16", 8, tmp_path)]
    assert runs[0][3] == str(tmp_path / "warmup" / "serve_bench_warmup.log")
    assert runs[1][3] == str(tmp_path / "serve_bench_rate2.log")
    assert compared == ["2", "16"]
    assert notes == ["the warm-up pass: bench serve ended with 1 (see warmup/serve_bench_warmup.log)"]
    runs.clear()
    no_warmup = check.parse_args(["--rates", "2", "--num-prompts", "4", "--warmup-prompts", "0"])
    check.bench_rates(no_warmup, "ckpt", tmp_path, time.monotonic() + 300)
    assert [r[0] for r in runs] == ["2"]  # --warmup-prompts 0: no warm-up pass


def test_the_default_budget_leaves_part_pcp2_its_time():
    """The default --time-budget holds the server's start (~180 s), the warm-up pass and every default rate
    as ``rate_seconds`` prices them, the server's stop (~30 s) and part pcp2's --pcp2-min-s, and stays under
    a 600 s command limit with ~40 s for part 2's stop and the report."""
    args = check.parse_args([])
    plan = check.bench_plan(args)
    assert plan[0] == (math.inf, args.warmup_prompts) and plan[1:] == check.rate_plan(args.rates, args.num_prompts)
    bench = sum(check.rate_seconds(rate, n) for rate, n in plan)
    assert check.rate_seconds(math.inf, args.warmup_prompts) == 35  # no arrival term at rate inf
    assert 180 + bench + 30 + args.pcp2_min_s <= args.time_budget <= 600 - 40


def _harness_line(plan, computed, new, prompt_lens) -> str:
    """The line ``harness.shared_gpu.record_step_kinds`` writes for a step of these requests, from the
    plugin's own plan of it and the harness's own counting (``_step_tokens``)."""
    from types import SimpleNamespace

    from harness.shared_gpu import _step_tokens

    starts = np.concatenate([[0], np.cumsum(new)])
    runner = SimpleNamespace(input_batch=SimpleNamespace(num_reqs=len(new), num_prompt_tokens=np.array(prompt_lens),
                                                         num_computed_tokens_cpu=np.array(computed)),
                             query_start_loc=SimpleNamespace(np=starts))
    kind = "whole" if plan is None or not plan.split.any() else "split"
    return f"{kind} {_step_tokens(runner, plan)}"


def test_the_harness_records_a_step_as_the_simulator_counts_it():
    """One step of three requests at pcp=2: a long prompt's chunk (split by the plugin's plan), a short
    prompt (whole) and a decode row; and a step of prompts under the split floor. The harness's record of
    each, read back, is the simulator's record of it."""
    from harness.shared_gpu import LONG_PROMPT
    from qwen36_pcp.plan import PCPPlan

    assert compare.LONG_PROMPT == LONG_PROMPT
    cases = [([8192, 0, 20000], [8188, 3, 1], [28000, 1000, 20000]), ([0, 4000], [4095, 1], [4095, 9000])]
    for computed, new, lens in cases:
        plan = PCPPlan(computed, new, 2, 0)
        forwards = compare.parse_step_lines([_harness_line(plan, computed, new, lens), "handover",
                                             _harness_line(None, [5], [1], [5])])  # a decode step
        prompts = [(n, length) for c, n, length in zip(computed, new, lens) if c < length]
        assert compare.prompt_steps(forwards) == [compare.step_record(prompts, 2)]
    assert compare.step_record([(8188, 28000), (3, 1000)], 2) == {
        "prompt": 8191, "split": 8188, "split_step": True, "long": 8188, "long_split": 8188}


def _steps(*specs):
    return [{"prompt": p, "split": s, "split_step": s > 0, "long": p if p >= 8000 else 0,
             "long_split": s if p >= 8000 else 0} for p, s in specs]


def test_the_step_mix_comparison_and_its_tolerance():
    sim = _steps((1000, 0), (8188, 8188), (8188, 8188), (624, 0), (8188, 8188), (5436, 5436))
    lines = ["whole prompt=0 split=0 long=0 long_split=0 verify=0"] * 3  # dummy runs and decode steps
    lines += [f"{'split' if s['split_step'] else 'whole'} prompt={s['prompt']} split={s['split']} "
              f"long={s['long']} long_split={s['long_split']} verify=0" for s in sim]
    engine = compare.prompt_steps(compare.parse_step_lines(lines))
    same = compare.compare_mix(engine, sim)
    assert same["ok"] and same["first_difference"] is None
    assert same["rows"]["split_steps"] == {"engine": 4, "sim": 4, "ok": True}
    assert same["rows"]["split_tokens"]["engine"] == 8188 * 3 + 5436
    # one chunk cut differently (within tolerance), then one split step fewer and its tokens whole (not)
    near = compare.compare_mix(engine[:5] + _steps((5400, 5400), (36, 0)), sim)
    assert near["ok"] and near["first_difference"]["step"] == 5
    assert near["rows"]["prompt_steps"] == {"engine": 7, "sim": 6, "ok": None}  # counted, not judged
    assert near["rows"]["split_tokens"]["ok"] and near["rows"]["split_steps"]["ok"]
    far = compare.compare_mix(engine[:4] + _steps((8188, 0), (5436, 0)), sim)
    assert not far["ok"] and not far["rows"]["split_tokens"]["ok"] and far["first_difference"]["step"] == 4
    assert compare.mix_table(far, "t")[-1] == "step mix within tolerance: NO"
    assert compare.schedule_difference([{"a": 3}, {}, {"a": 1}], [{"a": 3}, {"a": 1}]) is None  # empty calls left out
    assert compare.schedule_difference([{"a": 3}, {"a": 2}], [{"a": 3}, {"a": 1}])["step"] == 1


class SimulatedEngine:
    """vLLM's LLMEngine as ``replay`` drives it, over the simulator's engine: one engine-core pass a step;
    it has unfinished requests until all finished (it keeps calling its scheduler while nothing can run)."""

    def __init__(self, rep):
        self.rep = rep

    def has_unfinished_requests(self) -> bool:
        return self.rep.sched.has_requests() or self.rep.pending is not None

    def step(self):
        self.rep._iterate()
        return []


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_replaying_the_trace_by_scheduler_calls_gives_the_simulators_schedule(gpu):
    """Part 2's trace added to an engine after as many schedule() calls as the simulator's scheduler had made
    (the simulator's own engine standing in for vLLM's): the same steps, and the long prompts' chunks split."""
    args = check.parse_args([])
    trace = check.pcp2_trace(None)
    opt, max_model_len = check.pcp2_options(args, gpu), check.pcp2_max_model_len(trace)
    sim = compare.simulate_steps(trace, opt, 2, max_model_len)
    mix = compare.step_mix(sim["steps"])
    assert mix["prompt_tokens"] == sum(a.prompt for _, a in trace) and mix["split_steps"] >= 10
    assert any(s["split_step"] and s["split"] < s["prompt"] for s in sim["steps"])  # a split chunk beside a whole one
    rep, _, _ = compare.replica(opt, 2, max_model_len)
    calls, _, restore = check.record_schedule(rep.sched, time.perf_counter)
    spec_trace = [{"name": n, "time": a.time, "prompt": a.prompt, "output": a.output, "added_at": sim["added_at"][n]}
                  for n, a in trace]
    done = check.replay(SimulatedEngine(rep), spec_trace, calls, True, 1.0,
                        lambda r: rep.add(r["name"], Arrival(rep.host, r["prompt"], r["output"])))
    restore()
    assert done["early"] == [] and {n: a["call"] for n, a in done["added"].items()} == sim["added_at"]
    assert compare.schedule_difference(calls, sim["calls"]) is None
    assert all(rec.finished is not None for rec in rep.records.values())


def _pcp2_run(out: Path, gpu: str = "h100") -> dict:
    """What part 2 leaves in ``out``, with the simulator's engine standing in for vLLM's and the harness's
    records written as the simulator counts the steps: the spec, the simulator's steps, the engine's."""
    args = check.parse_args([])
    trace = check.pcp2_trace(None)
    opt, max_model_len = check.pcp2_options(args, gpu), check.pcp2_max_model_len(trace)
    sim = compare.simulate_steps(trace, opt, 2, max_model_len)
    (out / "pcp2_sim.json").write_text(json.dumps({"options": opt._asdict(), **sim}))
    spec = {"arrivals": "steps", "time_scale": 10.0, "gpu": gpu, "sim_options": opt._asdict(),
            "trace": [{"name": n, "time": a.time, "prompt": a.prompt, "output": a.output,
                       "added_at": sim["added_at"][n]} for n, a in trace]}
    (out / "pcp2_spec.json").write_text(json.dumps(spec))
    rep, _, _ = compare.replica(opt, 2, max_model_len)
    calls, times, restore = check.record_schedule(rep.sched, time.perf_counter)
    done = check.replay(SimulatedEngine(rep), spec["trace"], calls, True, 1.0,
                        lambda r: rep.add(r["name"], Arrival(rep.host, r["prompt"], r["output"])))
    restore()
    lines = ["whole prompt=0 split=0 long=0 long_split=0 verify=0"] * 2  # the profile run, the warm-up
    lines += [f"{'split' if s['split_step'] else 'whole'} prompt={s['prompt']} split={s['split']} long={s['long']} "
              f"long_split={s['long_split']} verify=0" for s in sim["steps"]]
    for rank in (0, 1):
        (out / f"pcp2_steps.{rank}").write_text("\n".join(lines) + "\n")
    engine = {"startup_s": 80.0, "trace_s": 25.0, "calls": calls, "call_times": times, **done,
              "step_offsets": {"pcp2_steps.0": 2, "pcp2_steps.1": 2},
              "config": {"async_scheduling": True, "prefix_caching": False, "max_num_batched_tokens": 8192,
                         "max_num_seqs": 256, "num_blocks": sim["num_blocks"]}}
    (out / "pcp2_engine.json").write_text(json.dumps(engine))
    return sim


def test_the_pcp2_report_from_what_the_run_leaves(tmp_path):
    sim = _pcp2_run(tmp_path)
    assert check.main(["--out", str(tmp_path), "--report-only", "--parts", "pcp2"]) == 0
    result = json.loads((tmp_path / "pcp2_comparison.json").read_text())
    assert result["ok"] and result["ranks_agree"] and result["schedule_difference"] is None
    assert result["same_settings"] and result["rows"]["split_steps"]["engine"] == compare.step_mix(sim["steps"])[
        "split_steps"]
    table = (tmp_path / "pcp2_table.txt").read_text()
    assert "step mix within tolerance: yes" in table and "step for step" in table
    # rank 1 split one chunk fewer, rank 0 (the one compared) a chunk less than the simulator did
    lines = (tmp_path / "pcp2_steps.1").read_text().splitlines()
    (tmp_path / "pcp2_steps.1").write_text("\n".join(lines[:-1]) + "\n")
    lines = (tmp_path / "pcp2_steps.0").read_text().splitlines()
    first_split = next(i for i, line in enumerate(lines) if line.startswith("split"))
    lines[first_split] = lines[first_split].replace("split", "whole", 1).replace(
        f"split={sim['steps'][first_split - 2]['split']}", "split=0").replace(
        f"long_split={sim['steps'][first_split - 2]['long_split']}", "long_split=0")
    (tmp_path / "pcp2_steps.0").write_text("\n".join(lines) + "\n")
    check.report_pcp2(tmp_path)
    result = json.loads((tmp_path / "pcp2_comparison.json").read_text())
    assert not result["ranks_agree"] and result["first_difference"]["step"] == first_split - 2
    assert result["rows"]["split_steps"]["engine"] == result["rows"]["split_steps"]["sim"] - 1
    assert result["rows"]["split_steps"]["ok"] and not result["rows"]["split_tokens"]["ok"] and not result["ok"]


class StandInLLM:
    """``vllm.LLM`` as part 2's engine process uses it, over the simulator's engine (vLLM's own scheduler and
    config, built for the CPU): its engine, the warm-up, the ranks' settling."""

    made: list = []

    def __init__(self, **kw):
        args = check.parse_args([])
        spec = json.loads(Path(self.spec_path).read_text())
        rep, _, _ = compare.replica(check.pcp2_options(args, spec["gpu"]), 2, kw["max_model_len"])
        engine = SimulatedEngine(rep)
        engine.vllm_config = rep.setup["vllm_config"]
        engine.engine_core = type("Client", (), {"engine_core": type("Core", (), {"scheduler": rep.sched})(),
                                                 "shutdown": lambda self: None})()
        engine.add_request = lambda rid, prompt, params: rep.add(rid, Arrival(
            rep.host, len(prompt["prompt_token_ids"]), params.max_tokens))
        self.llm_engine, self.kw = engine, kw
        StandInLLM.made.append(self)

    def generate(self, prompts, params, use_tqdm=False):
        assert len(prompts[0]["prompt_token_ids"]) == check.PCP2_WARMUP and params.max_tokens == 2

    def collective_rpc(self, method):
        assert method == "check_health"


def test_the_engine_process_replays_the_trace_and_writes_what_the_report_reads(tmp_path, monkeypatch):
    """Part 2's engine process (``--pcp2-child``) on a stand-in of vllm.LLM: the LLM keywords, the records
    left by the engine's start skipped, each request added at the simulator's call, the engine's schedule
    and settings written."""
    import vllm

    ckpt = check.checkpoint(tmp_path / "work", 8)
    args = check.parse_args(["--out", str(tmp_path)])
    spec_path = check.pcp2_prepare(args, ckpt, "h100", tmp_path)
    for rank in (0, 1):  # the engine's profile run and the warm-up, before the trace
        (tmp_path / f"pcp2_steps.{rank}").write_text("whole prompt=0 split=0 long=0 long_split=0 verify=0\n" * 3)
    (tmp_path / "pcp2_step_mix.png").write_bytes(b"\x89PNG")  # an earlier run's plot is no step record
    monkeypatch.setenv("QWEN36_PCP_RECORD_STEPS", str(tmp_path / "pcp2_steps"))
    monkeypatch.setattr(StandInLLM, "spec_path", str(spec_path), raising=False)
    monkeypatch.setattr(vllm, "LLM", StandInLLM)
    assert check.main(["--pcp2-child", str(spec_path), str(tmp_path / "pcp2_engine.json")]) == 0
    kw = StandInLLM.made[-1].kw
    assert kw["prefill_context_parallel_size"] == 2 and kw["worker_cls"] == "harness.shared_gpu.SharedGPUWorker"
    engine = json.loads((tmp_path / "pcp2_engine.json").read_text())
    sim = json.loads((tmp_path / "pcp2_sim.json").read_text())
    assert engine["step_offsets"] == {"pcp2_steps.0": 3, "pcp2_steps.1": 3}
    assert {n: a["call"] for n, a in engine["added"].items()} == sim["added_at"] and engine["early"] == []
    assert compare.schedule_difference(engine["calls"], sim["calls"]) is None
    config = engine["config"]  # (the stand-in's config is the simulator's: pcp=1, vLLM's CPU worker)
    assert config["pcp"] == 1 and config["worker_cls"].endswith("CPUWorker")
    assert {k: v for k, v in config.items() if k not in ("pcp", "worker_cls")} == {
        "async_scheduling": True, "prefix_caching": False, "max_num_batched_tokens": 8192, "max_num_seqs": 256,
        "max_model_len": kw["max_model_len"], "num_blocks": sim["num_blocks"]}
