"""A trainer across two hosts (``trainer.nnodes``): FSDP2 ranks on two simulated hosts
(network namespaces, ``tests/harness/hosts.py``) meet at node 0's address over gloo, an
explorer on a third host does the exploring, and every host but the first joins with the
run id and the broker only."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from streamrft.app.watch.metrics_log import read_metrics
from tests.harness.hosts import SimulatedHosts, unavailable
from tests.helpers.cli import env, run_argv, streamrft_cmd
from tests.helpers.paths import EXAMPLE
from tests.helpers.processes import log_has, wait_for

pytestmark = pytest.mark.e2e
WHY_NOT = unavailable()
RDZV_PORT = 29511  # a fresh namespace: every port of host A is free


@pytest.fixture
def hosts(tmp_path):
    if WHY_NOT:
        pytest.skip(f"simulated hosts: {WHY_NOT}")
    with SimulatedHosts(tmp_path / "hosts") as made:
        yield made


@pytest.fixture
def bridge_services(hosts, tmp_path):
    """The broker and the object store, on the bridge's address (what every host reaches)."""
    from streamrft.infra.local.services import LocalServices

    svc = LocalServices(tmp_path / "services", host=hosts.address)
    try:
        yield svc.start()
    finally:
        svc.stop()


def joiner_env(host, services) -> dict[str, str]:
    return {
        **env(),
        **host.env,
        "STREAMRFT_S3_ACCESS_KEY": services.access_key,
        "STREAMRFT_S3_SECRET_KEY": services.secret_key,
    }


def test_one_trainer_spans_two_hosts(hosts, bridge_services, tmp_path):
    a, b, c = hosts.add("host-a"), hosts.add("host-b"), hosts.add("host-c")
    run_id = f"hosts-{tmp_path.name[-10:]}"
    steps, summary = 4, tmp_path / "summary.json"
    runs = a.folder / "runs"
    argv = run_argv(
        EXAMPLE,
        run_id,
        steps,
        runs,
        bridge_services,
        "eval.interval=0",
        "run.host_id=host-a",
        "trainer.nnodes=2",
        f"trainer.rdzv={a.address}:{RDZV_PORT}",
        explorers=0,
        summary=summary,
    )
    run = subprocess.Popen(
        a.argv(argv),
        env={**env(), **a.env},
        cwd=a.folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    joined = []
    try:
        wait_for(
            lambda: log_has(runs / run_id / "logs" / "trainer.log", "defined on its control"),
            run,
            240,
            "the run's record",
        )
        join = ["--run-id", run_id, "--bootstrap", bridge_services.bootstrap_servers]
        for host, args in (
            (b, ["train", *join, "--node-rank", "1"]),
            (c, ["explore", *join, "--index", "0", "-o", "run.host_id=host-c"]),
        ):
            with (host.folder / "out.log").open("w") as out:
                joined.append(
                    subprocess.Popen(
                        host.argv(streamrft_cmd(*args)),
                        env=joiner_env(host, bridge_services),
                        cwd=host.folder,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
        _, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
        for host, proc in zip((b, c), joined, strict=True):
            assert proc.wait(timeout=90) == 0, (host.folder / "out.log").read_text()[-3000:]
    finally:
        for proc in (run, *joined):
            if proc.poll() is None:
                proc.kill()

    s = json.loads(summary.read_text())
    assert s["steps"] == steps and s["books"]["trained_twice"] == 0
    assert s["groups_trained"] == steps * 32  # every group from the explorer on host C
    assert s["eval_accuracy_last"] > s["eval_accuracy_first"]  # it learned (0.81 -> 0.98)
    node_a = (runs / run_id / "logs" / "trainer.log").read_text()
    node_b = (b.folder / "out.log").read_text()
    # each node's ranks talk from the address their host has on the bridge
    assert f"trainer node 0 of 2: ranks talk from {a.address}" in node_a
    assert f"trainer node 1 of 2: ranks talk from {b.address}" in node_b
    assert "Traceback" not in node_b
    # the steps were FSDP2's over two ranks, and trained: finite losses, every step
    trained = [
        e.values
        for e in read_metrics(runs / run_id / "metrics.jsonl")
        if e.component == "trainer" and "train/loss" in e.values
    ]
    assert len(trained) == steps and all(math.isfinite(v["train/loss"]) for v in trained)
    # no host but A holds a run folder: B and C were given the run id and the broker only
    assert not (b.folder / "runs").exists() and not (c.folder / "runs").exists()
