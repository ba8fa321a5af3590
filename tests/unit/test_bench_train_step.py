"""``bench/train_step.py`` at tiny sizes: the final JSON line has its figures, and the
framework's step and the bench's plain PyTorch loop train the same weights (same math)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[2] / "bench" / "train_step.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_train_step", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_train_step_bench_reports_and_both_paths_train_the_same_weights(capsys):
    bench = load_bench()
    argv = ["--groups", "3", "--repeat", "4", "--response-len", "6", "--hidden", "32"]
    assert bench.main([*argv, "--steps", "2", "--warmup-steps", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert result["bench"] == "train_step"
    for key in ("tokens_s", "plain_tokens_s", "ratio_vs_plain"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert (result["groups"], result["repeat"], result["steps"]) == (3, 4, 2)
    # the recorded log-probs are the initial model's: the first ratio is exactly 1
    assert result["first_logprob_diff"] < 1e-5
    # one step, then three, of the framework and of the plain loop: the same weights
    assert result["max_weight_diff"] < 1e-5
    assert result["final_weight_diff"] < 1e-4


def test_plain_loop_diverges_when_its_math_differs(capsys, monkeypatch):
    """The weight check would catch a different loss: a plain loop clipping at 0.1, not
    the config's 0.2, ends elsewhere."""
    bench = load_bench()
    init = bench.PlainTrainer.__init__

    def clip_tighter(self, cfg, state):
        init(self, cfg, state)
        self.clip = 0.1

    monkeypatch.setattr(bench.PlainTrainer, "__init__", clip_tighter)
    argv = ["--groups", "3", "--repeat", "4", "--response-len", "6", "--hidden", "32"]
    assert bench.main([*argv, "--steps", "1", "--warmup-steps", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["max_weight_diff"] > 1e-5
