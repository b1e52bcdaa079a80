# SPDX-License-Identifier: Apache-2.0
"""The serving simulator on CPU (benchmarks/serve_sim.py): vLLM's own scheduler, traces with known answers,
a loud refusal of another scheduler interface, and the step-time model's mixed steps."""

import inspect
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import serve_sim, serve_sim_engine, serve_sim_traffic  # noqa: E402
from benchmarks.predict_ttft import Rows  # noqa: E402
from benchmarks.serve_sim_engine import Arrival  # noqa: E402

KV = 20 << 30  # per GPU: the tests' traces need little


def options(**kw):
    return serve_sim.Options(**{"kv_bytes": KV, "prefix_caching": False, **kw})


def run(layout, arrivals, **kw):
    """The simulator's replicas after the trace (and its metrics)."""
    opt = options(**kw)
    model, cfg = serve_sim.step_model(opt.gpu, opt.layers), layout.config()
    shape = serve_sim_engine.EngineShape(tp=layout.tp, budget=opt.budget, max_model_len=65536, kv_bytes=KV,
                                         mtp=opt.mtp, prefix_caching=False, async_scheduling=opt.async_scheduling)
    rep = serve_sim_engine.Replica(shape, lambda rows: model.batch_step(cfg, rows, opt.mtp), Rows, opt.accept)
    for i, a in enumerate(arrivals):
        rep.advance(a.time)
        rep.add(f"r{i}", a)
    rep.advance(float("inf"))
    return rep, model, cfg


def test_the_scheduler_is_vllms_own_class_and_code():
    import vllm
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    vllm_dir = Path(vllm.__file__).resolve().parent
    for async_scheduling, cls in ((True, AsyncScheduler), (False, Scheduler)):
        rep, _, _ = run(serve_sim.Layout(), [Arrival(0.0, 300, 2)], async_scheduling=async_scheduling)
        assert type(rep.sched) is cls and type(rep.sched.kv_cache_manager) is KVCacheManager
        for name in ("schedule", "update_from_output", "add_request"):
            code = inspect.getfile(getattr(type(rep.sched), name))
            assert Path(code).resolve().is_relative_to(vllm_dir), f"{name} comes from {code}, not vLLM"
        assert rep.records["r0"].tokens == 2


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("pcp", [1, 4])
def test_one_request_alone_ttft_is_the_models_step_sum(async_scheduling, pcp):
    """20000 tokens at vLLM's 8192-token budget: 8192 + 8192 + 3616 back to back from its arrival, then one
    decode step per token."""
    layout = serve_sim.Layout(pcp=pcp)
    rep, model, cfg = run(layout, [Arrival(2.0, 20000, 4)], async_scheduling=async_scheduling)
    chunks = [(8192, 0), (8192, 8192), (3616, 16384)]
    prefill = [model.batch_step(cfg, [Rows(q, c, True)])["total"] for q, c in chunks]
    decode = [model.batch_step(cfg, [Rows(1, 20000 + i, False)])["total"] for i in range(3)]
    rec = rep.records["r0"]
    assert rep.steps[0].start == 2.0
    assert [s.prompt_tokens for s in rep.steps[:3]] == [q for q, _ in chunks]
    assert rec.token_times[0] - rec.arrival == pytest.approx(sum(prefill), rel=1e-9)
    assert rec.finished - rec.arrival == pytest.approx(sum(prefill) + sum(decode), rel=1e-9)
    assert [s.split for s in rep.steps[:3]] == [pcp > 1, pcp > 1, False]  # 3616 < min_split_tokens
    metrics = serve_sim.summarize([rep], model, cfg)
    assert metrics["ttft"]["p50"] == pytest.approx(sum(prefill) + model.detokenize_s(cfg, 20000), rel=1e-9)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_two_requests_the_second_waits_as_vllm_schedules_it(async_scheduling):
    """Two 8192-token prompts at once (FCFS, budget 8192): the first fills step 1; step 2 holds its decode row
    beside 8191 of the second's tokens, step 3 its next decode row beside the second's last token."""
    layout = serve_sim.Layout(pcp=2)
    rep, model, cfg = run(layout, [Arrival(0.0, 8192, 3), Arrival(0.0, 8192, 3)], async_scheduling=async_scheduling)
    steps = [[Rows(8192, 0, True)], [Rows(1, 8192, False), Rows(8191, 0, True)],
             [Rows(1, 8193, False), Rows(1, 8191, True)]]
    d = [model.batch_step(cfg, s)["total"] for s in steps]
    assert [(s.prompt_tokens, s.rows) for s in rep.steps[:3]] == [(8192, 0), (8191, 1), (1, 1)]
    assert rep.records["r0"].token_times[0] == pytest.approx(d[0], rel=1e-9)
    assert rep.records["r1"].token_times[0] == pytest.approx(sum(d), rel=1e-9)
    assert rep.steps[1].split and rep.steps[1].kind == "mixed"  # the prompt split, its decode row beside it


