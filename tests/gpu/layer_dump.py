# SPDX-License-Identifier: Apache-2.0
"""Per-module activations of chosen rows of an engine step, to find where pcp=2 departs from pcp=1.

An engine built with ``worker_cls="tests.gpu.layer_dump.DumpingWorker"`` (ranks on GPU 0, see
``shared_gpu``) and ``QWEN36_PCP_DUMP="DIR;STEP:LO:HI[,STEP:LO:HI...]"`` saves, for each listed step
(1 = the first step with scheduled tokens), the input and output of every module under
``model.layers`` for the batch rows LO..HI-1 (runner layout; at pcp > 1 the primary copies of those
rows, wherever they are computed) to ``DIR/step{STEP}_pcp{N}_rank{R}.pt``. ``compare`` lines the
pcp=2 rows up with pcp=1's, module by module in execution order.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from harness.shared_gpu import SharedGPUWorker

ENV = "QWEN36_PCP_DUMP"


def _parse(spec: str):
    out_dir, _, ranges = spec.partition(";")
    steps = {}
    for item in filter(None, ranges.split(",")):
        step, lo, hi = map(int, item.split(":"))
        steps[step] = (lo, hi)
    return out_dir, steps


class LayerDump:
    def __init__(self, model: torch.nn.Module, rank: int, world_size: int, spec: str):
        self.out_dir, self.steps = _parse(spec)
        self.rank, self.world_size = rank, world_size
        self.step, self.active = 0, False
        for name, module in model.named_modules():
            if name.startswith("model.layers.") or name in ("model.embed_tokens", "model.norm"):
                module.register_forward_pre_hook(self._hook(name, "in"))
                module.register_forward_hook(self._hook(name, "out"))

    def begin_step(self, num_scheduled: int) -> None:
        if num_scheduled <= 0:
            return
        self.step += 1
        self.active = self.step in self.steps
        self.records, self.order, self.full = {}, [], None

    def end_step(self) -> None:
        if not self.active:
            return
        self.active = False
        os.makedirs(self.out_dir, exist_ok=True)
        torch.save({"full": self.full, "order": self.order, "t": self.records},
                   os.path.join(self.out_dir, f"step{self.step}_pcp{self.world_size}_rank{self.rank}.pt"))

    def _rows(self, n: int):
        """(local rows to keep, their batch rows) for tensors of n rows, or None."""
        from qwen36_pcp.layers.context import current_pcp_context

        lo, hi = self.steps[self.step]
        ctx = current_pcp_context()
        if ctx is not None:
            plan = ctx.plan
            full, keep = plan.local_full_idx[plan.rank], plan.primary[plan.rank]
        else:
            full = np.arange(n)
            keep = np.ones(n, dtype=bool)
        if len(full) != n:
            return None
        sel = np.flatnonzero(keep & (full >= lo) & (full < hi))
        return sel, full[sel]

    def _hook(self, name, kind):
        def hook(module, args, output=None):
            if not self.active:
                return
            x = (args[0] if args else None) if kind == "in" else output
            if isinstance(x, (tuple, list)):
                x = x[0] if x else None
            if not isinstance(x, torch.Tensor) or x.dim() == 0:
                return
            rows = self._rows(x.shape[0])
            if rows is None:
                return
            sel, full = rows
            if self.full is None:
                self.full = full
            elif not np.array_equal(self.full, full):
                return
            key = f"{name}:{kind}"
            while key in self.records:
                key += "'"
            self.records[key] = x[torch.from_numpy(sel).to(x.device)].detach().cpu().clone()
            self.order.append(key)
        return hook


class DumpingWorker(SharedGPUWorker):
    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        self._dump = None
        spec = os.environ.get(ENV)
        if spec:
            pcp = self.parallel_config.prefill_context_parallel_size
            self._dump = LayerDump(self.model_runner.get_model(), self.rank, pcp, spec)

    def execute_model(self, scheduler_output):
        if self._dump is not None:
            self._dump.begin_step(scheduler_output.total_num_scheduled_tokens)
        try:
            return super().execute_model(scheduler_output)
        finally:
            if self._dump is not None:
                self._dump.end_step()


def compare(out_dir: str, step: int, world_size: int = 2, limit: int = 400) -> list[dict]:
    """Module by module (pcp=1's execution order): rows whose pcp=N value differs from pcp=1's."""
    ref = torch.load(os.path.join(out_dir, f"step{step}_pcp1_rank0.pt"), weights_only=False)
    parts = [torch.load(os.path.join(out_dir, f"step{step}_pcp{world_size}_rank{r}.pt"), weights_only=False)
             for r in range(world_size)]
    pos = {int(f): i for i, f in enumerate(ref["full"])}
    lines = []
    for key in ref["order"]:
        if not all(key in p["t"] for p in parts):
            lines.append({"module": key, "missing_at_pcp": True})
            continue
        diffs, rows = [], []
        for p in parts:
            idx = [pos[int(f)] for f in p["full"]]
            a, b = ref["t"][key][idx].float(), p["t"][key].float()
            if a.shape != b.shape:
                lines.append({"module": key, "shapes": [list(a.shape), list(b.shape)]})
                break
            diffs.append((a - b).abs().reshape(len(idx), -1).amax(dim=1))
            rows.append(np.asarray(p["full"]))
        else:
            d, f = torch.cat(diffs), np.concatenate(rows)
            bad = np.flatnonzero(d.numpy() > 0)
            lines.append({"module": key, "rows": len(f), "differ": len(bad), "max": float(d.max()),
                          "first_rows": sorted(int(f[i]) for i in bad)[:8]})
        if len(lines) >= limit:
            break
    return lines
