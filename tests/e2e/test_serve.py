"""Serve mode end to end: the official ``openai`` client against a real ``streamrft serve``
process, a real trainer process consuming what it records, on the session's broker and store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from streamrft.infra.config import load_config, with_run_id
from streamrft.schemas.arrays import unpack_f32, unpack_i32
from tests.helpers.cli import env, overrides, service_overrides, start_logged, streamrft_cmd
from tests.helpers.paths import EXAMPLE
from tests.helpers.processes import wait_for
from tests.helpers.topics import groups_and_trainer_metrics

pytestmark = pytest.mark.e2e

KEY = "test-key-123"
SETTINGS = (
    "trainer.batch_size=3",
    "trainer.max_steps=1",
    "trainer.warmup_sft_steps=0",
    "eval.interval=0",
    "trainer.save_interval=0",
)


def _argv(command: str, run_id: str, runs: Path, services, *extra: str) -> list[str]:
    return streamrft_cmd(
        command,
        str(EXAMPLE),
        "--run-id",
        run_id,
        *overrides(f"run.dir={runs}", *SETTINGS),
        *service_overrides(services),
        *extra,
    )


def _http(url: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, dict]:
    """(status, JSON body) of a GET (``body`` None) or POST to ``url``."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("content-type", "application/json")
    if key:
        req.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _chunked(url: str, body: bytes) -> int:
    """The status of a POST whose body is sent in chunks (no length header)."""
    parts = (body[i : i + 65536] for i in range(0, len(body), 65536))
    req = urllib.request.Request(url, data=parts, method="POST")
    req.add_header("content-type", "application/json")
    req.add_header("authorization", f"Bearer {KEY}")
    req.add_header("transfer-encoding", "chunked")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _server_url(runs: Path, run_id: str, proc) -> str:
    folder = runs / run_id / "serve"
    wait_for(lambda: folder.is_dir() and any(folder.glob("*.json")), proc, 180, "serve to start")
    return json.loads(next(folder.glob("*.json")).read_text())["url"]


def _health_version(url: str) -> int:
    # without the key a probe learns only whether it serves (status); with it, the rest
    status, anonymous = _http(f"{url}/health", key=None)
    assert status == 200 and set(anonymous) == {"status"}, anonymous
    return _http(f"{url}/health")[1]["model_version"]


