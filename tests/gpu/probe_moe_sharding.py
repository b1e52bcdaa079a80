"""How much of pcp=2's distance from pcp=1 is vLLM's MoE sharding over the PCP ranks? (1 GPU)

    QWEN36_PCP_REUSE=DIR python -m tests.gpu.probe_moe_sharding [--shards 2] [--jobs NAME ...]
    python -m tests.gpu.probe_moe_sharding rows          # are the kernels row-invariant?

At pcp > 1, vLLM 0.20.2 shards every expert's intermediate dimension over the PCP group
(``FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp``): each rank runs its shard on the
all-gathered tokens and a bf16 reduce-scatter adds the shards, which is tp=2's MoE arithmetic. This
probe runs the pcp=1 engines of ``test_pcp_e2e.py`` on one GPU with that sum emulated (the routed
experts computed shard by shard, each rounded to bf16, then added in fp32 and rounded, as NCCL does
for two ranks) and compares them with the saved pcp=1 baselines, next to the saved pcp=2 and tp=2
results (all from DIR). Where pcp=2 is no further from pcp=1 than this emulation, the MoE sharding
alone explains it.

``rows``: whether the dense GEMM and the fused MoE give a token the same bits when its batch is
split as pcp=2 splits it (the question behind running the experts unsharded at pcp > 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from . import e2e

SAVED = ("pcp2", "tp2")


def install_sharded_moe(shards: int) -> None:
    """Routed experts as ``shards`` intermediate shards summed in bf16 (this process only)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    orig = UnquantizedFusedMoEMethod.apply

    def shard_weights(layer):
        cached = getattr(layer, "_probe_shards", None)
        if cached is None:
            w13, w2 = layer.w13_weight.data, layer.w2_weight.data
            inter = w2.shape[-1]
            step = inter // shards
            cached = layer._probe_shards = [
                (torch.cat([w13[:, s * step:(s + 1) * step], w13[:, inter + s * step:inter + (s + 1) * step]], 1)
                 .contiguous(), w2[:, :, s * step:(s + 1) * step].contiguous())
                for s in range(shards)
            ]
        return cached

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts_input):
        full13, full2 = layer.w13_weight.data, layer.w2_weight.data
        total = None
        try:
            for w13, w2 in shard_weights(layer):
                layer.w13_weight.data, layer.w2_weight.data = w13, w2
                part = orig(self, layer, x, topk_weights, topk_ids, shared_experts_input).float()
                total = part if total is None else total + part
        finally:
            layer.w13_weight.data, layer.w2_weight.data = full13, full2
        return total.to(x.dtype)

    UnquantizedFusedMoEMethod.apply = apply


def pcp1_specs(names) -> dict:
    """The pcp=1 job specs of test_pcp_e2e, engine core in process (so the patch reaches the model)."""
    from . import test_pcp_e2e as t

    jobs = {}
    for builder in (t.case1_jobs, t.case2_3_jobs, t.case3_repeat_jobs):
        for name, (spec, _) in builder().items():
            case = name.rsplit("_pcp1", 1)[0]
            if name.endswith("_pcp1") and (not names or case in names):
                jobs[case] = dict(spec, engine_core_in_process=True)
    return jobs


def first_token_diffs(ref, other):
    out = []
    for a, b in zip(ref, other):
        tok = str(a["token_ids"][0])
        lp = b["logprobs"][0].get(tok)
        out.append(None if lp is None else round(abs(a["logprobs"][0][tok] - lp), 4))
    return out


def run_cases(args) -> dict:
    reuse = Path(os.environ.get("QWEN36_PCP_REUSE", "/nonexistent"))
    report = {}
    for case, spec in pcp1_specs(args.jobs).items():
        name = f"{case}_pcp1_moe{args.shards}shards"
        res = emulated_engine(spec, name, args.shards)
        ref = json.loads((reuse / f"{case}_pcp1.json").read_text())
        rows = {f"pcp1_moe{args.shards}shards": res}
        for other in SAVED:
            path = reuse / f"{case}_{other}.json"
            if path.exists():
                rows[other] = json.loads(path.read_text())
        report[case] = {}
        for label, r in rows.items():
            d = e2e.compare(e2e.outputs(ref), e2e.outputs(r))
            d["first_token"] = first_token_diffs(e2e.outputs(ref), e2e.outputs(r))
            report[case][label] = d
            print(f"[{case}] {label:>16} vs pcp1: ok={d['ok']} max|dlogprob|={d['max_logprob_diff']:.4g} "
                  f"first-token {d['first_token']}", flush=True)
        e2e.save(f"probe_moe_sharding_{args.shards}shards", report)
    return report


