# SPDX-License-Identifier: Apache-2.0
"""The MTP benchmark's reading of a profile: runs split at the workers' marks, the drafter's kernels
told by where they were launched, host copies left out; and its report of both kinds of result."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_mtp as bench


def _trace() -> list[dict]:
    """Two runs (whole, split), each: a target kernel, a host copy, then a drafter kernel launched in
    vLLM's draft scope; plus a kernel launched outside it after."""
    events = []

    def kernel(ts, dur, name, corr, in_draft):
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts - 5, "dur": 1,
                       "tid": 1, "args": {"correlation": corr}})
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}})
        if in_draft:
            events.append({"ph": "X", "cat": "user_annotation", "name": bench.DRAFT_SCOPE, "ts": ts - 6, "dur": 3,
                           "tid": 1})

    for i, (mode, base) in enumerate((("whole", 0), ("split", 10_000))):
        events.append({"ph": "X", "cat": "user_annotation", "name": f"{bench.MARK}{mode}", "ts": base, "dur": 0})
        kernel(base + 100, 4000, "fused_moe_kernel", 10 * i + 1, False)
        events.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": base + 4200,
                       "dur": 500, "args": {"correlation": 10 * i + 2}})
        kernel(base + 5000, 3000 if mode == "whole" else 1000, "flash_fwd_kernel", 10 * i + 3, True)
        kernel(base + 8500, 200, "elementwise_kernel", 10 * i + 4, False)
    return events


def test_profile_segments_split_runs_and_find_the_drafter():
    runs = bench.profile_segments(_trace(), ["whole/32768", "split/32768"])
    assert runs["whole/32768"]["drafter_ms"] == pytest.approx(3.0)
    assert runs["split/32768"]["drafter_ms"] == pytest.approx(1.0)
    assert runs["whole/32768"]["compute_ms"] == pytest.approx(7.2)  # the host copy left out
    assert runs["split/32768"]["compute_ms"] == pytest.approx(5.2)
    assert runs["whole/32768"]["segments_ms"] == pytest.approx([4.0, 3.2])  # cut at the copy to the host
    # a launch from another host thread inside the draft scope is not the drafter's
    other = [dict(e, tid=2) if e.get("cat") == "cuda_runtime" else e for e in _trace()]
    assert bench.profile_segments(other, ["whole/32768", "split/32768"])["whole/32768"]["drafter_ms"] == 0
    with pytest.raises(ValueError, match="2 marks"):
        bench.profile_segments(_trace(), ["whole/32768"])


def test_report_reads_turn_times_and_profiles(tmp_path):
    for config, (ranks, drafts) in bench.CONFIGS.items():
        if ranks <= 2:
            (tmp_path / f"{config}.json").write_text(json.dumps({
                "config": config, "mode": "eager", "prefill/32768": {"turn_ms": [100.0 + 20 * bool(drafts)] * 2},
                "decode": {"step_ms": [10.0 + 5 * bool(drafts)] * 2, "tokens_per_step": 1.0}}))
    runs = bench.profile_segments(_trace(), ["whole/32768", "split/32768"])
    (tmp_path / "pcp2_mtp_profile.json").write_text(json.dumps({
        "config": "pcp2_mtp", "mode": "eager", "labels": ["whole/32768", "split/32768"],
        "ranks": {"rank0": runs, "rank1": runs}}))
    result = bench.report(str(tmp_path))
    # the turn times' prefill rows are pcp=1's only (a pcp > 1 turn holds host copies): the profile's
    assert [r["ranks"] for r in result["split"]] == [1] and result["split"][0]["drafter_ms"] == pytest.approx(20.0)
    assert [r["ranks"] for r in result["profiled"]] == [2, 2] and result["decode"][0]["break_even"] == 0.5
    table = (tmp_path / "table.txt").read_text()
    # whole: step 7.2 ms of which the drafter 3.0 (41.7%); split: 5.2 / 1.0 (19.2%)
    assert "41.7%" in table and "19.2%" in table
    # predicted at 40 layers, pcp=2, whole: 3.0 / (4.2 x 5 + 3.0); split: 1.5 / (21 + 1.5)
    assert "12.5%" in table and "6.7%" in table


def test_the_mixed_report_sets_each_mixed_step_beside_its_parts(tmp_path):
    """``--mixed``'s table: per config and length the step alone, the verifications alone, the mixed step
    and its ratio to their sum; a folder without ``--mixed`` results gives no such table."""
    assert bench.mixed_report(str(tmp_path)) == []
    (tmp_path / "pcp2_mtp.json").write_text(json.dumps({"config": "pcp2_mtp", "mode": "eager", "chats": 16,
                                                        "alone/32768": 300.0, "verify_step_ms": 30.0,
                                                        "mixed/32768": 297.0}))
    lines = bench.mixed_report(str(tmp_path))
    assert "16 requests verifying" in lines[0]
    assert lines[-1].split() == ["pcp2_mtp", "32768", "300.0", "30.0", "297.0", "0.90"]
