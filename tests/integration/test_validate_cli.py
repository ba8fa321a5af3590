"""``streamrft validate`` checks a config and what it names without starting anything:
every mistake a process would only meet once started is named, and ``--connect`` reaches
the real broker and object store (or says why not)."""

from __future__ import annotations

import pytest

from streamrft.app.cli import main
from streamrft.infra.config import credentials_env, to_yaml
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.integration


def _validate(capsys, *argv: str) -> tuple[int, dict[str, str]]:
    code = main(["validate", *argv])
    lines = capsys.readouterr().out.splitlines()
    return code, {line[:13].strip(): line[13:].strip() for line in lines[:-1]}


def test_the_default_example_is_valid(capsys):
    code, checks = _validate(capsys, str(EXAMPLE))
    assert code == 0
    assert set(checks) == {"fields", "taskset", "eval set", "names", "model", "device"}
    assert all(result.startswith("ok:") for result in checks.values()), checks
    assert "100 tasks" in checks["taskset"]


def test_each_mistake_is_named_and_a_missing_gpu_only_reported(capsys, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")  # no config.json, no weights
    bad_eval = tmp_path / "eval.jsonl"
    bad_eval.write_text('{"prompt": "1+1=", "answer": "2"}\nnot json\n')
    code, checks = _validate(
        capsys, str(EXAMPLE),
        "-o", "explorer.reward=no_such_reward",
        "-o", f"eval.path={bad_eval}",
        "-o", "model.source=path", "-o", f"model.path={folder}",
        "-o", "model.device=cuda:3",
    )  # fmt: skip
    assert code == 1
    assert checks["names"].startswith("FAILED: explorer.reward: unknown reward 'no_such_reward'")
    assert checks["eval set"].startswith("FAILED") and "eval.jsonl" in checks["eval set"]
    assert checks["model"] == f"FAILED: model.path: {folder} has no config.json"
    # a config for another machine: each role's device reported, not refused
    assert checks["device"].startswith("ok: trainer cuda:3 (no GPU visible here")
    assert "; explorer 0 cuda:3 (no GPU visible here" in checks["device"]
    assert checks["taskset"].startswith("ok:")


def test_a_field_error_stops_before_the_checks(capsys):
    assert main(["validate", str(EXAMPLE), "-o", "trainer.batch_size=0"]) == 2
    assert "trainer.batch_size" in capsys.readouterr().err


def test_connect_reaches_the_broker_and_store_or_says_why_not(
    make_config, tmp_path, capsys, monkeypatch
):
    cfg = make_config()
    for var, value in credentials_env(cfg).items():
        if value is not None:
            monkeypatch.setenv(var, value)
    path = tmp_path / "run.yaml"
    path.write_text(to_yaml(cfg))
    code, checks = _validate(capsys, str(path), "--connect")
    assert code == 0, checks
    assert checks["broker"].startswith(f"ok: {cfg.kafka.bootstrap_servers}: reached")
    assert checks["object store"].startswith(f"ok: {cfg.object_store.endpoint}: reached")
    # a store that does not answer: named, and the broker still checked
    closed = "object_store.endpoint=127.0.0.1:1"
    code, checks = _validate(capsys, str(path), "--connect", "-o", closed)
    assert code == 1
    assert checks["object store"].startswith("FAILED") and "127.0.0.1:1" in checks["object store"]
    assert checks["broker"].startswith("ok:")