def emulated_engine(spec, name, shards):
    """``e2e.engine`` with the sharded-MoE patch installed in the child."""
    import subprocess
    import tempfile
    import time

    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        log_path = e2e.out_dir() / f"{name}.log"
        t0 = time.time()
        with open(log_path, "w") as log:
            rc = subprocess.call([sys.executable, "-m", "tests.gpu.probe_moe_sharding", "engine",
                                  str(spec_path), str(out_path), "--shards", str(shards)],
                                 cwd=e2e.REPO, stdout=log, stderr=subprocess.STDOUT, env=e2e.child_env(),
                                 timeout=480)
        if rc != 0 or not out_path.exists():
            raise SystemExit(f"{name}: exit {rc}\n" + log_path.read_text()[-4000:])
        result = json.loads(out_path.read_text())
        result["wall_s"] = time.time() - t0
        e2e.save(name, result)
        return result


# ------------------------------------------------------------------------------- row invariance
def rows_check() -> dict:
    """Full batch vs pcp=2 zigzag rank slices (padded like the plan's local layout), bitwise."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import fused_experts, fused_topk

    dev = "cuda"
    torch.manual_seed(0)
    shapes = {"tiny": dict(H=256, E=8, topk=2, inter=128), "35b": dict(H=2048, E=256, topk=8, inter=512)}
    report = {}
    with set_current_vllm_config(VllmConfig()):
        for shape, s in shapes.items():
            for T in (2048, 16384, 20000):
                b = [T * i // 4 for i in range(5)]
                rank_rows = {0: torch.cat([torch.arange(b[0], b[1]), torch.arange(b[3], b[4])]),
                             1: torch.arange(b[1], b[3])}
                x = torch.randn(T, s["H"], device=dev, dtype=torch.bfloat16)
                ws = {n: torch.randn(n, s["H"], device=dev, dtype=torch.bfloat16) / s["H"] ** 0.5
                      for n in (1, 2, 8, 16, 64, 3 * s["H"])}  # output widths: gates ... projections
                w1 = torch.randn(s["E"], 2 * s["inter"], s["H"], device=dev, dtype=torch.bfloat16) / s["H"] ** 0.5
                w2 = torch.randn(s["E"], s["H"], s["inter"], device=dev, dtype=torch.bfloat16) / s["H"] ** 0.5
                logits = torch.randn(T, s["E"], device=dev, dtype=torch.float32)
                tw, ti, _ = fused_topk(x, logits, s["topk"], renormalize=True)
                full_lin = {n: torch.nn.functional.linear(x, w) for n, w in ws.items()}
                full_moe = fused_experts(x, w1, w2, tw, ti)
                t_pad = max(len(r) for r in rank_rows.values())
                for rank, idx in rank_rows.items():
                    idx = idx.to(dev)
                    pad = torch.cat([idx, idx[-1:].expand(t_pad - len(idx))])  # padding rows
                    # the same rows padded to the full batch's row count (full_rows_linear)
                    pad_full = torch.cat([idx, idx[-1:].expand(T - len(idx))])
                    moe = fused_experts(x[pad], w1, w2, tw[pad], ti[pad])[: len(idx)]
                    key = f"{shape}_T{T}_rank{rank}"
                    report[key] = {"moe_max_abs": (moe.float() - full_moe[idx].float()).abs().max().item(),
                                   "moe_scale": full_moe.float().abs().max().item()}
                    for n, w in ws.items():
                        ref = full_lin[n][idx].float()
                        for name, rows in (("local", pad), ("full_rows", pad_full)):
                            got = torch.nn.functional.linear(x[rows], w)[: len(idx)].float()
                            report[key][f"linear_N{n}_{name}_max_abs"] = (got - ref).abs().max().item()
                    print(key, report[key], flush=True)
    e2e.save("probe_rows", report)
    return report


def main(argv):
    if argv and argv[0] == "engine":
        p = argparse.ArgumentParser()
        p.add_argument("cmd")
        p.add_argument("spec")
        p.add_argument("out")
        p.add_argument("--shards", type=int, default=2)
        a = p.parse_args(argv)
        if a.shards > 1:
            install_sharded_moe(a.shards)
        result = e2e.run_engine(json.loads(Path(a.spec).read_text()))
        Path(a.out).write_text(json.dumps(result))
        return 0
    if argv and argv[0] == "rows":
        rows_check()
        return 0
    p = argparse.ArgumentParser()
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--jobs", nargs="*", default=[], help="cases (default: all three)")
    run_cases(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main(sys.argv[1:]))