def test_mixed_steps_split_the_prompt_and_replicate_the_decode_and_verification_rows():
    model = serve_sim.step_model("h200", 40)
    chunk, verify = Rows(8192, 65536, True), [Rows(4, 30000, False, 3)] * 16
    cost = {}
    for n in (1, 2, 4, 8):
        cfg = serve_sim.Layout(pcp=n).config()
        alone, mixed = (model.batch_step(cfg, rows, mtp=3) for rows in ([chunk], [chunk, *verify]))
        assert alone["split"] == mixed["split"] == (n > 1)
        cost[n] = (alone["total"], mixed["total"] - alone["total"])
    for n in (2, 4, 8):  # the chunk divides over the ranks; the rows cost every rank what they cost pcp=1
        assert cost[n][0] < cost[n // 2][0]
        assert cost[n][1] == pytest.approx(cost[1][1], rel=0.02)
    pcp4 = serve_sim.Layout(pcp=4).config()  # under min_split_tokens (4096) a chunk runs whole on every rank
    assert not model.batch_step(pcp4, [Rows(4095, 0, True)])["split"]
    assert model.batch_step(pcp4, [Rows(4096, 0, True)])["split"]


def test_decode_grows_with_the_batch_and_tp_divides_its_reads():
    model = serve_sim.step_model("h200", 40)
    pcp1, tp2 = serve_sim.Layout().config(), serve_sim.Layout(tp=2).config()
    steps = [model.decode_s(pcp1, b, b, b * 4096) for b in (1, 8, 64, 256)]
    assert steps == sorted(steps) and steps[0] == pytest.approx(4.5e-3, rel=0.05)  # the measured 40-layer ITL
    assert model.decode_s(tp2, 64, 64, 64 * 4096) < steps[2]
    mtp = model.decode_s(pcp1, 4 * 64, 64, 64 * 4096, drafts=3, mtp=3)
    assert steps[2] < mtp < 4 * steps[2]


def test_a_different_scheduler_interface_fails_loudly(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    serve_sim_engine.check_interface()  # vLLM 0.20.2's passes
    monkeypatch.setattr(Scheduler, "schedule", lambda self, budget: None)
    monkeypatch.delattr(Scheduler, "update_draft_token_ids")
    monkeypatch.setattr(Request, "__init__", lambda self, request_id, prompt_token_ids, sampling_params,
                        pooling_params, arrival_time=None: None)
    with pytest.raises(serve_sim_engine.SchedulerInterfaceError) as e:
        serve_sim_engine.engine_setup(serve_sim_engine.EngineShape(kv_bytes=KV - 1))
    text = str(e.value)
    assert "Scheduler.schedule takes (self, budget)" in text and "update_draft_token_ids is missing" in text
    assert "Request.__init__ has no parameter block_hasher" in text


def test_memory_left_for_kv_follows_the_doctors_experts():
    from types import SimpleNamespace

    from qwen36_pcp.doctor import model_config_like, read_model_config
    from qwen36_pcp.expert_memory import whole_experts_bytes

    like = model_config_like(read_model_config("qwen3.6-35b-a3b"))
    experts = whole_experts_bytes(SimpleNamespace(model_config=like), 1)
    kv = {(tp, pcp): serve_sim.kv_bytes(serve_sim.Layout(tp, pcp), "h200", 0, 8192) for tp, pcp in ((1, 1), (1, 8),
                                                                                                    (2, 1))}
    assert kv[(1, 1)] == kv[(1, 8)] > 0  # whole experts on every PCP rank: PCP does not add KV memory
    assert kv[(2, 1)] - kv[(1, 1)] > experts / 2  # TP halves them
    assert serve_sim.kv_bytes(serve_sim.Layout(), "h100", 0, 8192) < 4 << 30  # 35B at tp=1 leaves an H100 ~nothing


def test_traffic_from_a_bench_serve_result_and_distributions(tmp_path):
    result = {"start_times": [10.5, 10.0, 12.0], "input_lens": [100, 200, 300], "output_lens": [5, 6, 7]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(result))
    assert serve_sim_traffic.from_trace(str(path)) == [Arrival(0.0, 200, 6), Arrival(0.5, 100, 5),
                                                        Arrival(2.0, 300, 7)]
    burst = serve_sim_traffic.synthetic(50, float("inf"), "16:32", "7")
    serve_sim_traffic.write_trace(burst, str(tmp_path / "trace.jsonl"))
    assert serve_sim_traffic.from_trace(str(tmp_path / "trace.jsonl")) == sorted(burst)
    assert all(a.time == 0 and 16 <= a.prompt <= 32 and a.output == 7 for a in burst)
    poisson = serve_sim_traffic.synthetic(2000, 4.0, "100", "1")
    assert poisson[-1].time / 2000 == pytest.approx(0.25, rel=0.1)
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "' + "x" * 400 + '", "output_tokens": 9}\n')
    assert serve_sim_traffic.dataset_lengths(str(data)) == [(100, 9)]


def test_plan_ranks_layouts_by_p99_ttft_within_the_itl(capsys, tmp_path):
    argv = ["plan", "--gpus", "2", "--prompt-len", "20000", "--output-len", "4", "--rate", "2", "--num-requests",
            "4", "--budget", "8192", "--kv-gib", "20", "--prefix-caching", "off", "--out", str(tmp_path)]
    assert serve_sim.main(argv) == 0
    out = capsys.readouterr().out
    ranked = [line.split()[1] for line in out.splitlines() if line[:4].strip().isdigit()]
    assert sorted(ranked) == ["dp2", "pcp2", "tp2"]
    results = {r["layout"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    p99 = [results[name]["ttft"]["p99"] for name in ranked]
    assert p99 == sorted(p99) and "predicted" in out
    assert (tmp_path / "table.txt").read_text().startswith("$ python benchmarks/serve_sim.py plan")
    assert os.path.exists(tmp_path / "serve_sim.png") or "no plot" in out


def test_the_gpu_check_compares_a_bench_serve_result_with_the_simulator(tmp_path):
    """``serve_check_gpu.py --report-only`` on a result laid out as vLLM 0.20.2's bench serve writes it (the
    whole part: benchmarks/test_serve_check.py)."""
    from vllm.benchmarks import serve as bench_serve

    assert "start_times" in inspect.getsource(bench_serve) and 'f"p{p_word}_{metric_attribute_name}_ms"' in \
        inspect.getsource(bench_serve)  # the keys read below
    result = {"start_times": [0.0, 0.5], "input_lens": [6000, 7000], "output_lens": [8, 8]}
    for key in ("ttft", "itl", "tpot"):
        result.update({f"p50_{key}_ms": 100.0, f"p99_{key}_ms": 200.0})
    (tmp_path / "bench_rate2.json").write_text(json.dumps(result))
    (tmp_path / "serve_settings.json").write_text(json.dumps({"gpu": "h100", "layers": 8, "kv_gib": 20.0, "mtp": 0,
                                                              "budget": 8192, "command": "serve_check_gpu.py"}))
    import subprocess

    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serve_check_gpu.py"), "--out", str(tmp_path),
                          "--report-only"], capture_output=True, text=True, timeout=120, check=True).stdout
    comparison = json.loads((tmp_path / "serve_comparison.json").read_text())["rates"]["2"]["cells"]
    assert comparison["ttft_p99_ms"]["measured"] == 200.0 and comparison["ttft_p99_ms"]["predicted"] > 0
    assert "error = predicted / measured - 1" in out and "== part pcp2" in out


def test_a_second_engine_shape_in_a_fresh_process(tmp_path):
    """Two engine setups of different shapes in a process that never resolved vLLM's platform (the GPU
    check's report simulates one per trace): the second one's configs still see a platform."""
    import subprocess

    code = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
            "from benchmarks import serve_sim_engine as e\n"
            "for kv in (4 << 30, 5 << 30):\n"
            "    print(e.engine_setup(e.EngineShape(kv_bytes=kv, max_model_len=32768, layers=8))['num_blocks'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = (int(x) for x in out.stdout.split()[-2:])
    assert second > first > 0