def test_openai_client_serve_feedback_commit_and_the_trainer_trains_it(services, tmp_path):
    run_id, runs = f"serve-{os.getpid()}-{int(time.time())}", tmp_path / "runs"
    trainer = start_logged(_argv("train", run_id, runs, services), tmp_path / "t.log", tmp_path)
    server = None
    try:
        serve_env = {**env(), "STREAMRFT_API_KEY": KEY}
        with (tmp_path / "s.log").open("w") as log:
            server = subprocess.Popen(
                _argv("serve", run_id, runs, services, "--port", "0"),
                env=serve_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
            )
        url = _server_url(runs, run_id, server)
        wait_for(lambda: _health_version(url) >= 0, server, 180, "version 0 at serve")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        model = client.models.list().data[0].id
        assert model == run_id

        # chat, n > 1, log-probs: one group of 4 choices, each rewarded on its own
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "2+3="}],
            n=4,
            max_tokens=4,
            temperature=1.0,
            logprobs=True,
            seed=7,
        )
        assert len(chat.choices) == 4 and chat.model_extra["model_version"] == 0
        for c in chat.choices:
            assert c.finish_reason in ("stop", "length")
            assert all(t.logprob <= 0 for t in c.logprobs.content)
        assert chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)
        for i in range(4):
            assert _http(
                f"{url}/feedback", {"response_id": chat.id, "choice": i, "reward": float(i % 2)}
            ) == (200, {"rewarded": 1})

        # text completions inside one conversation, rewarded together by conversation id
        texts = [
            client.completions.create(
                model=model,
                prompt=p,
                max_tokens=3,
                logprobs=1,
                extra_body={"conversation_id": "conv-1"},
            )
            for p in ("1+1=", "4+4=")
        ]
        assert all(len(t.choices[0].logprobs.tokens) >= 1 for t in texts)
        assert _http(f"{url}/feedback", {"conversation_id": "conv-1", "reward": 1.0}) == (
            200,
            {"rewarded": 2},
        )
        # a third response, never rewarded: not published
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "1+2="}], max_tokens=2
        )

        # refusals: the API key, unknown ids, sizes, unsupported fields
        assert _http(f"{url}/v1/models", key=None)[0] == 401
        assert _http(f"{url}/feedback", {"response_id": "chatcmpl-nope", "reward": 1})[0] == 404
        assert _http(f"{url}/commit", {"conversation_id": "nope"})[0] == 404
        status, body = _http(f"{url}/feedback", {"response_id": chat.id, "reward": "high"})
        assert status == 400 and "reward" in body["error"]["message"]
        big = {"model": model, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
        assert _http(f"{url}/v1/chat/completions", big)[0] == 413
        assert _chunked(f"{url}/v1/chat/completions", json.dumps(big).encode()) == 413
        with pytest.raises(openai.BadRequestError, match="max_n"):
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "1"}], n=17
            )
        with pytest.raises(openai.BadRequestError, match="context"):
            client.completions.create(model=model, prompt="1+" * 20, max_tokens=16)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model="gpt-4", messages=[{"role": "user", "content": "1"}]
            )

        # commit: the 4 choices (one group) and the conversation (one group)
        status, committed = _http(f"{url}/commit", {})
        assert status == 200, committed
        assert committed["published_groups"] == 2 and committed["published_experiences"] == 6
        assert _http(f"{url}/feedback", {"response_id": chat.id, "reward": 1})[0] == 404

        # the trainer trains them (batch 3: serve's 2 groups + one more) and publishes v1
        third = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "3+3="}], n=2, max_tokens=3
        )
        _http(f"{url}/feedback", {"response_id": third.id, "reward": 0.5})
        status, last = _http(f"{url}/commit", {"response_id": third.id})
        assert status == 200 and last["published_groups"] == 1
        assert trainer.wait(timeout=300) == 0, (tmp_path / "t.log").read_text()[-3000:]
        wait_for(lambda: _health_version(url) >= 1, server, 120, "version 1 at serve")
        after = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "2+2="}], max_tokens=2
        )
        assert after.model_extra["model_version"] == 1  # swapped between requests
        # rewarded, never committed: SIGTERM publishes it; an unrewarded one is dropped
        assert _http(f"{url}/feedback", {"response_id": after.id, "reward": 1.0})[0] == 200
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        assert not list((runs / run_id / "serve").glob("*.json"))  # the URL file is removed

        cfg = load_config(
            EXAMPLE,
            [f"run.dir={runs}", f"kafka.bootstrap_servers={services.bootstrap_servers}"],
        )
        groups, metrics = groups_and_trainer_metrics(with_run_id(cfg, run_id))
        published = committed["group_ids"] + last["group_ids"]
        (at_stop,) = [g for g in groups if g.id not in published]
        assert at_stop.model_version == 1 and [e.reward for e in at_stop.experiences] == [1.0]
        assert sorted(g.id for g in groups) == sorted([*published, at_stop.id])
        trained = [row.group_id for m in metrics for row in m.trained]
        assert sorted(trained) == sorted(published)  # the books balance: each once
        (four,) = [g for g in groups if len(g.experiences) == 4]
        assert [e.reward for e in four.experiences] == [0.0, 1.0, 0.0, 1.0]
        for exp, choice in zip(four.experiences, chat.choices, strict=True):
            resp = unpack_i32(exp.tokens)[exp.prompt_length :]
            assert len(resp) == len(choice.logprobs.content)
            sent = [t.logprob for t in choice.logprobs.content]
            assert unpack_f32(exp.logprobs) == pytest.approx(sent, abs=1e-6)
            assert set(exp.action_mask) == {1} and exp.model_version == 0
            assert exp.response_text == choice.message.content
    finally:
        if server is not None and server.poll() is None:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
        if trainer.poll() is None:
            trainer.kill()
