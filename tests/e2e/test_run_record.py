"""A run defined by its id and its broker: the trainer publishes the run's record (control
topic and ``<run>/run.yaml`` in the store), and an explorer started in another folder with
another ``HOME``, given only ``--run-id`` and ``--bootstrap`` (its store secret in the
environment), reads it and does all of the run's exploring."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess

import msgspec
import pytest
import yaml

from streamrft.infra.consume import read_history
from streamrft.infra.run_record import fingerprint
from streamrft.schemas import CONTROL, RunDefined
from tests.helpers.cli import env, run_argv, start_piped, streamrft_cmd
from tests.helpers.paths import EXAMPLE
from tests.helpers.processes import log_has, wait_for

pytestmark = pytest.mark.e2e


def test_an_explorer_elsewhere_joins_with_the_run_id_and_the_broker_only(
    services, make_config, tmp_path
):
    run_id = f"record-{tmp_path.name[-10:]}"
    runs = tmp_path / "host-a" / "runs"
    runs.mkdir(parents=True)
    steps = 4
    summary = tmp_path / "s.json"
    argv = run_argv(EXAMPLE, run_id, steps, runs, services, "eval.interval=0", explorers=0)
    run = start_piped([*argv, "--summary", str(summary)], runs.parent)
    elsewhere = tmp_path / "host-b"
    (elsewhere / "home").mkdir(parents=True)
    joiner_env = {
        **env(),
        "HOME": str(elsewhere / "home"),
        "STREAMRFT_S3_ACCESS_KEY": services.access_key,
        "STREAMRFT_S3_SECRET_KEY": services.secret_key,
    }
    hand = None
    try:
        trainer_log = runs / run_id / "logs" / "trainer.log"
        wait_for(
            lambda: log_has(trainer_log, "defined on its control topic"), run, 240, "the record"
        )
        join = streamrft_cmd(
            "explore", "--run-id", run_id, "--bootstrap", services.bootstrap_servers, "--index", "0"
        )
        with (tmp_path / "hand.log").open("w") as out:
            hand = subprocess.Popen(
                join, env=joiner_env, stdout=out, stderr=subprocess.STDOUT, cwd=elsewhere
            )
        _, err = run.communicate(timeout=500)
        assert run.returncode == 0, err[-3000:]
        assert hand.wait(timeout=60) == 0, (tmp_path / "hand.log").read_text()[-3000:]
    finally:
        for p in (run, hand):
            if p is not None and p.poll() is None:
                p.kill()
    said = (tmp_path / "hand.log").read_text()
    assert f"reading run {run_id}'s definition from the broker" in said
    assert f"its definition is the trainer's record at streamrft.{run_id}.control" in said
    s = json.loads(summary.read_text())
    assert s["steps"] == steps and s["books"]["trained_twice"] == 0
    assert s["groups_trained"] == steps * 32  # every group from the joiner
    assert sorted(p.name for p in elsewhere.iterdir()) == ["home"]  # it left no run folder

    # the record: on the control topic, with the task file's fingerprint, and in the store
    cfg = make_config(run={"id": run_id})
    history = asyncio.run(read_history(cfg.kafka, cfg.topics().control, CONTROL, "record-test"))
    [record] = [ev for ev in history if isinstance(ev, RunDefined)]
    resolved = (runs / run_id / "config.yaml").read_text()
    assert record.config_yaml == resolved  # what the supervisor's children read, secrets ***
    run_cfg = yaml.safe_load(resolved)
    task_file = run_cfg["taskset"]["path"]
    assert record.fingerprints == {"taskset.path": fingerprint(task_file)}
    from streamrft.sync.object_store import S3Store

    bucket = run_cfg["object_store"]["bucket"]
    store = S3Store(msgspec.structs.replace(cfg.object_store, bucket=bucket), create_bucket=False)
    assert record.store_uri == store.uri(f"{run_id}/run.yaml")
    stored = store.get(f"{run_id}/run.yaml").decode()
    assert (
        stored.endswith(resolved)
        and f"taskset.path: {record.fingerprints['taskset.path']}" in stored
    )
    assert services.secret_key not in stored and services.secret_key not in record.config_yaml


def test_without_a_config_the_run_id_and_the_broker_are_required(tmp_path):
    proc = subprocess.run(
        streamrft_cmd("explore", "--run-id", "r"),
        env={**env(), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--run-id and --bootstrap HOST:PORT" in proc.stderr
    assert not os.listdir(tmp_path)
