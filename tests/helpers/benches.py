"""Benches (``bench/*.py``) from a test: run as their user would, or imported."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.cli import env
from tests.helpers.paths import ROOT

BENCH_TIMEOUT_S = 780
"""How long a bench run by a test may take: under pytest's 900 s, room to stop it and look."""


def run_bench(script: Path, *args: str) -> tuple[int, str, str]:
    """``python SCRIPT ARGS`` (a bench) from the repository root: its exit code, stdout and
    stderr; past :data:`BENCH_TIMEOUT_S` it is stopped with SIGTERM (a bench then stops its
    runs and services and removes its folder) and the test fails."""
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        out, err = proc.communicate(timeout=BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        pytest.fail(f"{script.name} took over {BENCH_TIMEOUT_S} s:\n{err[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err


def load_bench(name: str) -> ModuleType:
    """``bench/NAME.py`` imported as the module ``NAME`` (the benches import their siblings
    by those names)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
