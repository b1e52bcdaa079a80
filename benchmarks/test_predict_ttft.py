# SPDX-License-Identifier: Apache-2.0
"""The step-time model runs on CPU from the committed profiles (benchmarks/predict_ttft.py)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def test_runs_from_the_committed_profiles_and_reports_its_validation(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "predict_ttft.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip().splitlines()[-1].startswith("max validation error: ")
    assert "across nodes of 8 x H200" in out
    assert (tmp_path / "predict_ttft.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


def test_pcp_collectives_cross_the_network_and_tp_stays_inside():
    from benchmarks.predict_ttft import MULTI_NODE, StepModel

    model = StepModel()
    cfg, nodes = MULTI_NODE["2 nodes, tp8 x pcp2, relay"]
    inside, across = model.step(cfg, 131072, 0), model.step(cfg, 131072, 0, nodes)
    assert across["communication"] > inside["communication"]  # the same bytes over InfiniBand
    assert across["total"] - across["communication"] == inside["total"] - inside["communication"]
    # tp's all-reduce covers each rank's rows, a PCP rank's half of the step
    rows = {name: b for name, _, b, _ in model.collectives(cfg, 131072)}
    assert rows["tp all-reduce"] == 2 * 7 / 8 * 65536 * 2048 * 2
    ttft = {name: model.ttft(c, 131072, None, n) for name, (c, n) in MULTI_NODE.items()}
    assert ttft["4 nodes, tp8 x pcp4, relay"] < ttft["2 nodes, tp8 x pcp2, relay"] < ttft["1 node, tp8"]


def test_a_pcp2_rank_takes_its_profiled_share_and_the_relay_waits_for_the_whole_recurrence():
    from benchmarks.predict_ttft import CONFIGS, RELAY_SERIAL_SHARE, SPLIT_CONFIGS, SPLIT_SHARES, StepModel, load

    model = StepModel()
    for tokens, name in ((32768, "32k"), (131072, "128k")):
        rows = load(SPLIT_SHARES)[name]
        for mode, config in SPLIT_CONFIGS.items():
            ranks = [r for key, r in rows.items() if key.startswith(config + "/")]
            share = sum(r["kinds_ms"]["moe"] for r in ranks) / len(ranks) / rows["pcp1/rank0"]["kinds_ms"]["moe"]
            step = model.step(CONFIGS["pcp2" if mode == "relay" else "pcp2_state_passing"], tokens, 0)
            imbalance = model.factors(mode, tokens)["imbalance"]
            assert step["moe"] == pytest.approx(model.kind_s("moe", tokens) * share * imbalance)
    for n in (2, 4, 8):  # the relay's recurrence runs rank after rank: it never shrinks below its share
        gdn = model.step(CONFIGS[f"pcp{n}"], 131072, 0)["gdn"]
        assert gdn > RELAY_SERIAL_SHARE * model.kind_s("gdn", 131072)
    sp8 = model.step(CONFIGS["pcp8_state_passing"], 131072, 0)["gdn"]
    assert sp8 < RELAY_SERIAL_SHARE * model.kind_s("gdn", 131072)


def test_at_n2_the_shares_give_back_each_profiled_critical_path():
    """The factors, the relay's chain and the interpolation agree at the profiled points."""
    from benchmarks.predict_ttft import SPLIT_CONFIGS, SPLIT_SHARES, StepModel, load

    model = StepModel()
    for tokens, name in ((32768, "32k"), (131072, "128k")):
        rows = load(SPLIT_SHARES)[name]
        base = {k: ms for k, ms in rows["pcp1/rank0"]["kinds_ms"].items() if k != "communication"}
        for mode, config in SPLIT_CONFIGS.items():
            f = model.factors(mode, tokens)
            gpu = sum(ms * model._critical_share(k, f, mode, 2) * f["imbalance"] for k, ms in base.items())
            assert gpu == pytest.approx(rows[f"{config}/rank0"]["critical_ms"], rel=1e-9)


def test_host_time_split_keeps_pcp1_and_the_front_end_is_a_per_request_term():
    """pcp=1's TTFT is what the host time is fitted to, however it is split; the first token's
    detokenization counts once per prompt (chunked or not) and only where the whole prompt primes it."""
    from benchmarks.predict_ttft import CONFIGS, TTFT_2X, StepModel, load

    model = StepModel()
    for tokens, measured in load(TTFT_2X)["pcp1"].items():
        assert model.ttft(CONFIGS["pcp1"], int(tokens)) == pytest.approx(measured, rel=1e-6)
    pcp2 = CONFIGS["pcp2"]
    whole = pcp2._replace(detokenize_whole_prompt=True)
    for budget in (None, 8192):
        extra = model.ttft(whole, 131072, budget) - model.ttft(pcp2, 131072, budget)
        assert extra == pytest.approx(model.whole_prompt_detokenize_s(131072)) and extra > 0.05
    every = pcp2._replace(gather_every_row=True)
    rows = {c: {name: b for name, _, b, _ in model.collectives(c, 131072)} for c in (pcp2, every)}
    assert rows[every]["final hidden-row all-gather"] == 65536 * 2048 * 2
    assert rows[pcp2]["final sampled-row all_gather"] == 2048 * 2
