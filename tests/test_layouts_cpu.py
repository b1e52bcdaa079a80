# SPDX-License-Identifier: Apache-2.0
"""Beyond tp=1, on vLLM 0.20.2's real objects (CPU, gloo): configs resolved for tp=2 x pcp=2, tp=1 x pcp=4
and pcp=8, vLLM's process-group layout (ExternalDP x DP x PP x PCP x TP, TP fastest) and the PCP
all-gather order the plugin relies on, the model built and loaded on every rank (PCP layers, expert
placement replicated vs sharded), and the whole-experts memory check at tp > 1 and pcp = 8.

All ranks are forked from the test run's fake-CUDA server process (``tests.fake_cuda.RankServer``, the
``fake_cuda_ranks`` fixture): no vLLM import of their own, fresh processes (fresh vLLM globals) for
every topology.
"""

import json
import re

import pytest

ARCH = "Qwen3_6ForCausalLM"
OVERRIDES = {"architectures": [ARCH]}
SHARDED = {"qwen36_pcp": {"moe_experts": "sharded"}}
# For the model builds only: M-RoPE's cos/sin cache spans max_position_embeddings (262144 in the
# checkpoint), 1.2 CPU-seconds per rank; nothing checked here depends on it.
SHORT_ROPE = {"text_config": {"max_position_embeddings": 4096}}


@pytest.fixture(scope="module")
def server(fake_cuda_ranks):
    return fake_cuda_ranks


def _make_checkpoint(rank, world_size, port, path):
    from qwen36_pcp.tools.make_checkpoint import make_checkpoint

    return str(make_checkpoint(path, preset="tiny", seed=0))


@pytest.fixture(scope="module")
def tiny_ckpt(server, tmp_path_factory):
    # made in a rank forked from the server, which has transformers imported already (4 s, not 14)
    (path,) = server.run(_make_checkpoint, 1, str(tmp_path_factory.mktemp("ckpt") / "tiny"))
    return path


def _config(ckpt, tp, pcp, hf_overrides=None, **kwargs):
    from tests.fake_cuda import engine_config

    return engine_config(ckpt, hf_overrides={**OVERRIDES, **(hf_overrides or {})},
                         tensor_parallel_size=tp, prefill_context_parallel_size=pcp, **kwargs)


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - we want the message
        return f"{type(e).__name__}: {e}"
    return None


# ------------------------------------------------------------------------- 1. configs
TOPOLOGIES = [(2, 2), (1, 4), (1, 8)]


def _configs(rank, world_size, port, ckpt):
    from vllm.model_executor.model_loader.utils import get_model_architecture

    import qwen36_pcp
    from qwen36_pcp.checks import validate_pcp_config
    from qwen36_pcp.expert_memory import whole_experts_problems

    qwen36_pcp.register()
    out = {}
    for tp, pcp in TOPOLOGIES:
        cfg = _config(ckpt, tp, pcp)
        pc = cfg.parallel_config
        validate_pcp_config(cfg)  # again, on the resolved config: must still pass
        out[f"{tp}x{pcp}"] = {
            "world_size": pc.world_size, "tp": pc.tensor_parallel_size,
            "pcp": pc.prefill_context_parallel_size, "dcp": pc.decode_context_parallel_size,
            "arch": cfg.model_config.architecture,
            "model_cls": get_model_architecture(cfg.model_config)[0].__name__,
            "gdn_backend": cfg.additional_config.get("gdn_prefill_backend"),
            "whole_experts_problems": whole_experts_problems(cfg),
            # our checks run at this topology too: a combination they reject is rejected
            "ep_error": _error(lambda: _config(ckpt, tp, pcp, enable_expert_parallel=True)),
            "dcp_error": _error(lambda: _config(ckpt, tp, pcp, decode_context_parallel_size=tp))
            if tp > 1 else None,
        }
    return out


