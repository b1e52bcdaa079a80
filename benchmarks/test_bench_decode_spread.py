"""The decode spread benchmark's step-time model: the fit recovers a known step time (one outlier left
out), the graph sizes are vLLM's default capture sizes, and the report reads any set of configs."""

from __future__ import annotations

import json
import math

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
                row[f"spread{n}_turn_ms"] = _step(11.0, 0.08, bench.graph_rows(math.ceil(batch / n)), context)
            rows.append(row)
    rows[4]["replicated_ms"] = 18.6  # 4k, B=16
    fits = bench.fit_step_model(rows, [2, 4])
    assert fits["replicated"]["coef"] == pytest.approx([3.5, 0.05], rel=1e-6)
    assert fits["spread"]["coef"] == pytest.approx([11.0, 0.08], rel=1e-6)
    assert fits["replicated"]["dropped"] == (16, 4096, 18.6) and fits["spread"]["dropped"] is None
    assert bench.step_model(fits["spread"], 8, 131072) == pytest.approx(_step(11.0, 0.08, 8, 131072))


def test_report_reads_any_set_of_configs(tmp_path):
    point = {"turn_ms": [12.0, 6.0], "wall_ms": 20.0}
    (tmp_path / "pcp2_spread.json").write_text(json.dumps({"config": "pcp2_spread", "4096/1": point}))
    rows = bench.report(str(tmp_path))["rows"]
    assert rows == [{"context": 4096, "batch": 1, "spread2_turn_ms": 12.0, "spread2_fastest_ms": 6.0,
                     "spread2_ms": pytest.approx(12.0 + bench.collectives_ms(2, 1))}]
    assert "fastest" in (tmp_path / "table.txt").read_text()
