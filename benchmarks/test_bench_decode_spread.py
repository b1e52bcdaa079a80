# SPDX-License-Identifier: Apache-2.0
"""The decode spread benchmark's step-time model: the fit recovers a known step time (one outlier left
out), the graph sizes are vLLM's default capture sizes, and the report reads any set of configs."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_decode_spread as bench


def _step(a: float, b: float, rows: int, context: int) -> float:
    return a + b * rows + bench.kv_read_ms(rows, context, 2)


def test_graph_rows_are_vllms_capture_sizes():
    assert [bench.graph_rows(r) for r in (1, 2, 3, 5, 8, 9, 17, 33, 250, 257)] == [1, 2, 4, 8, 8, 16, 24, 40,
                                                                                   256, 272]


def test_fit_recovers_the_step_time_and_leaves_one_outlier_out():
    pts = [(b, c, _step(3.5, 0.05, b, c)) for c in (4096, 16384) for b in (1, 2, 4, 8, 16, 32, 64)]
    pts[4] = (16, 4096, 18.6)  # far off, and pulling the line off the first point most
    fit = bench.fit_line(pts, 2)
    assert fit["coef"] == pytest.approx([3.5, 0.05], rel=1e-6)
    assert fit["dropped"] == (16, 4096, 18.6)
    assert bench.step_model(fit, 8, 131072) == pytest.approx(_step(3.5, 0.05, 8, 131072))
    flat = bench.fit_line([(b, 4096, 0.8 + 0.01 * b) for b in (1, 2, 4, 8)], None)
    assert flat["coef"] == pytest.approx([0.8, 0.01]) and flat["dropped"] is None
    assert bench.step_model(flat, 8, 131072) == pytest.approx(0.88)


def _write(tmp_path, config, points):
    (tmp_path / f"{config}.json").write_text(json.dumps({"config": config, **points}))


def test_spread_step_is_the_turn_less_its_host_memory_copies(tmp_path):
    _write(tmp_path, "pcp1", {f"4096/{b}": {"turn_ms": [3.0 + 0.1 * b]} for b in (1, 2, 4, 8)})
    _write(tmp_path, "pcp2_spread", {f"4096/{b}": {"turn_ms": [12.0, 6.0], "staging_ms": [9.5, 2.0],
                                                  "own_ms": [2.5, 4.0]} for b in (1, 2, 4, 8)})
    out = bench.report(str(tmp_path))
    row = out["rows"][1]
    # the slowest rank on a GPU of its own is rank 1 (4.0 ms against rank 0's 2.5 ms)
    assert row["spread2_turn_ms"] == 12.0
    assert row["spread2_ms"] == pytest.approx(4.0 + bench.collectives_ms(2, 2, 2))
    # overhead over pcp=1's step of the rank's own ceil(B/2) requests: 4.0 - (3.0 + 0.1 * ceil(B/2))
    assert bench.step_model(out["fits"]["overhead2"], 2, 4096) == pytest.approx(0.9, abs=0.06)
    text = (tmp_path / "table.txt").read_text()
    assert "less its collective's copies" in text and "upper bound" not in text


def test_a_run_without_timed_copies_reports_an_upper_bound(tmp_path):
    _write(tmp_path, "pcp2_spread", {"4096/1": {"turn_ms": [12.0, 6.0]}})
    rows = bench.report(str(tmp_path))["rows"]
    assert rows == [{"context": 4096, "batch": 1, "spread2_turn_ms": 12.0,
                     "spread2_ms": pytest.approx(12.0 + bench.collectives_ms(2, 1, 2))}]
    assert "upper bound" in (tmp_path / "table.txt").read_text()


def test_per_step_medians_ignore_a_one_off_stall():
    # two ranks, five steps: rank 0 turns of 4 ms (one of 400 ms: a kernel compiled on first use) with 1 ms
    # of host-memory copies and 2 ms of GPU waits each, rank 1 turns of 6 ms with 3 ms of copies, 0.5 of waits
    turn0, turn1 = [4, 400, 4, 4, 4], [6] * 5
    now = [{"turn": 0.0, "staging": 0.0, "drain": 0.0} for _ in range(2)]
    marks = [[dict(c) for c in now]]
    for a, b in zip(turn0, turn1):
        for c, turn, staging, drain in ((now[0], a, 1, 2), (now[1], b, 3, 0.5)):
            c["turn"] += turn / 1e3
            c["staging"] += staging / 1e3
            c["drain"] += drain / 1e3
        marks.append([dict(c) for c in now])
    point = bench.per_step_medians(marks)
    assert point["turn_ms"] == pytest.approx([4, 6]) and point["staging_ms"] == pytest.approx([1, 3])
    assert point["own_ms"] == pytest.approx([3, 3]) and point["turn_mean_ms"][0] == pytest.approx(83.2)
    assert point["drain_ms"] == pytest.approx([2, 0.5]) and point["host_ms"] == pytest.approx([1, 2.5])


def test_hidden_host_bound_is_the_larger_of_host_and_gpu_work_left_per_rank(tmp_path):
    _write(tmp_path, "pcp1", {"4096/1": {"turn_ms": [5.0], "own_ms": [5.0], "host_ms": [3.0], "drain_ms": [2.0]}})
    # rank 0: host 1, wait 4 -> 4; rank 1: host 3.5, wait 1 -> 3.5: the slowest rank's 4
    _write(tmp_path, "pcp2_spread", {"4096/1": {"turn_ms": [6.0, 6.0], "staging_ms": [1.0, 1.5],
                                                "own_ms": [5.0, 4.5], "host_ms": [1.0, 3.5], "drain_ms": [4.0, 1.0]}})
    row = bench.report(str(tmp_path))["rows"][0]
    assert row["replicated_hidden_ms"] == 3.0
    assert row["spread2_hidden_ms"] == pytest.approx(4.0 + bench.collectives_ms(2, 1, 2))
    assert "lower bounds with the host's work hidden" in (tmp_path / "table.txt").read_text()
    # the collective is GPU work: inside the max, not added to the host's side
    assert bench.hidden_host_ms({"host_ms": [3.0], "drain_ms": [1.0]}, 0.5) == 3.0


def test_report_reads_each_ranks_own_step(tmp_path):
    _write(tmp_path, "pcp2_spread", {"4096/1": {"turn_ms": [12.0, 6.0], "staging_ms": [9.0, 1.0],
                                                "own_ms": [2.5, 4.5]}})
    row = bench.report(str(tmp_path))["rows"][0]
    assert row["spread2_ms"] == pytest.approx(4.5 + bench.collectives_ms(2, 1, 2))


def test_report_gives_the_host_phases_largest_of_the_ranks(tmp_path):
    phases = {"pcp1": [{"GPUModelRunner.execute_model": 2.0}],
              "pcp2_spread": [{"GPUModelRunner.execute_model": 5.0, "OwnedBatch.write_heads": 0.25},
                              {"GPUModelRunner.execute_model": 6.5, "OwnedBatch.write_heads": 0.125}]}
    for config, ranks in phases.items():
        _write(tmp_path, config, {"4096/1": {"turn_ms": [4.0] * len(ranks), "phases_ms": ranks}})
    bench.report(str(tmp_path))
    lines = (tmp_path / "table.txt").read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("host time by phase"))
    assert lines[head + 1].split() == ["B=1", "phase", "pcp1", "pcp2_spread"]
    assert lines[head + 2].split() == ["GPUModelRunner.execute_model", "2.000", "6.500"]
    assert lines[head + 3].split() == ["OwnedBatch.write_heads", "-", "0.250"]


def test_shared_prefix_prompts_differ_only_in_their_tails():
    a, b = (bench.prompt_ids(4096, i, shared_prefix=True) for i in (0, 1))
    cut = 4096 - bench.TAIL
    assert len(a) == len(b) == 4096 and a[:cut] == b[:cut] and a[cut:] != b[cut:]
    assert bench.prompt_ids(4096, -1, shared_prefix=True)[:cut] == a[:cut]  # the prefix request's
    c, d = (bench.prompt_ids(4096, i, shared_prefix=False) for i in (0, 1))
    assert c[:8] != d[:8] and min(c + d) >= 10


def test_a_shared_prefix_run_says_so(tmp_path):
    (tmp_path / "pcp1.json").write_text(json.dumps({"config": "pcp1", "shared_prefix": True,
                                                   "32768/1": {"turn_ms": [4.0]}}))
    bench.report(str(tmp_path))
    assert "--shared-prefix" in (tmp_path / "table.txt").read_text().splitlines()[0]


def test_the_replicated_control_is_reported_apart_from_spread(tmp_path):
    _write(tmp_path, "pcp1", {"4096/1": {"turn_ms": [4.0], "host_ms": [2.5], "drain_ms": [1.0]}})
    _write(tmp_path, "pcp2_replicated", {"4096/1": {"turn_ms": [5.0, 6.0], "host_ms": [3.0, 3.5],
                                                    "drain_ms": [1.0, 1.0]}})
    out = bench.report(str(tmp_path))
    assert out["rows"] == [{"context": 4096, "batch": 1, "replicated_ms": 4.0,  # no spread column
                            "replicated_hidden_ms": 2.5, "control2_turn_ms": 6.0}]
    lines = (tmp_path / "table.txt").read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("control:"))
    assert lines[head + 2].split() == ["4096", "1", "4.00", "2.50", "6.00", "3.50"]
    _write(tmp_path, "pcp2_spread", {"4096/1": {"turn_ms": [7.5, 7.0], "own_ms": [7.0, 6.5]}})
    bench.report(str(tmp_path))
    lines = (tmp_path / "table.txt").read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("control:"))
    # beside spread at the same N: both take turns alike; (x) = the control's turn over spread's
    assert lines[head + 2].split() == ["4096", "1", "4.00", "2.50", "6.00", "3.50", "7.50", "(0.80x)"]


def test_the_report_prices_its_runs_layers_and_refuses_a_mix(tmp_path):
    for config in ("pcp1", "pcp2_spread"):
        (tmp_path / f"{config}.json").write_text(json.dumps({"config": config, "layers": 24,
                                                            "4096/8": {"turn_ms": [4.0, 4.0]}}))
    row = bench.report(str(tmp_path))["rows"][0]
    assert "first 24 layers" in (tmp_path / "table.txt").read_text().splitlines()[0]
    # the collective carries the K/V of 6 attention layers, not 2
    assert row["spread2_ms"] == pytest.approx(4.0 + bench.collectives_ms(2, 8, 6))
    assert bench.collectives_ms(2, 8, 6) > bench.collectives_ms(2, 8, 2)
    (tmp_path / "pcp1.json").write_text(json.dumps({"config": "pcp1", "layers": 8, "4096/8": {"turn_ms": [4.0]}}))
    with pytest.raises(SystemExit, match=r"different \(layers, drafts\)"):
        bench.report(str(tmp_path))


def test_an_mtp_run_prices_verification_rows_and_refuses_a_mix(tmp_path):
    for config in ("pcp1", "pcp2_spread"):
        (tmp_path / f"{config}.json").write_text(json.dumps(
            {"config": config, "drafts": 3, "4096/8": {"turn_ms": [4.0, 4.0], "tokens_per_step": 1.0}}))
    row = bench.report(str(tmp_path))["rows"][0]
    head = (tmp_path / "table.txt").read_text().splitlines()[0]
    assert "verifies 1 + 3 rows per request" in head and "1.00 to 1.00 tokens per request" in head
    # every one of the 4 rows per request gathered, in a graph of 16 rows per rank, not 4
    assert row["spread2_ms"] == pytest.approx(4.0 + bench.collectives_ms(2, 8, 2, 3))
    assert bench.collectives_ms(2, 8, 2, 3) > bench.collectives_ms(2, 8, 2)
    (tmp_path / "pcp1.json").write_text(json.dumps({"config": "pcp1", "4096/8": {"turn_ms": [4.0]}}))
    with pytest.raises(SystemExit, match=r"\[\(8, 0\), \(8, 3\)\]"):
        bench.report(str(tmp_path))


def test_runs_that_would_mix_layer_counts_or_outgrow_the_gpu_are_refused_before_any_engine(tmp_path, monkeypatch):
    def no_engine(*a, **k):
        raise AssertionError("an engine started")

    monkeypatch.setattr(bench.bench_ttft, "run_child", no_engine)
    out = str(tmp_path)

    def main(*argv):
        monkeypatch.setattr("sys.argv", ["bench_decode_spread.py", "--out", out, *argv])
        bench.main()

    (tmp_path / "pcp1.json").write_text(json.dumps({"config": "pcp1", "layers": 8}))
    with pytest.raises(SystemExit, match=r"different \(layers, drafts\) in .*: \[\(8, 0\), \(24, 0\)\]"):
        main("--layers", "24", "--configs", "pcp2_spread")
    with pytest.raises(SystemExit, match=r"\[\(8, 0\), \(8, 3\)\]"):
        main("--mtp", "--configs", "pcp2_spread")
    (tmp_path / "pcp1.json").unlink()
    model = bench.bench_ttft.checkpoint(out, layers=24)
    rank = bench.rank_bytes(model)
    # 24 layers of about 1.7 GB of weights per rank, the embedding and LM head (2 GB), the KV cache
    weights = rank - (8 << 30) - bench.RANK_ALLOWANCE_BYTES
    assert 24 * 1.6e9 + 2e9 < weights < 24 * 1.75e9 + 2.1e9
    assert 1.6e9 < bench.rank_bytes(model, 3) - rank < 1.8e9  # the MTP head: one more layer
    monkeypatch.setattr(bench, "gpu_bytes", lambda: 3 * rank)
    with pytest.raises(SystemExit, match="pcp4_spread: 4 ranks of about 61 GB each do not fit"):
        main("--layers", "24", "--configs", "pcp2_spread", "pcp4_spread")
    monkeypatch.setattr(bench, "gpu_bytes", lambda: 4 * rank)
    with pytest.raises(AssertionError, match="an engine started"):
        main("--layers", "24", "--configs", "pcp4_spread")
