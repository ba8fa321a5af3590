"""``streamrft.client`` against the real broker: tasks and groups published through it read
back as sent (msgpack, key = task id); a bad item fails the call before anything of it is
sent; ``versions()`` and ``latest_version()`` follow the announcements on the control topic;
``from_run`` finds the broker in the run's folder."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import yaml

from streamrft.client import StreamRFTClient, make_group
from streamrft.infra.bus import EventSender
from streamrft.infra.consume import read_topic
from streamrft.schemas import (
    EXPERIENCE_GROUP,
    TASK,
    ModelVersionReady,
    SchemaError,
    ServiceError,
    Task,
    unpack_f32,
    unpack_i32,
)

pytestmark = pytest.mark.integration


def _group_json(run: str, task_id: str) -> dict:
    """A group in the JSON form an app writes from the JSON Schema (number arrays)."""
    gid = f"{run}/{task_id}@0"
    return {
        "id": gid,
        "run": run,
        "task_id": task_id,
        "explorer": "py-app",
        "model_version": 0,
        "experiences": [
            {
                "id": f"{gid}#{i}",
                "tokens": [1, 5, 6, 7, 8 + i],
                "prompt_length": 3,
                "logprobs": [-0.5, -1.25],
                "action_mask": [1, 1],
                "reward": float(i),
                "model_version": 0,
            }
            for i in range(2)
        ],
    }


def _version(v: int) -> ModelVersionReady:
    return ModelVersionReady(
        version=v, method="object_store", uri=f"s3://b/v{v}/manifest.json",
        manifest_sha256="0" * 64, bytes=100, step=v, created_at=1.0,
    )  # fmt: skip


def test_tasks_and_groups_published_through_the_client_read_back_as_sent(make_config, services):
    cfg = make_config()
    run = cfg.run.id
    built = make_group(
        run, "q-1", [([1, 5, 6], [7, 8], [-0.5, -0.75], 1.0), ([1, 5, 6], [9], [-2.0], 0.0, [1])], 0
    )

    async def scenario():
        async with StreamRFTClient(run, services.bootstrap_servers) as client:
            await client.ensure_topics()
            sent_tasks = await client.publish_tasks(
                [Task(id="q-1", prompt="1+2=", answer="3"), {"id": "q-2", "prompt": "4+4="}]
            )
            sent_groups = await client.publish_groups([built, _group_json(run, "q-2")])
        tasks = await read_topic(cfg.kafka, cfg.topics().tasks, TASK, "t-tasks")
        groups = await read_topic(cfg.kafka, cfg.topics().experiences, EXPERIENCE_GROUP, "t-exp")
        return sent_tasks, sent_groups, tasks, groups

    sent_tasks, sent_groups, tasks, groups = asyncio.run(scenario())
    assert (sent_tasks, sent_groups) == (2, 2)
    assert all(r.error is None for r in tasks + groups)
    by_id = {r.obj.id: r for r in tasks}
    assert by_id["q-1"].obj == Task(id="q-1", prompt="1+2=", answer="3")
    assert by_id["q-2"].obj.prompt == "4+4=" and by_id["q-2"].key == b"q-2"
    assert all(dict(r.headers).get("content-type") is None for r in tasks + groups)  # msgpack
    by_task = {r.obj.task_id: r for r in groups}
    assert by_task["q-1"].obj == built and by_task["q-1"].key == b"q-1"
    first = by_task["q-1"].obj.experiences[1]
    assert unpack_i32(first.tokens) == [1, 5, 6, 9] and first.prompt_length == 3
    assert unpack_f32(first.logprobs) == [-2.0] and first.reward == 0.0
    from_json = by_task["q-2"].obj
    assert from_json.id == f"{run}/q-2@0" and from_json.explorer == "py-app"
    assert [unpack_i32(e.tokens) for e in from_json.experiences] == [
        [1, 5, 6, 7, 8],
        [1, 5, 6, 7, 9],
    ]
    assert unpack_f32(from_json.experiences[0].logprobs) == [-0.5, -1.25]


def test_a_bad_item_fails_the_call_before_anything_is_sent(make_config, services):
    cfg = make_config()
    run = cfg.run.id
    bad = _group_json(run, "q-bad")
    bad["experiences"][1]["logprobs"] = [-0.5]  # one log-prob for two response tokens

    async def scenario():
        errors = []
        async with StreamRFTClient(run, services.bootstrap_servers) as client:
            await client.ensure_topics()
            for call, items in (
                (client.publish_groups, [_group_json(run, "q-ok"), bad]),
                (client.publish_tasks, [{"id": "fine"}, {"id": "", "prompt": "x"}]),
                (client.publish_tasks, [{"id": "fine"}, {"id": "t", "epoch": "one"}]),
            ):
                with pytest.raises(SchemaError) as info:
                    await call(items)
                errors.append(str(info.value))
        tasks = await read_topic(cfg.kafka, cfg.topics().tasks, None, "t-tasks", until_quiet=3)
        groups = await read_topic(cfg.kafka, cfg.topics().experiences, None, "t-exp", 3)
        return errors, tasks, groups

    errors, tasks, groups = asyncio.run(scenario())
    assert errors[0].startswith("groups[1] ('" + f"{run}/q-bad@0')") and "logprobs" in errors[0]
    assert errors[1].startswith("tasks[1] (''): task id is empty")
    assert errors[2].startswith("tasks[1] ('t'):") and "epoch" in errors[2]
    assert tasks == [] and groups == []  # not even the good items before the bad one


def test_make_group_names_the_rollout_that_breaks_a_rule():
    with pytest.raises(SchemaError, match=r"'r/t@0#1'.*action_mask"):
        make_group("r", "t", [([1], [2], [-0.1], 1.0), ([1], [2, 3], [-0.1, -0.2], 0.0, [1])], 0)
    with pytest.raises(SchemaError, match=r"'r/t@0#0'"):
        make_group("r", "t", [([1], [2**31], [-0.1], 1.0)], 0)  # past int32


def test_versions_follow_the_control_topic(make_config, services):
    cfg = make_config()

    async def scenario():
        async with (
            EventSender(cfg, "trainer", "trainer") as events,
            StreamRFTClient(cfg.run.id, services.bootstrap_servers) as client,
        ):
            await client.ensure_topics()
            assert await client.latest_version() is None
            await events.control(_version(0))
            await events.control(_version(1))
            latest = await client.latest_version()
            stream = client.versions()
            now = await asyncio.wait_for(anext(stream), 30)  # the newest so far
            await events.control(_version(2))
            nxt = await asyncio.wait_for(anext(stream), 30)  # then each new one
            await stream.aclose()
            everything = client.versions(from_beginning=True)
            history = [(await asyncio.wait_for(anext(everything), 30)).version for _ in range(3)]
            await everything.aclose()
        return latest, now, nxt, history

    latest, now, nxt, history = asyncio.run(scenario())
    assert latest == _version(1)
    assert now.version == 1 and nxt == _version(2)
    assert history == [0, 1, 2]


def test_from_run_finds_the_broker_in_the_run_folder(services, tmp_path):
    run_dir = tmp_path / "runs" / "r-1"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(
        yaml.safe_dump({"kafka": {"bootstrap_servers": services.bootstrap_servers}})
    )
    client = StreamRFTClient.from_run("r-1", run_dir=tmp_path / "runs")
    assert client.cfg.kafka.bootstrap_servers == services.bootstrap_servers
    assert client.topics.tasks == "streamrft.r-1.tasks"
    with pytest.raises(ServiceError, match="no broker found"):
        StreamRFTClient.from_run("r-2", run_dir=tmp_path / "runs")


def test_the_client_imports_neither_torch_nor_the_explorer_nor_the_trainer():
    """An app installs streamrft for the client: importing it loads no model code."""
    heavy = ("torch", "transformers", "streamrft.producers", "streamrft.consumers")
    code = f"import sys, streamrft.client; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
