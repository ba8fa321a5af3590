"""A run in bfloat16 on the CPU: explorers hold and sample with bf16 weights, the trainer
keeps float32 master weights and computes in bf16 (autocast) with gradient checkpointing
and token-budget micro-batches, and every version goes out in bf16, as its manifest says."""

from __future__ import annotations

import asyncio
import json

import pytest

from streamrft.infra.consume import read_history
from streamrft.schemas import METRICS
from streamrft.schemas.manifest import WeightManifest
from tests.helpers.cli import run_argv, run_ok
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.e2e


def test_a_bf16_run_sends_bf16_versions_and_measures_its_mismatch(services, make_config, tmp_path):
    run_id = f"bf16-{tmp_path.name[-10:]}"
    steps, budget = 6, 200
    fs_dir = tmp_path / "versions"
    run_ok(
        run_argv(
            EXAMPLE,
            run_id,
            steps,
            tmp_path / "runs",
            services,
            "model.dtype=bfloat16",
            f"trainer.max_tokens_per_micro_batch={budget}",
            "trainer.gradient_checkpointing=true",
            "synchronizer.method=filesystem",
            f"synchronizer.fs_dir={fs_dir}",
            "synchronizer.delta=never",  # whole bf16 versions (deltas: test_delta_run.py)
            "synchronizer.sync_offset=0",  # on-policy: every token sampled with the held version
            "trainer.max_staleness=0",
            "trainer.batch_size=8",
            "explorer.batch_size=8",
            "trainer.warmup_sft_steps=10",
            "eval.interval=0",
            summary=tmp_path / "s.json",
        ),
        tmp_path,
        timeout=500,
    )
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["steps"] == steps and s["books"]["trained_twice"] == 0
    assert s["versions_rejected"] == {"explorer-0": 0}

    manifests = sorted(fs_dir.rglob("manifest.json"))
    assert len(manifests) == steps + 1  # version 0 and one per step
    for path in manifests:
        manifest = json.loads(path.read_text())
        WeightManifest(**{k: v for k, v in manifest.items() if k != "shards"})
        assert manifest["dtype"] == "bfloat16", path

    cfg = make_config(run={"id": run_id})
    metrics = asyncio.run(read_history(cfg.kafka, cfg.topics().metrics, METRICS, "bf16-metrics"))
    trained = [m.values for m in metrics if m.component == "trainer" and "train/loss" in m.values]
    assert len(trained) == steps
    for v in trained:
        # 8 groups x 8 rollouts of up to ~8 + 5 tokens: the budget splits every step
        assert v["train/micro_batches"] >= 64 * 8 // budget
        assert v["train/rollout_logprob_diff_tokens"] > 0
    # the bf16 explorer and the float32-master trainer do not compute alike, and the
    # metric shows it: well above float32's agreement (< 1e-4), well below a policy change
    worst = max(v["train/rollout_logprob_diff_max"] for v in trained)
    mean = sum(v["train/rollout_logprob_diff_mean"] for v in trained) / steps
    print(f"bf16 run: rollout/trainer log-prob diff mean {mean:.4f}, max {worst:.4f}")
    assert 1e-3 < worst < 1.0, worst
    assert mean < 0.1, mean
