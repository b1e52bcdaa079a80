"""The decode spread benchmark's step-time model: the fit recovers a known step time (one outlier left
out), the graph sizes are vLLM's default capture sizes, and the report reads any set of configs."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import bench_decode_spread as bench


def _step(a: float, b: float, rows: int, context: int) -> float:
    return a + b * rows + bench.kv_read_ms(rows, context)


def test_graph_rows_are_vllms_capture_sizes():
    assert [bench.graph_rows(r) for r in (1, 2, 3, 5, 8, 9, 17, 33, 250, 257)] == [1, 2, 4, 8, 8, 16, 24, 40,
                                                                                   256, 272]


def test_fit_recovers_the_step_time_and_leaves_one_outlier_out():
    rows = []
    for context in (4096, 16384):
        for batch in (1, 2, 4, 8, 16, 32, 64):
            row = {"context": context, "batch": batch, "replicated_ms": _step(3.5, 0.05, batch, context)}
            for n in (2, 4):
                row[f"spread{n}_extra_ms"] = 0.8 + 0.01 * batch
            rows.append(row)
    rows[4]["replicated_ms"] = 18.6  # 4k, B=16
    fits = bench.fit_step_model(rows, [2, 4])
    assert fits["replicated"]["coef"] == pytest.approx([3.5, 0.05], rel=1e-6)
    assert fits["extra"]["coef"] == pytest.approx([0.8, 0.01], rel=1e-6)
    assert fits["replicated"]["dropped"] == (16, 4096, 18.6) and fits["extra"]["dropped"] is None
    assert bench.step_model(fits["replicated"], 8, 131072) == pytest.approx(_step(3.5, 0.05, 8, 131072))
    assert bench.step_model(fits["extra"], 8, 131072) == pytest.approx(0.88)


def test_report_predicts_spread_from_pcp1_at_the_ranks_own_batch(tmp_path):
    (tmp_path / "pcp1.json").write_text(json.dumps({"config": "pcp1", "4096/1": {"turn_ms": [3.0]},
                                                    "4096/2": {"turn_ms": [3.5]}}))
    point = {"turn_ms": [12.0, 6.0], "extra_ms": [0.5, 0.75], "wall_ms": 20.0}
    (tmp_path / "pcp2_spread.json").write_text(json.dumps({"config": "pcp2_spread", "4096/2": point}))
    rows = bench.report(str(tmp_path))["rows"]
    assert rows[1] == {"context": 4096, "batch": 2, "replicated_ms": 3.5, "spread2_turn_ms": 12.0,
                       "spread2_extra_ms": 0.75,
                       "spread2_ms": pytest.approx(3.0 + 0.75 + bench.collectives_ms(2, 2))}
    assert "pred" in (tmp_path / "table.txt").read_text()


def test_spread_extra_is_the_forward_around_the_model_call_without_the_collective():
    keys = bench.SPREAD_TIMED
    before = {keys["plan"]: 1.0, keys["heads"]: 1.0, keys["owned"]: 1.0, keys["model"]: 1.0, keys["collective"]: 1.0}
    after = {keys["plan"]: 1.024, keys["heads"]: 1.048, keys["owned"]: 2.0, keys["model"]: 1.24,
             keys["collective"]: 1.48}
    # per step: plan 1 ms + heads 2 ms + (forward 41.67 - model 10 - collective 20) ms
    assert bench.spread_extra_ms(before, after) == pytest.approx(1e3 * (0.024 + 0.048 + 1.0 - 0.24 - 0.48) / 24)


def test_timed_functions_add_their_host_time(monkeypatch):
    from benchmarks import profile_host

    class Runner:
        def step(self, x):
            return x + 1

    monkeypatch.setattr(profile_host, "_timers", {})
    monkeypatch.setattr(sys.modules[__name__], "Runner", Runner, raising=False)
    target = f"{__name__}:Runner.step"
    profile_host.time_functions(None, [target])
    profile_host.time_functions(None, [target])  # once only
    assert Runner().step(1) == 2 and Runner().step(2) == 3
    assert Runner.step.timed_as == target and Runner.step.__wrapped__.__name__ == "step"
    assert 0 < profile_host.read_timers()[target] < 1
