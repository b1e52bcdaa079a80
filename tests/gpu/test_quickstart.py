# SPDX-License-Identifier: Apache-2.0
"""The README's quick start, command by command, as a user runs it.

    python -m pytest -q -s tests/gpu/test_quickstart.py    # one GPU is enough (shared-GPU worker)

The commands are read from the README's "Quick start" block, so the test runs what the README says:
offline generation at pcp=2 on a tiny checkpoint it makes, ``vllm serve`` at pcp=2 in the background,
and the client, which waits for the server. On a machine with fewer GPUs than ranks the two engine
commands get the shared-GPU arguments appended (every rank on GPU 0, collectives through host memory:
``offline_generate.py --llm-kwargs``, further ``serve.sh`` arguments); nothing else changes. Every
command is bounded by a timeout and the server is stopped at the end.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import e2e

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

RANKS = 2
STEP_TIMEOUT_S = 480


def readme_commands() -> list[str]:
    """The quick start's shell commands, comments stripped, in order."""
    text = (e2e.REPO / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def _shared_args(command: str) -> list[str]:
    """What a one-GPU machine appends to a quick-start engine command (nothing to the client)."""
    shared = e2e.on_shared_gpu({"llm": {}})["llm"]
    if "offline_generate.py" in command:
        return ["--llm-kwargs", json.dumps(shared)]
    if "serve.sh" in command:
        return e2e.cli_flags(shared)
    return []


def _vllm_scripts() -> list[str]:
    """Where vLLM's ``vllm`` command is when vLLM was installed beside the interpreter rather than into
    it (``pip install --target DIR``: the command in ``DIR/bin``), so that ``serve.sh`` finds it."""
    import vllm

    scripts = Path(vllm.__file__).resolve().parents[1] / "bin"
    return [str(scripts)] if (scripts / "vllm").exists() else []


def _quickstart(gpus: str) -> dict:
    commands = readme_commands()
    shared = len(gpus.split(",")) < RANKS
    # the shared-GPU worker class is imported from this repository by every worker
    env = e2e.child_env(gpus, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
                        PATH=os.pathsep.join([str(Path(sys.executable).parent), *_vllm_scripts(),
                                              os.environ.get("PATH", "")]),
                        PYTHONPATH=os.pathsep.join([str(e2e.REPO), os.environ.get("PYTHONPATH", "")]))
    steps = []
    server = None
    try:
        for i, command in enumerate(commands):
            background = command.endswith("&")
            argv = shlex.split(command.rstrip("&").strip()) + (_shared_args(command) if shared else [])
            argv = [sys.executable if a == "python" else a for a in argv]
            log_path = e2e.out_dir() / f"quickstart_{i}.log"
            with open(log_path, "w") as log:
                proc = subprocess.Popen(argv, cwd=e2e.REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
            if background:
                server = proc
                steps.append({"command": command, "argv": argv, "background": True})
                continue
            try:
                proc.wait(timeout=STEP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                e2e._kill_group(proc, dump=True)
            steps.append({"command": command, "argv": argv, "exit_code": proc.returncode,
                          "output": log_path.read_text()[-3000:],
                          # the client's answers came from this server, not from another one on its port
                          "server_running": server is not None and server.poll() is None})
            if proc.returncode != 0:
                break
    finally:
        if server is not None:
            e2e.stop_group(server)
    result = {"shared_gpu": shared, "steps": steps}
    e2e.save("quickstart", result)
    return result


@pytest.mark.engine_jobs(builder=lambda: {"quickstart": (_quickstart, RANKS)})
def test_readme_quick_start_runs_as_written(engine_pool):
    result = e2e.result(engine_pool, "quickstart")
    steps = result["steps"]
    for step in steps:
        print(f"[quick start] {step['command']} -> exit {step.get('exit_code', 'background')}")
    assert [s["command"] for s in steps] == readme_commands(), steps
    run = [s for s in steps if not s.get("background")]
    assert all(s["exit_code"] == 0 for s in run), run
    offline, client = run[0]["output"], run[-1]["output"]
    assert run[-1]["server_running"], "the server was not running when the client got its answers"
    answers = re.findall(r"^(\d+) prompt tokens -> (['\"])(.+)\2$", offline, re.M)
    assert len(answers) == 2 and int(answers[0][0]) > 10000, offline
    assert re.search(r"^completion: .+", client, re.M) and re.search(r"^chat: .+", client, re.M), client
