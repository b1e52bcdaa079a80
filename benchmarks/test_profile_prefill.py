# SPDX-License-Identifier: Apache-2.0
"""benchmarks/profile_prefill.py's trace summary: kernel kinds, busy time over overlapping streams."""

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import profile_prefill  # noqa: E402


@pytest.mark.parametrize("name, kind", [
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>", "attention"),
    ("kernel_unified_attention_2d", "attention"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("chunk_scaled_dot_kkt_fwd_kernel", "gdn"),
    ("_causal_conv1d_fwd_kernel", "gdn"),
    ("fused_moe_kernel", "moe"),
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "other"),
])
def test_kernel_kinds(name, kind):
    assert profile_prefill.kind_of(name) == kind


def _kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_summary_counts_overlap_once_and_ignores_host_events(tmp_path):
    events = [
        _kernel("fused_moe_kernel", 0, 100),
        _kernel("ncclDevKernel_AllGather_RING_LL", 50, 100),    # another stream, overlapping
        _kernel("nvjet_tst_gemm", 300, 50),                     # after a 150 us gap
        _kernel("Memcpy HtoD", 400, 10, cat="gpu_memcpy"),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10_000},
    ]
    summary = profile_prefill.summarize_trace(events)
    assert summary["kinds_ms"]["moe"] == pytest.approx(0.1)
    assert summary["kinds_ms"]["communication"] == pytest.approx(0.11)  # host copies count as such
    assert summary["kinds_ms"]["gemm"] == pytest.approx(0.05)
    assert summary["kinds_ms"]["other"] == 0
    assert summary["busy_ms"] == pytest.approx(0.21)  # [0, 150) + [300, 350) + [400, 410)
    assert summary["span_ms"] == pytest.approx(0.41)
    assert summary["kernels"] == 4

    host_only = tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank1.123.pt.trace.json.gz"
    with gzip.open(tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.123.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    with gzip.open(host_only, "wt") as f:
        json.dump({"traceEvents": events[-1:]}, f)
    assert list(profile_prefill.summarize_dir(str(tmp_path))) == ["rank0"]


def test_critical_path_takes_the_slowest_rank_between_collectives():
    def rank(*stretches_us):
        events, ts = [], 0
        for i, us in enumerate(stretches_us):
            if i:
                events.append(_kernel("Memcpy DtoH (Device -> Pageable)", ts, 5, cat="gpu_memcpy"))
                events.append(_kernel("Memcpy HtoD (Pageable -> Device)", ts + 10, 5, cat="gpu_memcpy"))
                ts += 20
            events.append(_kernel("fused_moe_kernel", ts, us))
            ts += us
        return profile_prefill.summarize_trace(events)

    r0, r1 = rank(100, 300, 100), rank(200, 100, 100)
    assert r0["segments_ms"] == pytest.approx([0.1, 0.3, 0.1])  # split at each copy to the host, not back
    critical, paired = profile_prefill.critical_path_ms([r0, r1])
    assert paired and critical == pytest.approx(0.2 + 0.3 + 0.1)
    # collectives that do not pair up: the slowest rank's compute time, flagged
    assert profile_prefill.critical_path_ms([r0, rank(600)]) == (pytest.approx(0.6), False)
    # kernels overlapping on two streams count once in their stretch
    overlapped = profile_prefill.summarize_trace([_kernel("fused_moe_kernel", 0, 100),
                                                  _kernel("nvjet_tst_gemm", 50, 100)])
    assert overlapped["segments_ms"] == pytest.approx([0.15])


def test_beyond_share_counts_a_ranks_kernels_over_its_1_over_n_of_pcp1():
    pcp1 = profile_prefill.summarize_trace([
        _kernel("nvjet_sm90_tst_256x128_TNT", 0, 400), _kernel("chunk_fwd_kernel_o", 400, 200),
        _kernel("Memcpy HtoD (Pageable -> Device)", 600, 50, cat="gpu_memcpy")])
    rank = profile_prefill.summarize_trace([
        _kernel("nvjet_sm90_tst_192x192_TNN", 0, 210),   # cuBLAS picked another GEMM for fewer rows
        _kernel("chunk_fwd_kernel_o", 210, 130),
        _kernel("CatArrayBatchedCopy", 340, 20),          # the split step's own work
        _kernel("Memcpy DtoH (Device -> Pageable)", 360, 500, cat="gpu_memcpy")])  # a collective
    total, top = profile_prefill.beyond_share(rank, pcp1, 2)
    assert total == pytest.approx(0.01 + 0.03 + 0.02)
    assert [(name, round(ms, 3)) for name, _, ms in top] == [
        ("chunk_fwd_kernel_o", 0.03), ("CatArrayBatchedCopy", 0.02), ("GEMMs (cuBLAS)", 0.01)]