def test_configs_for_tp2_pcp2_pcp4_pcp8(server, tiny_ckpt):
    (out,) = server.run(_configs, 1, tiny_ckpt)
    for tp, pcp in TOPOLOGIES:
        c = out[f"{tp}x{pcp}"]
        assert (c["world_size"], c["tp"], c["pcp"], c["dcp"]) == (tp * pcp, tp, pcp, 1), c
        assert c["arch"] == ARCH and c["model_cls"] == ARCH
        assert c["gdn_backend"] == "triton"  # set by our config hook, after our checks passed
        assert c["whole_experts_problems"] == []
        assert c["ep_error"] and "qwen36_pcp" in c["ep_error"] and "enable_expert_parallel" in c["ep_error"]
        if tp > 1:
            assert "qwen36_pcp" in c["dcp_error"] and "decode context parallel" in c["dcp_error"]


# --------------------------------------------------------------- 2. process-group layout
def _layout(rank, world_size, port, ckpt, tp, pcp):
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import (
        get_dcp_group,
        get_dp_group,
        get_ep_group,
        get_pcp_group,
        get_pp_group,
        get_tp_group,
        get_world_group,
    )

    import qwen36_pcp

    qwen36_pcp.register()
    cfg = _config(ckpt, tp, pcp)
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
        initialize_model_parallel(tp, 1, prefill_context_model_parallel_size=pcp, backend="gloo")
    groups = {name: get() for name, get in (
        ("world", get_world_group), ("tp", get_tp_group), ("pcp", get_pcp_group), ("dcp", get_dcp_group),
        ("pp", get_pp_group), ("dp", get_dp_group), ("ep", get_ep_group))}
    out = {name: {"ranks": list(g.ranks), "rank_in_group": g.rank_in_group, "world_size": g.world_size}
           for name, g in groups.items()}
    # three rows per rank, tagged (global rank, PCP rank, TP rank, row)
    pcp_rank, tp_rank = groups["pcp"].rank_in_group, groups["tp"].rank_in_group
    x = torch.tensor([[rank, pcp_rank, tp_rank, i] for i in range(3)], dtype=torch.float32)
    out["pcp_gather"] = groups["pcp"].all_gather(x, dim=0).tolist()
    out["tp_gather"] = groups["tp"].all_gather(x, dim=0).tolist()
    return out


@pytest.mark.parametrize("tp,pcp", [(2, 2), (1, 8)])
def test_process_group_layout_and_pcp_gather_order(server, tiny_ckpt, tp, pcp):
    world = tp * pcp
    ranks = server.run(_layout, world, tiny_ckpt, tp, pcp)
    for g, r in enumerate(ranks):
        # vLLM's layout: arange(world).reshape(ExternalDP, DP, PP, PCP, TP); TP fastest
        p, t = divmod(g, tp)
        assert r["world"]["ranks"] == list(range(world)) and r["world"]["rank_in_group"] == g
        assert r["tp"]["ranks"] == [p * tp + i for i in range(tp)], r["tp"]
        assert r["tp"]["rank_in_group"] == t and r["tp"]["world_size"] == tp
        assert r["pcp"]["ranks"] == [i * tp + t for i in range(pcp)], r["pcp"]
        assert r["pcp"]["rank_in_group"] == p and r["pcp"]["world_size"] == pcp
        assert r["dcp"]["ranks"] == [g] and r["pp"]["ranks"] == [g] and r["dp"]["ranks"] == [g]
        assert r["ep"]["ranks"] == list(range(world))  # MoE: DP x PCP x TP flattened
        # the PCP all-gather concatenates the ranks' blocks in PCP-rank order
        assert r["pcp_gather"] == [[i * tp + t, i, t, row] for i in range(pcp) for row in range(3)]
        assert r["tp_gather"] == [[p * tp + i, p, i, row] for i in range(tp) for row in range(3)]


