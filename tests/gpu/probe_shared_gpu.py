"""test_pcp_e2e's pcp=2 engines with both ranks on one GPU (``shared_gpu``), against pcp=1.

    python -m tests.gpu.probe_shared_gpu [--pcp1 DIR] [case1_unequal_batch case2_3 case3_repeat serve]
    python -m tests.gpu.probe_shared_gpu dump CASE STEP:LO:HI[,...]   # where pcp=2 departs (layer_dump)

Each named case (default: all) runs its pcp=2 engine on GPU 0, collectives through host memory,
and is compared with the case's pcp=1 engine as test_pcp_e2e compares (rule (a), max |dlogprob|,
bit-identical or not), with case 4's checks on case 1's engine; ``serve`` is case 5. pcp=1 comes
from ``DIR/<case>_pcp1.json`` when given (saved results, whatever code made them), else it runs here.

Not the acceptance run (that needs two GPUs and tp=2 as the yardstick): it answers on one GPU
whether the split computes pcp=1's bits, through the same code as on two GPUs.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

from . import e2e
from . import test_pcp_e2e as t

WORKER = "tests.gpu.shared_gpu.SharedGPUWorker"
KV_BYTES = 16 << 30  # per rank; no memory profiling with two processes on one GPU
CASES = {  # case -> (jobs builder, {reported case: run indices})
    "case1_unequal_batch": (t.case1_jobs, {"case1_unequal_batch": None}),
    "case2_3": (t.case2_3_jobs, t.CASE2_3_RUNS),
    "case3_repeat": (t.case3_repeat_jobs, {"case3_repeat": None}),
}


def on_one_gpu(spec: dict) -> dict:
    spec = copy.deepcopy(spec)
    spec["llm"].update(worker_cls=WORKER, distributed_executor_backend="mp",
                       gpu_memory_utilization=0.3, kv_cache_memory_bytes=KV_BYTES)
    return spec


def _pcp1(case: str, job, pcp1_dir: str | None) -> dict:
    if pcp1_dir:
        return json.loads((Path(pcp1_dir) / f"{case}_pcp1.json").read_text())
    return e2e.engine(job, name=f"{case}_pcp1")


def run_case(case: str, pcp1_dir: str | None) -> dict:
    builder, reported = CASES[case]
    jobs = builder()
    pcp2 = e2e.engine(on_one_gpu(jobs[f"{case}_pcp2"][0]), name=f"{case}_pcp2_on1gpu")
    pcp1 = _pcp1(case, jobs[f"{case}_pcp1"][0], pcp1_dir)
    report = {}
    for name, runs in reported.items():
        a, b = e2e.outputs(pcp1, runs), e2e.outputs(pcp2, runs)
        report[name] = {**e2e.compare(a, b), "identical": a == b}
    if case == "case1_unequal_batch":
        report["case4"] = {k: pcp2[k] for k in ("max_tokens_one", "abort_mid_prefill", "shutdown_s")}
    if case == "case2_3":
        report["case3_cached_tokens_second_request"] = pcp2["runs"][2]["outputs"][0]["num_cached_tokens"]
    report["seconds"] = {"pcp1": [r["seconds"] for r in pcp1["runs"]],
                         "pcp2_on1gpu": [r["seconds"] for r in pcp2["runs"]],
                         "pcp2_on1gpu_startup": pcp2["startup_s"]}
    return report


def run_serve() -> dict:
    args = ["--worker-cls", WORKER, "--distributed-executor-backend", "mp",
            "--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", str(KV_BYTES)]
    return t._serve_pcp2("0", args, name="serve_pcp2_on1gpu")


def dump(case: str, rows: str) -> dict:
    """Case ``case``'s prompts (its first batch) on pcp=1 and pcp=2, module activations of ``rows``
    (``STEP:LO:HI,...``) saved and lined up (``layer_dump``)."""
    import os

    from . import layer_dump

    # the activations stay on the machine (hundreds of MB; run_on_device.sh packs $OUT)
    out = f"/tmp/qwen36_pcp_dump/{case}"
    os.environ[layer_dump.ENV] = f"{out};{rows}"
    spec = CASES[case][0]()[f"{case}_pcp1"][0]
    spec.pop("actions", None)
    spec["batches"] = spec.get("batches", [spec.get("prompts")])[:1]
    worker = "tests.gpu.layer_dump.DumpingWorker"
    pcp1 = copy.deepcopy(spec)
    pcp1["llm"]["worker_cls"] = worker
    pcp2 = on_one_gpu(spec)
    pcp2["llm"].update(worker_cls=worker, prefill_context_parallel_size=2)
    res = {n: e2e.engine(s, name=f"dump_{case}_{n}") for n, s in (("pcp1", pcp1), ("pcp2", pcp2))}
    report = {"outputs": {**e2e.compare(e2e.outputs(res["pcp1"]), e2e.outputs(res["pcp2"])),
                          "identical": e2e.outputs(res["pcp1"]) == e2e.outputs(res["pcp2"])}}
    for step in sorted(layer_dump._parse(os.environ[layer_dump.ENV])[1]):
        report[f"step{step}"] = layer_dump.compare(out, step)
    return report


def main(argv):
    if argv[:1] == ["dump"]:  # dump CASE STEP:LO:HI[,...]
        report = dump(argv[1], argv[2])
        e2e.save(f"dump_{argv[1]}", report)
        print("outputs:", report["outputs"])
        for key, lines in report.items():
            if key.startswith("step"):
                bad = [x for x in lines if x.get("differ", 1)]
                print(f"{key}: {len(lines)} modules, {len(bad)} differ; first:")
                for x in bad[:40]:
                    print("  ", json.dumps(x))
        return 0
    pcp1_dir = None
    if argv[:1] == ["--pcp1"]:
        pcp1_dir, argv = argv[1], argv[2:]
    report = {}
    for case in argv or [*CASES, "serve"]:
        try:
            report[case] = run_serve() if case == "serve" else run_case(case, pcp1_dir)
        except AssertionError as e:  # one case's failure (with its log tail) does not stop the others
            report[case] = {"error": str(e)[-3000:]}
        print(f"[{case}] {json.dumps(report[case], indent=1)[:3000]}", flush=True)
        e2e.save("shared_gpu_e2e", report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
