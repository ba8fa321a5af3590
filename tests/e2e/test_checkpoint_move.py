"""Checkpoints in the store: a run trained on "host A" (its own run folder) leaves its
checkpoints in the object store; the same run started on "host B" (another run folder,
nothing copied) fetches the newest one, resumes at its step and trains on, nothing trained
twice; a third exports it with the run id and the broker alone."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cli import env, run_argv, run_ok, streamrft_cmd
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.e2e

FAST = (
    "eval.interval=0",
    "trainer.save_interval=2",
    "trainer.warmup_sft_steps=0",
    "trainer.batch_size=8",
    "explorer.batch_size=8",
)


def test_a_trainer_on_another_host_resumes_from_the_stores_checkpoint(services, tmp_path):
    run_id = f"moved-{tmp_path.name[-10:]}"
    host_a, host_b = tmp_path / "a" / "runs", tmp_path / "b" / "runs"
    run_ok(run_argv(EXAMPLE, run_id, 4, host_a, services, *FAST), tmp_path)
    trainer_a = (host_a / run_id / "logs" / "trainer.log").read_text()
    assert "checkpoint step_00000004 in the store" in trainer_a

    summary = tmp_path / "b.json"
    run_ok(run_argv(EXAMPLE, run_id, 6, host_b, services, *FAST, summary=summary), tmp_path)
    trainer_b = (host_b / run_id / "logs" / "trainer.log").read_text()
    assert "checkpoint step_00000004 fetched from the store" in trainer_b
    assert "resumed from" in trainer_b and "at step 4" in trainer_b
    assert "trainer: step 5 " in trainer_b or "step 6" in trainer_b
    s = json.loads(summary.read_text())
    assert s["steps"] == 6 and s["books"]["trained_twice"] == 0
    local = sorted(p.name for p in (host_b / run_id / "checkpoints").glob("step_*"))
    assert local[-1] == "step_00000006" and "step_00000004" in local

    # a third host exports the run's newest checkpoint from the store: the run id, the
    # broker and the store's secret only, nothing local
    host_c = tmp_path / "c"
    (host_c / "home").mkdir(parents=True)
    out = host_c / "exported"
    proc = _on_host_c(host_c, services, "export", "--run-id", run_id, "--out", str(out))
    assert "step_00000006" in proc.stdout
    fetched = host_c / "runs" / run_id / "checkpoints" / "step_00000006" / "model.safetensors"
    exported = load_file(out / "model.safetensors")
    trained = load_file(host_b / run_id / "checkpoints" / "step_00000006" / "model.safetensors")
    assert fetched.is_file() and set(exported) <= set(trained)
    assert all(torch.equal(exported[k], trained[k]) for k in exported)  # the step-6 weights

    # and scores every checkpoint the store holds (4 and 6: those it lacked are fetched)
    _on_host_c(host_c, services, "score", "--run-id", run_id, "--checkpoint", "all", "--k", "2")
    report = json.loads((host_c / "runs" / run_id / "score.json").read_text())
    scored = [entry["step"] for entry in report["checkpoints"]]
    assert scored[-2:] == [4, 6] and all(
        0 <= e["greedy_accuracy"] <= 1 for e in report["checkpoints"]
    )
    stored = sorted(p.name for p in (host_c / "runs" / run_id / "checkpoints").glob("step_*"))
    assert stored[-2:] == ["step_00000004", "step_00000006"]


def _on_host_c(host_c, services, *args):
    """``streamrft ARGS --bootstrap BROKER`` in ``host_c``: its own HOME, the store's secret
    in its environment, nothing else of the run."""
    proc = subprocess.run(
        streamrft_cmd(*args, "--bootstrap", services.bootstrap_servers),
        env={
            **env(),
            "HOME": str(host_c / "home"),
            "STREAMRFT_S3_ACCESS_KEY": services.access_key,
            "STREAMRFT_S3_SECRET_KEY": services.secret_key,
        },
        cwd=host_c,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
