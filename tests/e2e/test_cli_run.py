"""``streamrft run`` end to end on the arithmetic example: it learns, the books balance."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from streamrft.app.watch.metrics_log import read_metrics
from tests.helpers.cli import env, run_argv, run_ok, start_piped, streamrft_cmd
from tests.helpers.paths import EXAMPLE
from tests.helpers.processes import log_has, processes_mentioning, wait_for

pytestmark = pytest.mark.e2e


def test_run_learns_and_books_balance(tmp_path):
    summary_path = tmp_path / "summary.json"
    steps = 60
    run_ok(
        run_argv(
            EXAMPLE,
            None,
            steps,
            tmp_path / "runs",
            None,
            "eval.interval=20",
            # a shorter warm-up and a faster rate than the example's: room to learn in 60 steps
            "trainer.warmup_sft_steps=60",
            "trainer.lr=5e-4",
            summary=summary_path,
        ),
        tmp_path,
    )
    s = json.loads(summary_path.read_text())
    # it learned: greedy accuracy and sampled reward rose by a wide margin
    assert s["steps"] == steps
    assert s["eval_accuracy_last"] >= s["eval_accuracy_first"] + 0.15, s["eval_accuracy"]
    assert s["mean_reward_last"] >= s["mean_reward_first"] + 0.1
    # the books balance: every trained group once, none newer than the trainer's version,
    # none staler than max_staleness; everything trained was consumed, and published
    books = s["books"]
    assert books == {**books, "trained_twice": 0, "newer_than_trainer": 0, "staler_than_max": 0}
    assert s["groups_trained"] == steps * 32
    assert s["experiences_trained"] == s["groups_trained"] * 8
    assert s["experiences_published"] >= s["experiences_consumed"] >= s["experiences_trained"]
    assert s["duplicates_dropped"] == 0 and s["dead_letters"] == 0
    # weights flowed: one version per step plus version 0, applied by the explorer
    assert s["versions_published"] == steps + 1
    assert s["versions_applied"]["explorer-0"] >= steps // 2
    assert s["versions_rejected"] == {"explorer-0": 0}
    assert s["explorers_stopped"] == ["explorer-0"]
    assert s["exit_codes"] == {"trainer": 0, "explorer-0": 0, "feeder": 0}
    ckpt = Path(s["run_dir"])
    if not ckpt.is_absolute():
        ckpt = tmp_path / ckpt
    assert (ckpt / "checkpoints" / "latest").read_text() == f"step_{steps:08d}"
    assert not processes_mentioning(s["run_id"])
    # the metrics outlive the run's broker: every step of every component, and the curves
    events = read_metrics(Path(s["metrics_file"]))
    trained = [e for e in events if e.component == "trainer" and "train/loss" in e.values]
    assert sorted(e.step for e in trained) == list(range(1, steps + 1))
    assert sum(len(e.trained) for e in trained) == s["groups_trained"]
    explored = {e.step for e in events if e.component == "explorer-0"}
    assert set(range(1, steps + 1)) <= explored
    assert [e.values["eval/accuracy"] for e in events if "eval/accuracy" in e.values] == [
        acc for _, acc in s["eval_accuracy"]
    ]
    assert Path(s["curves"]).read_bytes()[:4] == b"\x89PNG"
    # and went to TensorBoard as consumed (monitor.exporters' default), every trainer step
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(ckpt / "tensorboard" / "trainer"), size_guidance={SCALARS: 0})
    acc.Reload()
    losses = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(losses) == list(range(1, steps + 1))
    sent = {e.step: e.values["train/loss"] for e in trained}
    assert losses[steps] == pytest.approx(sent[steps], rel=1e-6)


@pytest.mark.parametrize(("signame", "exit_code"), [("SIGINT", 130), ("SIGTERM", 0)])
def test_a_signal_stops_everything_cleanly(tmp_path, signame, exit_code):
    """Ctrl-C exits 130, SIGTERM (a scheduler's orderly stop) 0; either way every process
    finishes its unit of work, reports STOPPED, exits 0, and the trainer checkpoints. With
    SIGTERM the run also serves its dashboard (``--dashboard``), which stops with it."""
    runs = tmp_path / "runs"
    summary_path = tmp_path / "summary.json"
    argv = run_argv(
        EXAMPLE, None, 100000, runs, None, "trainer.warmup_sft_steps=0", summary=summary_path
    )
    proc = start_piped(argv + ["--dashboard"] * (signame == "SIGTERM"), tmp_path)
    try:
        wait_for(
            lambda: any(log_has(p, "trainer: step 10 ") for p in runs.glob("*/logs/trainer.log")),
            proc,
            180,
            "training to reach step 10",
        )
        trainer_log = next(runs.glob("*/logs/trainer.log"))
        run_id = trainer_log.parent.parent.name
        if signame == "SIGTERM":  # once is enough: follow the run from another shell
            _watch_from_another_shell(tmp_path, run_id)
            url = (runs / run_id / "dashboard.url").read_text().strip()
            with urllib.request.urlopen(url, timeout=30) as page:
                assert page.status == 200 and b"streamrft" in page.read()
        proc.send_signal(getattr(signal, signame))
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == exit_code, err[-3000:]
    s = json.loads(summary_path.read_text())
    assert s["interrupted"] is True
    assert s["signal"] == signame
    assert s["steps"] >= 10
    assert s["exit_codes"] == {"trainer": 0, "explorer-0": 0, "feeder": 0}
    assert s["explorers_stopped"] == ["explorer-0"]
    # the trainer checkpointed on its way out
    latest = (runs / run_id / "checkpoints" / "latest").read_text()
    assert int(latest.split("_")[1]) >= 10
    assert not processes_mentioning(run_id)
    if signame == "SIGTERM":  # the address was printed; the dashboard stopped with the run
        assert f"dashboard: {url}" in err
        assert not (runs / run_id / "dashboard.url").exists()
    # the console showed a short header, not the resolved config
    assert f"run {run_id}\n  services  broker 127.0.0.1:" in err
    assert "resolved config" not in err and "sync_interval" not in err
    # every trainer step up to the last is in metrics.jsonl
    steps = [
        e.step for e in read_metrics(runs / run_id / "metrics.jsonl") if "train/loss" in e.values
    ]
    assert sorted(steps) == list(range(1, s["steps"] + 1))
    if signame == "SIGTERM":  # the run's embedded broker is gone: a clear error
        late = subprocess.run(
            streamrft_cmd("status", "--run-id", run_id),
            env=env(),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        assert late.returncode == 2
        assert "no reachable broker" in late.stderr and "metrics.jsonl" in late.stderr


def _watch_from_another_shell(cwd: Path, run_id: str) -> None:
    """``status --run-id`` and ``tail --run-id KIND --where`` from a second process in the
    project folder, with no config and no --bootstrap: they find the run's own broker."""

    def cli(*args: str) -> str:
        proc = subprocess.run(
            streamrft_cmd(*args), env=env(), capture_output=True, text=True, timeout=90, cwd=cwd
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    table = cli("status", "--run-id", run_id).splitlines()
    assert table[0].startswith(f"run {run_id}: 3 components")
    assert table[1].split()[:7] == [
        "component",
        "role",
        "state",
        "step",
        "version",
        "heartbeat",
        "partitions",
    ]
    assert table[-1].startswith("defined ") and "sync auto" in table[-1]  # the run's record
    rows = {line.split()[0]: line.split() for line in table[2:-1]}
    assert set(rows) == {"trainer", "explorer-0", "feeder"}
    assert rows["trainer"][2] == "RUNNING" and int(rows["trainer"][3]) >= 1
    assert rows["explorer-0"][1] == "explorer" and "ago" in table[3]
    lines = cli(
        "tail", "--run-id", run_id, "metrics", "--where", "component=trainer", "--max", "3"
    ).splitlines()
    got = [json.loads(line)["value"] for line in lines]
    assert len(got) == 3 and {v["component"] for v in got} == {"trainer"}
    one = cli("tail", "--run-id", run_id, "status", "--where", "component=explorer-0", "--max", "1")
    assert json.loads(one)["value"]["role"] == "explorer"
    # what the policy said: two decoded rollouts a step (explorer.samples_per_step)
    lines = cli("tail", "--run-id", run_id, "samples", "--max", "2").splitlines()
    for sample in (json.loads(line)["value"] for line in lines):
        assert sample["explorer"] == "explorer-0" and sample["experience_id"].startswith(run_id)
        roles = [p["role"] for p in sample["parts"]]
        assert roles == ["prompt", "policy"]  # the math workflow: one policy turn
        assert sample["parts"][0]["text"].endswith("=")  # an addition task, decoded


def test_bad_config_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        EXAMPLE.read_text().replace(
            "batch_size: 32        # groups", "batch_size: -3        # groups"
        )
    )
    proc = subprocess.run(
        streamrft_cmd("run", str(bad)),
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "trainer.batch_size" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("explorer.engine=transformerz", "explorer.engine"),
        ("explorer.reward=os.path:no_such_function", "explorer.reward"),
        ("taskset.workflow=mathz", "taskset.workflow"),
        ("algorithm.policy_loss_fn=ppo_clipp", "algorithm.policy_loss_fn"),
        ("trainer.engine=fsdp9", "trainer.engine"),
    ],
)
def test_an_unknown_extension_name_fails_the_run_without_restarts(tmp_path, override, field):
    """A child stopped by a configuration error exits with EX_CONFIG; the supervisor does
    not restart it (it could not help) and the run fails at once, naming the field. One
    name per process that checks it (explorer, feeder, trainer); the registries' own
    errors are unit-tested."""
    summary = tmp_path / "summary.json"
    argv = ["run", str(EXAMPLE), "-o", override, "-o", f"run.dir={tmp_path}"]
    proc = subprocess.run(
        streamrft_cmd(*argv, "--no-progress", "--summary", str(summary)),
        env=env(),
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert field in proc.stderr and "stopped on a configuration error" in proc.stderr
    report = json.loads(summary.read_text())
    assert report["restarts"] == {}
    assert 78 in report["exit_codes"].values()