# --------------------------------------------------------------- 3. the model on every rank
def _model_on_rank(rank, world_size, port, ckpt, tp, pcp, additional_config):
    import torch
    from safetensors import safe_open

    import qwen36_pcp
    from tests.fake_cuda import build_model

    qwen36_pcp.register()
    cfg = _config(ckpt, tp, pcp, hf_overrides=SHORT_ROPE, additional_config=additional_config)
    model = build_model(cfg, port=port, rank=rank, pcp_ranks=pcp, tp=tp)
    from vllm.distributed import get_pcp_group, get_tp_group

    params = {n for n, _ in model.named_parameters()}
    experts = {n: m for n, m in model.named_modules() if hasattr(m, "moe_parallel_config")}
    out = {
        "tp_rank": get_tp_group().rank_in_group, "pcp_rank": get_pcp_group().rank_in_group,
        "gdn": sorted({type(m).__name__ for m in model.modules() if "DeltaNet" in type(m).__name__}),
        "impls": sorted({type(m.impl).__name__ for m in model.modules() if hasattr(m, "impl")}),
        "full_rows": sorted(n for n, m in model.named_modules() if getattr(m, "full_rows", False)),
        "experts": {},
    }
    with safe_open(f"{ckpt}/model.safetensors", "pt") as f:
        out["loaded_all"] = model.load_weights((n, f.get_tensor(n)) for n in f.keys()) == params
        for name, moe in experts.items():
            par = moe.moe_parallel_config
            prefix = "model.language_model." + name.removeprefix("model.")
            down = f.get_tensor(f"{prefix}.down_proj")  # [E, hidden, inter]
            gate_up = f.get_tensor(f"{prefix}.gate_up_proj")  # [E, 2 * inter, hidden]
            inter = down.shape[-1]
            w2, w13 = moe.w2_weight.data, moe.w13_weight.data
            n = inter // w2.shape[-1]  # the number of slices each expert is cut into here
            c = inter // n
            # which slice of the checkpoint's experts this rank holds (None: none of them, exactly)
            w2_slice = [k for k in range(n) if torch.equal(w2, down[..., k * c:(k + 1) * c])]
            w13_slice = [k for k in range(n) if torch.equal(w13, torch.cat(
                [gate_up[:, k * c:(k + 1) * c], gate_up[:, inter + k * c:inter + (k + 1) * c]], dim=1))]
            out["experts"][name] = {
                "tp_size": par.tp_size, "pcp_size": par.pcp_size, "tp_rank": par.tp_rank,
                "ep_size": par.ep_size, "num_experts": moe.local_num_experts,
                "w2_shape": list(w2.shape), "w13_shape": list(w13.shape),
                "w2_slice": w2_slice, "w13_slice": w13_slice,
                "w2_sum": w2.double().sum().item(), "ckpt_down_sum": down.double().sum().item(),
            }
    return out


def _check_common(ranks, num_moe_layers=8):
    for r in ranks:
        assert r["loaded_all"]
        assert r["gdn"] == ["PCPGatedDeltaNetAttention"] and r["impls"] == ["PCPFlashAttentionImpl"]
        # the narrow layers converted: the shared-expert gate, one per MoE layer
        assert r["full_rows"] == [f"model.layers.{i}.mlp.shared_expert_gate" for i in range(num_moe_layers)]
        assert len(r["experts"]) == num_moe_layers
        assert all(e["num_experts"] == 8 and e["ep_size"] == 1 for e in r["experts"].values())


def _slices(r):
    """The one slice of every expert (w2 and w13 alike) this rank holds, the same in every layer."""
    got = {(tuple(e["w2_slice"]), tuple(e["w13_slice"])) for e in r["experts"].values()}
    assert len(got) == 1, got
    (w2, w13), = got
    assert len(w2) == 1 and w2 == w13, got  # exactly one slice, the same for w2 and w13
    return w2[0]


