# SPDX-License-Identifier: Apache-2.0
"""GPU diagnostics, one entry point (one GPU is enough for each):

    python -m tests.gpu.diagnose dump ENGINE LAYOUT STEP:LO:HI[,...]   # where a layout departs from pcp=1
    python -m tests.gpu.diagnose kkt-race [--sweep-configs | --config-sensitivity | --pin-cost] [--lengths ...]
    [--runs N] [--shape tiny|35b]
    python -m tests.gpu.diagnose warm                                  # build and autotune the PCP kernels
    python -m tests.gpu.diagnose compiled-nosplit                      # compiled pcp=2 without a split step
    python -m tests.gpu.diagnose graphs                                # what compiled pcp=1 and pcp=2 compiled

``dump``: the first batch of one of ``test_pcp_e2e``'s engines (``defaults`` or ``chunked``) on pcp=1 and
on LAYOUT (shared GPU), every module's input and output for the listed steps and rows saved
(``layer_dump``) and lined up: the first module where the layout's rows differ from pcp=1's.
``kkt-race``: whether vLLM's GDN prefill kernels repeat themselves, and per autotune config of
``chunk_scaled_dot_kkt_fwd`` (the race ``qwen36_pcp.deterministic_gdn`` avoids); which kernels' output
follows their config, and what keeping them to one output's configs costs (``--pin-cost``).
``warm``: the Triton kernels pcp > 1 and tp = 2 engines add to pcp=1's, for a warm Triton cache.
``compiled-nosplit``: ``test_mtp_load_e2e``'s compiled load (MTP, K = 3) at pcp=1, at pcp=2 with
``min_split_tokens`` above every prompt (no step splits: every step is pcp=1's batch on every rank) and at
pcp=2: whether compiled pcp=2's departure from compiled pcp=1 (eager pcp=2 is bit for bit) needs a split
step. Identical without splits: the split steps' compiled graph departs (then ``dump`` on a split step);
apart: the unsplit steps' graph at pcp > 1 differs from pcp=1's (apart on one H100, 2026-12-07, in decode
steps). Under ``TORCHINDUCTOR_DETERMINISTIC=1`` (children inherit it) Inductor does not pick its generated
kernels' configs by timing them (one H100, 2026-12-07: still apart, from the first token, while the two pcp=2
engines agreed: the picks were not the cause). Saved per pcp=2 engine: the rule's
verdict, the step kinds, each engine's accepted draft tokens (vLLM's spec-decode counter) and per prompt
(``prompt_differences``) whether its tokens are pcp=1's, where tokens and logprobs first differ, the largest
logprob difference.
``graphs``: the same compiled pcp=1 engine and the pcp=2 one without splits, one after the other with caches
of their own, and what each compiled lined up (``compiled_graphs``): rank 0's Dynamo graphs line by line,
Inductor's Triton kernels by name and source.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import e2e


def dump(engine: str, layout: str, rows: str) -> dict:
    from . import layer_dump
    from . import test_pcp_e2e as t

    tp, pcp, _ = t.LAYOUTS[layout]
    if tp != 1:
        raise SystemExit(f"dump compares tp=1 layouts with pcp=1; {layout} has tp={tp}")
    out = f"/tmp/qwen36_pcp_dump/{engine}_{layout}"  # hundreds of MB: kept off the results folder
    os.environ[layer_dump.ENV] = f"{out};{rows}"
    jobs = t.layout_jobs()
    res = {}
    for name in ("pcp1", layout):
        spec, _ = jobs[f"{engine}_{name}"]
        spec = e2e.on_shared_gpu(spec)
        spec.pop("actions", None)
        spec["batches"] = spec["batches"][:1]
        spec["llm"]["worker_cls"] = "tests.gpu.layer_dump.DumpingWorker"
        res[name] = e2e.engine(spec, name=f"dump_{engine}_{name}")
    a, b = e2e.outputs(res["pcp1"]), e2e.outputs(res[layout])
    report = {"outputs": {**e2e.compare(a, b), "identical": a == b}}
    for step in sorted(layer_dump._parse(os.environ[layer_dump.ENV])[1]):
        report[f"step{step}"] = layer_dump.compare(out, step, world_size=pcp)
    return report


def nosplit_jobs() -> dict:
    """``test_mtp_load_e2e``'s compiled engines, and its pcp=2 one with no split step: {name: (spec, ranks)}."""
    import copy

    from . import test_mtp_load_e2e as t

    jobs = t.load_jobs()
    nosplit, ranks = copy.deepcopy(jobs["compiled_mtp3_pcp2"])
    nosplit["llm"]["additional_config"] = {"qwen36_pcp": {"min_split_tokens": 1 << 30}}
    return {"compiled_mtp3_pcp1": jobs["compiled_mtp3_pcp1"], "compiled_mtp3_pcp2": jobs["compiled_mtp3_pcp2"],
            "compiled_mtp3_pcp2_nosplit": (nosplit, ranks)}


