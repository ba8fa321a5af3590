"""The Node.js example (``examples/node/publish.mjs``, kafkajs from the npm registry)
against the real broker: its task and experience group, written as JSON from the JSON
Schema, decode to what it sent, and a real ``streamrft train`` process trains on the group.

Skipped with the reason where ``node``/``npm`` are missing, or where the npm registry
cannot be reached to install kafkajs (``make test`` installs it beforehand:
``npm ci --prefix examples/node``).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from streamrft.infra import admin
from streamrft.infra.consume import read_history, read_topic
from streamrft.infra.modeling import build_char_tokenizer
from streamrft.schemas import EXPERIENCE_GROUP, METRICS, TASK, Task, unpack_f32, unpack_i32
from tests.helpers.cli import overrides, run_ok, service_overrides, streamrft_cmd
from tests.helpers.paths import EXAMPLE, ROOT

pytestmark = pytest.mark.integration

NODE_DIR = ROOT / "examples" / "node"
UNREACHABLE = ("ENOTFOUND", "EAI_AGAIN", "ETIMEDOUT", "ECONNREFUSED", "ECONNRESET", "ENETUNREACH")
"""npm error codes that mean the registry could not be reached (not a broken lockfile)."""


def _locked_kafkajs() -> str:
    lock = json.loads((NODE_DIR / "package-lock.json").read_text())
    return lock["packages"]["node_modules/kafkajs"]["version"]


def _installed_kafkajs() -> str | None:
    manifest = NODE_DIR / "node_modules" / "kafkajs" / "package.json"
    return json.loads(manifest.read_text())["version"] if manifest.is_file() else None


@pytest.fixture(scope="module")
def node() -> str:
    """``node``, with the example's locked dependencies installed (``npm ci``, once)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are needed for the Node.js example (apt-get install nodejs npm)")
    if _installed_kafkajs() != _locked_kafkajs():
        argv = [npm, "ci", "--prefix", str(NODE_DIR), "--no-audit", "--no-fund"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            if any(code in proc.stderr for code in UNREACHABLE):
                lines = proc.stderr.splitlines()
                said = next((line for line in lines if "request to" in line), lines[-1])
                pytest.skip(f"npm ci: the npm registry is unreachable ({said.strip()})")
            pytest.fail(f"npm ci --prefix examples/node failed: {proc.stderr[-2000:]}")
    return node


def _app_input(path: Path) -> dict:
    """What the app holds: a task and two sampled answers in the tiny model's token ids."""
    tok = build_char_tokenizer()
    prompt = tok("2+3=")["input_ids"]  # BOS + characters
    answer = [*tok("5", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    wrong = [*tok("6", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    data = {
        "task": {"id": f"node-{uuid.uuid4().hex[:6]}", "prompt": "2+3=", "answer": "5"},
        "model_version": 0,
        "explorer": "node-app",
        "rollouts": [
            {"prompt_ids": prompt, "response_ids": answer, "logprobs": [-0.75, -0.5],
             "reward": 1.0, "response_text": "5"},
            {"prompt_ids": prompt, "response_ids": wrong, "logprobs": [-1.5, -0.25],
             "reward": 0.0, "response_text": "6"},
        ],
    }  # fmt: skip
    path.write_text(json.dumps(data))
    return data


def test_the_node_apps_task_and_group_arrive_as_sent_and_are_trained(
    node, make_config, services, tmp_path
):
    cfg = make_config()
    topics = cfg.topics()
    sent = _app_input(tmp_path / "input.json")
    asyncio.run(admin.ensure_topics(cfg.kafka, topics))

    argv = [node, str(NODE_DIR / "publish.mjs"), "--bootstrap", services.bootstrap_servers]
    argv += ["--run", cfg.run.id, "--prefix", cfg.kafka.topic_prefix]
    proc = subprocess.run(
        [*argv, "--input", str(tmp_path / "input.json")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = json.loads(proc.stdout.strip().splitlines()[-1])
    group_id = f"{cfg.run.id}/{sent['task']['id']}@0"
    assert said["group"] == group_id and said["sent"]["experiences"]["topic"] == topics.experiences

    async def read_back():
        tasks = await read_topic(cfg.kafka, topics.tasks, TASK, "t-tasks")
        groups = await read_topic(cfg.kafka, topics.experiences, EXPERIENCE_GROUP, "t-exp")
        return tasks, groups

    tasks, groups = asyncio.run(read_back())
    assert [(r.error, r.key) for r in tasks + groups] == [(None, sent["task"]["id"].encode())] * 2
    assert all(dict(r.headers)["content-type"] == b"application/json" for r in tasks + groups)
    assert tasks[0].obj == Task(id=sent["task"]["id"], prompt="2+3=", answer="5")
    group = groups[0].obj
    assert (group.id, group.run, group.task_id) == (group_id, cfg.run.id, sent["task"]["id"])
    assert (group.explorer, group.model_version, group.batch) == ("node-app", 0, -1)
    for i, (exp, rollout) in enumerate(zip(group.experiences, sent["rollouts"], strict=True)):
        assert exp.id == f"{group_id}#{i}"
        assert unpack_i32(exp.tokens) == rollout["prompt_ids"] + rollout["response_ids"]
        assert exp.prompt_length == len(rollout["prompt_ids"])
        assert unpack_f32(exp.logprobs) == rollout["logprobs"]  # exact in float32
        assert list(exp.action_mask) == [1, 1]
        assert (exp.reward, exp.model_version) == (rollout["reward"], 0)

    # trained on: a real trainer process, one step of exactly the groups published (one)
    eval_set = tmp_path / "eval.jsonl"
    eval_set.write_text('{"id": "e", "prompt": "1+1=", "answer": "2"}\n')
    train = streamrft_cmd("train", str(EXAMPLE), "--run-id", cfg.run.id)
    train += overrides(
        f"run.dir={tmp_path / 'runs'}",
        f"object_store.bucket={cfg.object_store.bucket}",
        f"eval.path={eval_set}",
        "trainer.batch_size=1",
        "trainer.max_steps=1",
        "trainer.warmup_sft_steps=0",
        "eval.interval=0",
        "trainer.idle_timeout_s=60",
    )
    run_ok([*train, *service_overrides(services)], tmp_path, timeout=300)
    metrics = asyncio.run(read_history(cfg.kafka, topics.metrics, METRICS, "t-metrics"))
    ledger = [row.group_id for m in metrics if m.component == "trainer" for row in m.trained]
    assert ledger == [group_id]