@pytest.mark.parametrize("moe_experts", ["replicated", "sharded"])
def test_tp2_pcp2_model_and_expert_placement(server, tiny_ckpt, moe_experts):
    ranks = server.run(_model_on_rank, 4, tiny_ckpt, 2, 2, SHARDED if moe_experts == "sharded" else {})
    _check_common(ranks)
    assert [(r["pcp_rank"], r["tp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    slices = [_slices(r) for r in ranks]
    if moe_experts == "replicated":
        # experts shard over TP only: each rank has half of every expert, the TP shard
        for r in ranks:
            for e in r["experts"].values():
                assert (e["tp_size"], e["pcp_size"], e["tp_rank"]) == (2, 1, r["tp_rank"]), e
                assert e["w2_shape"] == [8, 256, 64] and e["w13_shape"] == [8, 128, 256]
        assert slices == [r["tp_rank"] for r in ranks] == [0, 1, 0, 1]  # PCP peers: identical shards
    else:
        # vLLM's sharding over TP x PCP: a quarter of every expert each, all four different
        for r in ranks:
            for e in r["experts"].values():
                assert (e["tp_size"], e["pcp_size"]) == (4, 2), e
                assert e["w2_shape"] == [8, 256, 32] and e["w13_shape"] == [8, 64, 256]
                assert e["tp_rank"] == 2 * r["pcp_rank"] + r["tp_rank"], e  # PCP x TP, TP fastest
        assert slices == [0, 1, 2, 3], slices  # each its flattened rank's quarter
    # the shards of one PCP rank's TP group (or of all four) add up to the checkpoint's experts
    for name, e0 in ranks[0]["experts"].items():
        group = ranks[:2] if moe_experts == "replicated" else ranks
        total = sum(r["experts"][name]["w2_sum"] for r in group)
        assert abs(total - e0["ckpt_down_sum"]) < 1e-9 * max(1.0, abs(e0["ckpt_down_sum"])) + 1e-6


def test_pcp8_every_rank_holds_every_expert_whole(server, tiny_ckpt):
    ranks = server.run(_model_on_rank, 8, tiny_ckpt, 1, 8, {})
    _check_common(ranks)
    assert [r["pcp_rank"] for r in ranks] == list(range(8))
    for r in ranks:
        assert _slices(r) == 0
        for e in r["experts"].values():
            assert (e["tp_size"], e["pcp_size"]) == (1, 1), e
            assert e["w2_shape"] == [8, 256, 128] and e["w13_shape"] == [8, 256, 256]
            assert e["w2_sum"] == e["ckpt_down_sum"]


# --------------------------------------------------------------- 4. the whole-experts memory check
MEMORY_UTILIZATION = 0.8  # not vLLM's default (0.92): the check must use the config's value


def _memory_check(rank, world_size, port, ckpt, gpu_sizes):
    import vllm.platforms as platforms

    import qwen36_pcp
    from tests.fake_cuda import engine_config

    qwen36_pcp.register()
    platform = type(platforms._current_platform)
    out = {}
    for name, gpu_bytes in gpu_sizes.items():
        platform.get_device_total_memory = classmethod(lambda cls, i=0, b=gpu_bytes: b)
        res = out[name] = {}
        for tp, pcp in ((1, 2), (2, 2), (1, 8)):
            kw = {"tensor_parallel_size": tp, "prefill_context_parallel_size": pcp,
                  "gpu_memory_utilization": MEMORY_UTILIZATION}
            res[f"{tp}x{pcp}"] = _error(lambda: engine_config(ckpt, hf_overrides=OVERRIDES, **kw))
            res[f"{tp}x{pcp}_sharded"] = _error(lambda: engine_config(
                ckpt, hf_overrides=OVERRIDES, additional_config=SHARDED, **kw))
    return out


def _gib(x):
    return f"{x / 2**30:.3g} GiB"


def test_whole_experts_memory_check_divides_by_tp_not_by_pcp(server, tiny_ckpt):
    text = json.load(open(f"{tiny_ckpt}/config.json"))
    text = text.get("text_config", text)
    need = (text["num_hidden_layers"] * text["num_experts"] * 3 * text["hidden_size"]
            * text["moe_intermediate_size"] * 2)  # bf16, every layer MoE
    assert need == 12 * 2**20
    util = MEMORY_UTILIZATION
    limit_tp1 = need / (0.8 * util)  # smallest GPU that takes whole experts at tp=1
    small, medium, big = int(0.98 * limit_tp1 / 2), int(0.98 * limit_tp1), int(1.02 * limit_tp1)
    sizes = {"small": small, "medium": medium, "big": big}
    (outs,) = server.run(_memory_check, 1, tiny_ckpt, sizes)
    for size, out in outs.items():
        assert all(out[f"{k}_sharded"] is None for k in ("1x2", "2x2", "1x8")), out  # sharded: no check
    # a GPU too small for whole experts at tp=1 x pcp=2 is big enough at tp=2 x pcp=2 (half each)
    assert outs["medium"]["1x2"] is not None and outs["medium"]["2x2"] is None
    assert outs["small"]["2x2"] is not None and outs["big"]["1x2"] is None and outs["big"]["2x2"] is None
    # pcp=8 has the same limit as pcp=2: whole experts do not shrink with pcp
    assert [outs[s]["1x8"] is None for s in outs] == [outs[s]["1x2"] is None for s in outs] == [
        False, False, True]
    for size, key, tp, pcp in (("medium", "1x2", 1, 2), ("medium", "1x8", 1, 8), ("small", "2x2", 2, 2)):
        msg = outs[size][key]
        total = sizes[size]
        assert f"prefill_context_parallel_size={pcp} " in msg, msg
        assert "keeps every expert on every GPU" in msg
        assert f": {_gib(need / tp)}, more than 80% of the {_gib(util * total)} that " \
               f"gpu_memory_utilization={util} allows" in msg, msg
        assert f"({_gib(need / tp / pcp)} each)" in msg, msg
        assert len(re.findall("GiB", msg)) == 3


# ----------------------------------------------------------------------- 5. the runner's block tables
def _block_tables(rank, world_size, port):
    """vLLM's block tables for a 1000-token model length in a PCP group of ``world_size``: outside the
    runner's ``pcp1_block_tables`` a row holds 1/pcp of the sequence's blocks; inside, all of them."""
    from types import SimpleNamespace

    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.v1.worker import block_table as bt
    from vllm.v1.worker import gpu_model_runner as gmr

    from qwen36_pcp.runner_hooks.block_tables import pcp1_block_tables, replicate_block_tables

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
        initialize_model_parallel(1, 1, prefill_context_model_parallel_size=world_size, backend="gloo")

    def table():
        return bt.MultiGroupBlockTable(max_num_reqs=2, max_model_len=1000, max_num_batched_tokens=64,
                                       pin_memory=False, device=torch.device("cpu"), block_sizes=[16],
                                       kernel_block_sizes=[16])

    originals = (bt.get_total_cp_world_size, gmr.get_total_cp_world_size)
    sharded = table()
    with pcp1_block_tables():
        whole = table()
    restored = (bt.get_total_cp_world_size, gmr.get_total_cp_world_size) == originals
    replicate_block_tables(SimpleNamespace(block_table=whole))
    t = whole.block_tables[0]
    return {"sharded": sharded.block_tables[0].max_num_blocks_per_req, "whole": t.max_num_blocks_per_req,
            "restored": restored, "pcp_fields": (t.pcp_world_size, t.pcp_rank),
            "vllm_fields": (sharded.block_tables[0].pcp_world_size, sharded.block_tables[0].pcp_rank)}


def test_runner_block_tables_hold_the_whole_sequence(server):
    """The PCP runner's block tables on two PCP ranks of vLLM's process groups."""
    ranks = server.run(_block_tables, 2)
    for rank, r in enumerate(ranks):
        assert r["sharded"] == 32 and r["whole"] == 63  # cdiv(1000, 16 x 2) and cdiv(1000, 16)
        assert r["restored"]
        assert r["vllm_fields"] == (2, rank) and r["pcp_fields"] == (1, 0)
