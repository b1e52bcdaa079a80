# SPDX-License-Identifier: Apache-2.0
"""The README's commands that need no GPU, run exactly as written (parsed from its code blocks, so a
README change that breaks one fails here).

* ``python -m qwen36_pcp doctor ...``: every problem it finds is that there is no GPU (GPUs faked
  absent, on any machine); run through the same ``main`` in a process of its own.
* ``python -m qwen36_pcp.tools.make_checkpoint OUT_DIR ...``: its arguments, with OUT_DIR a folder of the
  test and ``--config-only`` (writing random weights takes seconds; ``test_make_checkpoint.py`` does).
* What starts an engine (``python examples/offline_generate.py``, ``bash examples/serve.sh``, ``vllm
  serve``), on a machine without an NVIDIA GPU: refused with one line from the plugin, last on stderr,
  no traceback, exit code 1, and nothing written to the /tmp paths the command names.

Not run: the install, the test suite itself, what needs a running server (``curl``,
``examples/client.py``: ``tests/test_client.py``), and commands with a placeholder (MODEL). A command
this test does not know fails it, so that a new one is sorted into one of these.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_refusals import run_doctor

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def readme_commands(text: str) -> list[tuple[str, list[str]]]:
    """(the command as written, its words) of every command in README.md's shell code blocks, read as the
    shell reads them: a line continues after a backslash or inside a quote; comments and a trailing
    ``&`` dropped."""
    commands = []
    for block in re.findall(r"^```(?:bash|sh|shell|console)?[ \t]*\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        pending = ""
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            pending += ("\n" if pending else "") + (line if pending else line.strip().removeprefix("$ "))
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:  # an open quote: the command goes on
                continue
            if words and words[-1] == "&":
                words = words[:-1]
            if words:
                commands.append((pending, words))
            pending = ""
        assert not pending, f"README: a command that never ends: {pending!r}"
    return commands


def kind(words: list[str]) -> str:
    """How this test treats a README command."""
    if any(re.fullmatch(r"[A-Z][A-Z0-9_]*", w) for w in words):
        return "placeholder"
    if words[:2] == ["pip", "install"] or words[:3] == ["python", "-m", "pytest"]:
        return "install or suite"
    if words[0] == "curl" or words[:2] == ["python", "examples/client.py"]:
        return "needs a server"
    if words[:4] == ["python", "-m", "qwen36_pcp", "doctor"]:
        return "doctor"
    if words[:3] == ["python", "-m", "qwen36_pcp.tools.make_checkpoint"]:
        return "checkpoint"
    if words[:2] in (["python", "examples/offline_generate.py"], ["bash", "examples/serve.sh"], ["vllm", "serve"]):
        return "engine"
    return "unknown"


COMMANDS = readme_commands(README.read_text(encoding="utf-8"))
KINDS = {line: kind(words) for line, words in COMMANDS}
WORDS = dict(COMMANDS)


def test_every_readme_command_is_sorted():
    unknown = [line for line, k in KINDS.items() if k == "unknown"]
    assert not unknown, f"README commands this test does not know (sort them in kind()): {unknown}"
    assert "engine" in KINDS.values(), KINDS  # the parser still finds the quick start


def test_doctor_commands(fake_cuda_ranks):
    lines_of = [line for line, k in KINDS.items() if k == "doctor"]
    if not lines_of:
        return
    for line, (rc, lines) in zip(lines_of, fake_cuda_ranks.isolated(run_doctor, [WORDS[x][4:] for x in lines_of], [])):
        problems = [s for s in lines if s.startswith("PROBLEM")]
        assert rc == 1 and problems and all(s.startswith("PROBLEM no GPU visible") for s in problems), (line, lines)


def test_checkpoint_commands(tmp_path):
    from qwen36_pcp.tools import make_checkpoint

    for n, line in enumerate(line for line, k in KINDS.items() if k == "checkpoint"):
        argv = list(WORDS[line][3:])
        assert not argv[0].startswith("-"), f"README: put OUT_DIR first in {line!r}"
        argv[0] = str(tmp_path / f"ckpt{n}")  # the test's folder for OUT_DIR
        argv += [] if "--config-only" in argv else ["--config-only"]  # its weights: test_make_checkpoint.py
        assert make_checkpoint.main(argv) == 0, line
        assert (tmp_path / f"ckpt{n}" / "config.json").is_file(), line


def _nvidia_gpus() -> int:
    from vllm.utils.import_utils import import_pynvml

    try:
        nvml = import_pynvml()
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: no GPU
        return 0
    try:
        return nvml.nvmlDeviceGetCount()
    finally:
        nvml.nvmlShutdown()


def _state(path: str):
    p = Path(path)
    return (p.exists(), p.stat().st_mtime_ns if p.exists() else None,
            sorted(x.name for x in p.iterdir()) if p.is_dir() else None)


def test_engine_commands_refuse_in_one_line_without_a_gpu():
    engine = [line for line, k in KINDS.items() if k == "engine"]
    if _nvidia_gpus():
        pytest.skip("an NVIDIA GPU is here: these commands would start an engine")
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # never a download, whatever happens
    env.pop("VLLM_LOGGING_LEVEL", None)
    paths = sorted({p for line in engine for p in re.findall(r"/tmp/[\w.+-]+", line)} | {"/tmp/qwen36-tiny"})
    before = {p: _state(p) for p in paths}
    procs = {}
    for line in engine:  # at once: each pays vLLM's import
        words = WORDS[line]
        exe = {"python": sys.executable, "vllm": shutil.which("vllm", path=env["PATH"]), "bash": "bash"}[words[0]]
        procs[line] = subprocess.Popen([exe, *words[1:]], cwd=REPO, env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        last = err.strip().splitlines()[-1] if err.strip() else ""
        assert proc.returncode == 1, (line, proc.returncode, out, err)
        assert "Traceback" not in out + err, (line, err)
        assert last.startswith("qwen36_pcp: ") and "NVIDIA GPU" in last, (line, err)
        assert sum(s.startswith("qwen36_pcp") for s in err.splitlines()) == 1, (line, err)
        if "examples/" in line:  # they check before vLLM starts: nothing else is said
            assert out == "" and err.strip() == last, (line, out, err)
    assert {p: _state(p) for p in paths} == before  # nothing written where the commands point