def graphs() -> dict:
    from . import compiled_graphs

    jobs = nosplit_jobs()
    roots = compiled_graphs.run({name: jobs[name][0] for name in ("compiled_mtp3_pcp1", "compiled_mtp3_pcp2_nosplit")})
    return compiled_graphs.compare(roots["compiled_mtp3_pcp1"], roots["compiled_mtp3_pcp2_nosplit"])


def compiled_nosplit() -> dict:
    from . import test_mtp_load_e2e as t

    results = e2e.run_jobs(nosplit_jobs())
    failed = {k: str(r)[-2000:] for k, r in results.items() if isinstance(r, BaseException)}
    if failed:
        raise SystemExit(f"compiled-nosplit: engines failed: {failed}")
    ref = results["compiled_mtp3_pcp1"]["prompts_under_load"]
    report = {}
    for name in ("compiled_mtp3_pcp2_nosplit", "compiled_mtp3_pcp2"):
        outs = results[name]["prompts_under_load"]
        report[name] = {**e2e.compare(ref["outputs"], outs["outputs"]), "identical": ref["outputs"] == outs["outputs"],
                        "step_kinds": results[name].get("step_kinds"),
                        "accepted": {engine: results[engine].get("spec_decode_metrics", {}).get(t.ACCEPTED)
                                     for engine in ("compiled_mtp3_pcp1", name)},
                        "prompts": prompt_differences(ref, outs)}
    return report


def prompt_differences(ref: dict, other: dict) -> list[dict]:
    """Per prompt of two ``prompts_under_load`` results ({"ids", "outputs"}), matched by id: whether its
    tokens are the same, the first token index where the tokens differ and the first where the chosen
    token's logprob does (None: nowhere), and the largest |logprob difference| over the tokens they share."""
    theirs = dict(zip(other["ids"], other["outputs"]))
    rows = []
    for rid, a in zip(ref["ids"], ref["outputs"]):
        b = theirs.get(rid, {"token_ids": [], "logprobs": []})
        shared = next((i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y),
                      min(len(a["token_ids"]), len(b["token_ids"])))
        scored = min(shared, len(a["logprobs"]), len(b["logprobs"]))  # an aborted request may have fewer
        diffs = [abs(a["logprobs"][i][str(tok)] - b["logprobs"][i][str(tok)]) for i, tok in
                 enumerate(a["token_ids"][:scored])]
        rows.append({"id": rid, "same_tokens": a["token_ids"] == b["token_ids"],
                     "first_token_diff": None if a["token_ids"] == b["token_ids"] else shared,
                     "first_logprob_diff": next((i for i, d in enumerate(diffs) if d != 0), None),
                     "max_logprob_diff": max(diffs, default=0.0)})
    return rows


def main(argv) -> int:
    from . import gdn_kernel_race

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="where a layout's activations depart from pcp=1's")
    d.add_argument("engine", choices=["defaults", "chunked"])
    d.add_argument("layout")
    d.add_argument("rows", help="STEP:LO:HI[,STEP:LO:HI...] (steps from 1, rows of the runner's batch)")
    gdn_kernel_race.add_arguments(sub.add_parser("kkt-race", help="GDN prefill kernels' determinism"))
    sub.add_parser("warm", help="build and autotune the kernels PCP and tp=2 engines add")
    sub.add_parser("compiled-nosplit", help="compiled pcp=2 against compiled pcp=1 with no split step")
    sub.add_parser("graphs", help="what compiled pcp=1 and pcp=2 (no split step) compiled, lined up")
    args = parser.parse_args(argv)
    if args.cmd == "graphs":
        report = graphs()
        e2e.save("compiled_graphs", report)
        for key, c in report.items():
            print(key, json.dumps(c)[:4000])
        return 0
    if args.cmd == "compiled-nosplit":
        report = compiled_nosplit()
        e2e.save("compiled_nosplit", report)
        for name, c in report.items():
            print(name, json.dumps({k: v for k, v in c.items() if k not in ("diverged_at", "prompts")}))
        return 0
    if args.cmd == "warm":
        from . import warm_kernels

        warm_kernels.main()
        return 0
    if args.cmd == "kkt-race":
        return gdn_kernel_race.main(args)
    report = dump(args.engine, args.layout, args.rows)
    e2e.save(f"dump_{args.engine}_{args.layout}", report)
    print("outputs:", report["outputs"])
    for key, lines in report.items():
        if key.startswith("step"):
            bad = [x for x in lines if x.get("differ", 1)]
            print(f"{key}: {len(lines)} modules, {len(bad)} differ; first:")
            for x in bad[:40]:
                print("  ", json.dumps(x))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
