"""A run with its own embedded services, from outside and after it finished: ``streamrft
runs`` finds its broker while it runs (no config, no --bootstrap); it keeps its samples in
its folder; ``export --run-id`` takes its local checkpoint once its services are gone;
its id alone does not start it again over its summary; ``--resume`` trains it further and
keeps the earlier summary."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from safetensors.torch import load_file

from streamrft.app.watch.samples_log import KEEP_PER_EXPLORER, read_samples
from tests.helpers.cli import env, run_argv, run_ok, start_piped, streamrft_cmd
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.e2e

SETTINGS = ("eval.interval=0", "trainer.warmup_sft_steps=0", "explorer.samples_per_step=2")


def _listed(run_id: str, cwd) -> dict | None:
    """The row of ``run_id`` in ``streamrft runs --json`` run in ``cwd`` (None: not there)."""
    proc = subprocess.run(
        streamrft_cmd("runs", "--json"), env=env(), capture_output=True, text=True, cwd=cwd
    )
    if proc.returncode != 0:
        return None
    return next((r for r in json.loads(proc.stdout) if r["run"] == run_id), None)


def test_a_finished_run_is_found_exported_and_not_overwritten(tmp_path):
    runs = tmp_path / "runs"  # run.dir "runs" under the working folder: runs' default
    run_id = f"done-{os.getpid()}-{int(time.time())}"
    first = start_piped(run_argv(EXAMPLE, run_id, 2, runs, None, *SETTINGS), tmp_path)
    row = None
    try:
        while row is None and first.poll() is None:  # until listed, or the run ended
            row = _listed(run_id, tmp_path)
        _, err = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err[-3000:]
    assert row is not None, "never listed by `streamrft runs` while it ran"
    assert row["state"] in ("new", "active", "stopped") and row["broker"].startswith("127.0.0.1:")

    folder = runs / run_id
    summary = folder / "summary.json"
    first_summary = summary.read_bytes()
    assert json.loads(first_summary)["steps"] == 2
    samples = read_samples(folder / "samples.jsonl")
    assert samples and {s.explorer for s in samples} == {"explorer-0"}
    assert len(samples) <= KEEP_PER_EXPLORER and all(s.parts for s in samples)

    # its services are gone: the checkpoint in its folder, the network left alone
    out = tmp_path / "model"
    export = run_ok(
        streamrft_cmd(
            "export", str(EXAMPLE), "--run-id", run_id, "-o", f"run.dir={runs}", "--out", str(out)
        ),
        tmp_path,
    )
    ckpt = folder / "checkpoints" / "step_00000002"
    assert f"exported {ckpt} to {out}" in export.stdout
    assert "its embedded broker and object store stopped with it" in export.stderr
    assert "Retrying" not in export.stderr and "Max retries" not in export.stderr
    trained, exported = (
        load_file(str(ckpt / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    shared = sorted(set(trained) & set(exported))
    assert len(shared) >= 4, (list(trained)[:4], list(exported)[:4])
    for name in shared:
        assert (trained[name] == exported[name]).all(), name

    # its id alone: refused, its summary as it was
    again = subprocess.run(
        run_argv(EXAMPLE, run_id, 2, runs, None, *SETTINGS),
        env=env(), capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert again.returncode == 2, again.stderr[-2000:]
    assert f"run {run_id} finished" in again.stderr and "--resume" in again.stderr
    assert summary.read_bytes() == first_summary

    # --resume with a step to go: trained on from its checkpoint, the first summary kept
    run_ok([*run_argv(EXAMPLE, run_id, 3, runs, None, *SETTINGS), "--resume"], tmp_path)
    assert json.loads(summary.read_text())["steps"] == 3
    assert (folder / "summary.1.json").read_bytes() == first_summary
    trainer_log = (folder / "logs" / "trainer.log").read_text()
    assert (
        f"resumed from {ckpt} at step 2" in trainer_log
        and (folder / "checkpoints" / "step_00000003").is_dir()
    )
