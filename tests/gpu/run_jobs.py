"""Run some of a test module's engine jobs (by name suffix) and save their results under $OUT.

    python -m tests.gpu.run_jobs tests.gpu.test_pcp_e2e _pcp1 _pcp2

For a short machine session: e.g. pcp=1 and pcp=2 only, to see whether pcp=2 gives pcp=1's answers
before spending the time on the tp=2 yardstick. QWEN36_PCP_REUSE applies as in ``e2e.engines``.
"""

from __future__ import annotations

import importlib
import sys

import torch

from . import e2e


def main(argv):
    module, suffixes = importlib.import_module(argv[0]), tuple(argv[1:])
    jobs = {k: v for k, v in e2e.module_jobs(module, torch.cuda.device_count()).items()
            if k.endswith(suffixes)}
    results = e2e.engines(jobs)
    failed = {k: r for k, r in results.items() if isinstance(r, BaseException)}
    for name, err in failed.items():
        print(f"[jobs] {name} failed: {str(err)[-2000:]}", flush=True)
    print(f"[jobs] {len(jobs) - len(failed)} of {len(jobs)} saved under {e2e.out_dir()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
