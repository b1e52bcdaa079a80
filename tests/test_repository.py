# SPDX-License-Identifier: Apache-2.0
"""The tree's conventions, as vLLM's tree keeps them: every Python file opens with its SPDX licence line,
and ``tests/`` and ``benchmarks/`` import nothing of each other (what both drive lives in ``harness/``).
``ruff check .`` (the configuration in pyproject.toml) runs beside the tests in ``.ci/run``."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPDX = "# SPDX-License-Identifier: Apache-2.0"


def _python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    return [REPO / f for f in listed if (REPO / f).exists()]


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_python_file_opens_with_its_licence_line():
    missing = [str(p.relative_to(REPO)) for p in _python_files()
               if SPDX not in p.read_text(encoding="utf-8").splitlines()[:2]]
    assert not missing, missing


def test_tests_and_benchmarks_import_nothing_of_each_other():
    crossing = [(str(p.relative_to(REPO)), other) for p in _python_files()
                for top, other in (("tests", "benchmarks"), ("benchmarks", "tests"))
                if p.relative_to(REPO).parts[0] == top and other in _imported_packages(p)]
    assert not crossing, crossing
