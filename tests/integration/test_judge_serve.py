"""``explorer.reward: judge`` against a second ``streamrft serve`` process as the judge: a
tiny model taught (a short SFT) to grade every response ``Score: 7``, served on the
session's broker; the judge reward grades through it, by the rubric, with its cache and
its concurrency bound, and a judge gone away is retried, then named in the error."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from streamrft.infra.config import ModelConfig, RewardConfig
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model, save_policy
from streamrft.producers.rewards import get_reward, score_all
from streamrft.schemas import Task
from streamrft.schemas.errors import RewardServiceError
from tests.helpers.cli import env, overrides, service_overrides, streamrft_cmd
from tests.helpers.paths import EXAMPLE
from tests.helpers.processes import wait_for
from tests.helpers.scripted import CHARSET, CHAT

pytestmark = pytest.mark.integration

RUBRIC = "Grade: {response}"
VERDICT = "Score: 7"


def _judge_model(folder: Path) -> Path:
    """A tiny chat model that answers ``Score: 7`` to the rubric whatever the response
    (200 SFT steps on 32 rubric prompts)."""
    torch.manual_seed(0)
    tok = build_char_tokenizer(CHARSET)
    tok.chat_template = CHAT
    cfg = ModelConfig(
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, max_positions=96
    )
    model = build_tiny_model(cfg, tok)
    rows = []
    for i in range(32):
        messages = [
            {"role": "user", "content": RUBRIC.format(response=f"{i} + {i % 7} is {i * 3}")}
        ]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tok(text, add_special_tokens=False).input_ids
        target = [*tok(VERDICT, add_special_tokens=False).input_ids, tok.eos_token_id]
        rows.append((prompt, target))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(200):
        prompt, target = rows[step % len(rows)]
        ids = torch.tensor([prompt + target])
        labels = torch.tensor([[-100] * len(prompt) + target])
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return save_policy(model.eval(), tok, folder)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def test_the_judge_grades_through_a_streamrft_serve(services, tmp_path):
    model = _judge_model(tmp_path / "judge")
    run_id, runs = f"judge-{int(time.time())}", tmp_path / "runs"
    settings = [
        f"run.dir={runs}",
        "model.source=path",
        f"model.path={model}",
        "serve.serve_initial=true",
        "explorer.max_new_tokens=16",
    ]
    argv = streamrft_cmd(
        "serve", str(EXAMPLE), "--run-id", run_id, "--port", "0",
        *overrides(*settings), *service_overrides(services),
    )  # fmt: skip
    with (tmp_path / "serve.log").open("w") as log:
        server = subprocess.Popen(argv, env=env(), stdout=log, stderr=log, cwd=tmp_path)
    try:
        folder = runs / run_id / "serve"
        wait_for(lambda: any(folder.glob("*.json")), server, 180, "serve to start")
        url = json.loads(next(folder.glob("*.json")).read_text())["url"]
        wait_for(lambda: _get(f"{url}/health")["model_version"] >= 0, server, 60, "version 0")
        cfg = RewardConfig(base_url=f"{url}/v1", rubric=RUBRIC, max_tokens=12, concurrency=4)
        judge = get_reward("judge", service=cfg)
        task = Task(id="t", prompt="3+4=", answer="7")
        responses = [f"{i} + {i % 7} is {i * 3}" for i in range(6)]
        scores = score_all(judge, [(r, task) for r in responses])
        assert [s for s, _ in scores] == [pytest.approx(0.7)] * 6
        assert all(info == {"judge_score": 7.0} for _, info in scores)
        assert judge("0 + 0 is 0", task)[0] == pytest.approx(0.7)  # cached: no call
        assert judge.calls == 6
        assert _get(f"{url}/health")["recorded"] == 6  # the server saw six requests
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    gone = get_reward("judge", service=RewardConfig(base_url=f"{url}/v1", retries=1, timeout_s=2))
    with pytest.raises(RewardServiceError, match=f"judge at {url}/v1: .* 2 tries: no answer"):
        gone("x", Task(id="u", prompt="1+1="))
