"""The checks: ruff and mypy find nothing in migrt/ (configured in pyproject.toml, pinned in the test
extras). `sh scripts/test.sh` runs them with the tests, so CI does; CONTRIBUTING.md says how to run
them alone."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # the venv's own tools (sys.executable -m), in the repository root so pyproject.toml is read
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    r = _run("ruff", "check", "--no-cache", "migrt")
    if r.returncode != 0:
        pytest.fail(f"ruff check migrt (exit {r.returncode}):\n{r.stdout}{r.stderr}", pytrace=False)


def test_mypy_finds_nothing():
    # the paths are pyproject's [tool.mypy] files; the cache goes under .mypy_cache (git-ignored)
    r = _run("mypy")
    if r.returncode != 0:
        pytest.fail(f"mypy (exit {r.returncode}):\n{r.stdout}{r.stderr}", pytrace=False)
