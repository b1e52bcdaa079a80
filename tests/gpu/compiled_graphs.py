# SPDX-License-Identifier: Apache-2.0
"""What two compiled engines compiled, lined up: where compiled pcp=2 departs from compiled pcp=1.

Each engine runs with caches of its own (``VLLM_CACHE_ROOT``), so afterwards its folder holds what vLLM and
Inductor made of the model: per rank and compiled piece the graph Dynamo traced (``computation_graph.py``),
and the code Inductor generated, one file per Triton kernel (named by a hash of its source). Rank 0's
graphs are compared line by line (comments aside); the kernels by name (the name says which ops a kernel
fuses) and source.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import tempfile
from pathlib import Path

KERNEL = re.compile(r"^def (triton_\w+)\(", re.M)


def run(jobs: dict) -> dict:
    """jobs: {name: spec} of engines to run one after another, each with its own caches -> their roots."""
    from . import e2e

    shared = e2e.shared_gpu_mode(2)
    roots = {}
    for name, spec in jobs.items():
        root = Path(tempfile.mkdtemp(prefix=f"qwen36_pcp_graphs_{name}_"))
        os.environ["VLLM_CACHE_ROOT"] = str(root)  # the engine's child inherits it
        try:
            e2e.engine(e2e.on_shared_gpu(spec) if shared else spec, name=f"graphs_{name}")
        finally:
            del os.environ["VLLM_CACHE_ROOT"]
        roots[name] = root
    return roots


def pieces(root: Path) -> dict[str, Path]:
    """Rank 0's compiled pieces under a cache root: {"<model prefix>": its folder}."""
    found = {}
    for graph in root.rglob("rank_0_0/*/computation_graph.py"):
        found[graph.parent.name] = graph.parent
    return found


def graph_lines(path: Path) -> list[str]:
    """A traced graph's code without its comments (the source lines each node came from, whose paths
    differ between vLLM's layers and their PCP subclasses)."""
    return [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]


def kernels(folder: Path) -> dict[str, str]:
    """The Triton kernels Inductor generated under ``folder``: {kernel name: digest of its source}."""
    out = {}
    for path in folder.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "@triton.jit" not in text:
            continue
        for name in KERNEL.findall(text):
            out[name] = hashlib.sha256(text.encode()).hexdigest()[:12]
    return out


def compare(a: Path, b: Path, max_lines: int = 200) -> dict:
    """Two engines' cache roots compared piece by piece (rank 0)."""
    pa, pb = pieces(a), pieces(b)
    report = {"pieces": {"a": sorted(pa), "b": sorted(pb)}}
    for prefix in sorted(set(pa) & set(pb)):
        ga, gb = (graph_lines(p[prefix] / "computation_graph.py") for p in (pa, pb))
        diff = list(difflib.unified_diff(ga, gb, "a", "b", n=1, lineterm=""))
        report[prefix] = {"graph_lines": [len(ga), len(gb)], "graph_diff_lines": len(diff),
                          "graph_diff": diff[:max_lines]}
    ka, kb = kernels(a), kernels(b)  # every rank's and piece's: one Inductor cache per rank
    report["kernels"] = {"count": [len(ka), len(kb)], "only_a": sorted(set(ka) - set(kb)),
                         "only_b": sorted(set(kb) - set(ka)),
                         "source_differs": sorted(k for k in set(ka) & set(kb) if ka[k] != kb[k])}
    return report
