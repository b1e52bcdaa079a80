# SPDX-License-Identifier: Apache-2.0
"""The questions users ask of a long-prompt deployment, answered with the serving simulator (predicted):

    python benchmarks/serve_sim_answers.py --out DIR [--gpus 8 4] [--report-only]

Traffic: prompts of 16k to 128k tokens (uniform), 256 output tokens, Poisson arrivals at a light, a loaded
and a heavy rate per GPU count, with and without MTP (K = 3, each draft accepted with p = 0.7). Every layout
of the GPUs (tp x pcp x dp, ``serve_sim.layouts_for``) at every chunk budget of ``BUDGETS``. Writes
``grid.json`` (every run), ``answers.md`` (the three tables) and ``answers.png``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: benchmarks/
from benchmarks import serve_sim  # noqa: E402
from benchmarks.plot import save_figure  # noqa: E402
from benchmarks.serve_sim_traffic import synthetic  # noqa: E402

BUDGETS = (8192, 16384, 32768, 65536)
RATES_PER_GPU = {"light": 1 / 32, "loaded": 1 / 8, "heavy": 1 / 4}  # requests/s per GPU
ITL_TARGETS_MS = (50, 150)
PROMPTS, OUTPUT, REQUESTS, MTP, ACCEPT = "16384:131072", "256", 150, 3, 0.7
KEPT = ("layout", "fits", "budget", "mtp", "gpus", "load", "rate", "ttft", "itl", "tpot", "output_tok_s",
        "kv_gib_per_gpu", "preempted", "why")


def rounded(x):
    """Four significant digits: grid.json stays small."""
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    return float(f"{x:.4g}") if isinstance(x, float) else x


def grid(gpus_list, out: Path) -> list[dict]:
    runs = []
    for gpus, (load, per_gpu), mtp in itertools.product(gpus_list, RATES_PER_GPU.items(), (0, MTP)):
        rate = per_gpu * gpus
        arrivals = synthetic(REQUESTS, rate, PROMPTS, OUTPUT, seed=0)
        for layout, budget in itertools.product(serve_sim.layouts_for(gpus), BUDGETS):
            r = serve_sim.simulate(layout, arrivals, serve_sim.Options(budget=budget, mtp=mtp, accept=ACCEPT))
            r.update(gpus=gpus, load=load, rate=rate)
            runs.append({k: rounded(r[k]) for k in KEPT if k in r})
            print(f"{gpus} GPUs {load:>6} mtp={mtp} {serve_sim.row(r)}", flush=True)
    (out / "grid.json").write_text(json.dumps(runs) + "\n")
    return runs


def best(runs, itl_ms=None, where=lambda r: True):
    ok = [r for r in runs if r["fits"] and where(r) and (itl_ms is None or r["itl"]["p99"] * 1e3 <= itl_ms)]
    return min(ok, key=lambda r: r["ttft"]["p99"], default=None)


def cell(r, itl=True) -> str:
    if r is None:
        return "none"
    text = f"{r['layout']} @{r['budget'] // 1024}k: {r['ttft']['p99']:.2f} s"
    return text + (f" ({r['itl']['p99'] * 1e3:.0f} / {r['itl']['max'] * 1e3:.0f} ms)" if itl else "")


def scenarios(runs):
    keys = sorted({(r["gpus"], r["load"], r["rate"], r["mtp"]) for r in runs},
                  key=lambda k: (-k[0], list(RATES_PER_GPU).index(k[1]), k[3]))
    for gpus, load, rate, mtp in keys:
        yield (f"{gpus} | {load} ({rate:g}/s) | {'K=3' if mtp else 'off'}",
               [r for r in runs if (r["gpus"], r["load"], r["mtp"]) == (gpus, load, mtp)])


def tables(runs) -> list[str]:
    targets = " | ".join(f"ITL p99 <= {t} ms" for t in ITL_TARGETS_MS)
    out = [(f"Predicted (serve_sim: vLLM 0.20.2's scheduler on the step-time model; H200, 40 layers, {REQUESTS} "
            f"requests of {PROMPTS} prompt tokens and {OUTPUT} output tokens, Poisson; MTP: K=3, p=0.7). "
            "Cells: layout @ chunk budget: TTFT p99 (ITL p99 / ITL max: the longest stall a stream saw)."), "",
           "**Which layout gives the lowest p99 TTFT at a required ITL** (p99 ITL at most the target)", "",
           f"| GPUs | traffic | MTP | {targets} | no ITL target |",
           "|---|---|---|" + "---|" * (len(ITL_TARGETS_MS) + 1)]
    for label, rs in scenarios(runs):
        out.append(f"| {label} | " + " | ".join(cell(best(rs, t)) for t in (*ITL_TARGETS_MS, None)) + " |")
    most = max(x["gpus"] for x in runs)
    out += ["", (f"**What chunk budget to pass** (`--max-num-batched-tokens`): TTFT p99 (ITL p99 / max) of each layout "
                 f"at each budget, loaded traffic, {most} GPUs"), "",
            "| layout | MTP | " + " | ".join(f"{b // 1024}k" for b in BUDGETS) + " |",
            "|---|---|" + "---|" * len(BUDGETS)]
    loaded = [r for r in runs if r["load"] == "loaded" and r["gpus"] == most]
    for name, mtp in itertools.product(dict.fromkeys(r["layout"] for r in loaded), (0, MTP)):
        rs = {r["budget"]: r for r in loaded if r["layout"] == name and r["mtp"] == mtp}
        cells = [f"{rs[b]['ttft']['p99']:.2f} s ({rs[b]['itl']['p99'] * 1e3:.0f} / {rs[b]['itl']['max'] * 1e3:.0f} ms)"
                 if rs[b]["fits"] else "no fit" for b in BUDGETS]
        out.append(f"| {name} | {'K=3' if mtp else 'off'} | " + " | ".join(cells) + " |")
    kinds = {"pcp (pcpN, dp replicas of it)": lambda r: r["layout"].startswith("pcp"),
             "tp (tpN, dp replicas of it)": lambda r: r["layout"].startswith("tp") and "pcp" not in r["layout"],
             "dp (pcp=1 replicas)": lambda r: r["layout"].startswith("dp") or r["layout"] == "pcp1",
             "tp x pcp": lambda r: "tp" in r["layout"] and "pcp" in r["layout"]}
    out += ["", (f"**Where pcp beats tp and data-parallel replicas**: the best of each family by TTFT p99 with ITL "
                 f"p99 <= {ITL_TARGETS_MS[-1]} ms (any budget)"), "",
            "| GPUs | traffic | MTP | " + " | ".join(kinds) + " | best |", "|---|---|---|" + "---|" * (len(kinds) + 1)]
    for label, rs in scenarios(runs):
        picks = {k: best(rs, ITL_TARGETS_MS[-1], f) for k, f in kinds.items()}
        winner = min((k for k, r in picks.items() if r), key=lambda k: picks[k]["ttft"]["p99"], default="none")
        out.append(f"| {label} | " + " | ".join(cell(r) for r in picks.values()) + f" | {winner.split(' (')[0]} |")
    return out


def plot(runs, path: str) -> None:
    gpus = max(r["gpus"] for r in runs)
    names = ("pcp8", "tp8", "dp8", "tp2-pcp4", "pcp4-dp2", "pcp2-dp4")

    def draw(ax):
        import matplotlib.pyplot as plt

        for (i, name), mtp in itertools.product(enumerate(names), (0, MTP)):
            picks = [best([r for r in runs if (r["gpus"], r["layout"], r["mtp"], r["load"]) == (gpus, name, mtp, load)])
                     for load in RATES_PER_GPU]  # each load at the layout's best budget
            pts = sorted((r["rate"], r["ttft"]["p99"]) for r in picks if r)
            if pts:
                ax.plot(*zip(*pts), marker="o", linestyle="-" if not mtp else "--", color=plt.get_cmap("tab10")(i),
                        label=f"{name}{' MTP' if mtp else ''}")
        ax.set_yscale("log")
        ax.set_xlabel("requests/s (16k-128k-token prompts, 256 output tokens)")
        ax.set_ylabel("TTFT p99 (s), best budget, predicted")
        ax.set_title(f"{gpus} x H200, serve_sim (predicted)")
        ax.grid(alpha=0.3)
    save_figure(path, draw, fontsize=6, ncol=2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", type=int, nargs="+", default=[8])
    ap.add_argument("--report-only", action="store_true", help="the tables again from DIR/grid.json")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = json.loads((out / "grid.json").read_text()) if args.report_only else grid(args.gpus, out)
    text = "\n".join(tables(runs))
    command = "$ python benchmarks/serve_sim_answers.py " + " ".join(sys.argv[1:])
    if args.report_only:  # the command that ran the grid
        command = (out / "answers.md").read_text().splitlines()[0]
    (out / "answers.md").write_text(f"{command}\n\n{text}\n")
    plot(runs, str(out / "answers.png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
