"""Partial rollouts in a real run: four-turn episodes on the simulated engine (slow turns,
so the trainer publishes while an episode plays) under ``fully_async`` with
``explorer.partial_rollout``; episodes take newer versions between turns, each segment
begins at a policy turn, and the trainer trains every group once, counted by its oldest
segment."""

from __future__ import annotations

import asyncio
import json

import pytest

from streamrft.infra.consume import read_history
from streamrft.schemas import CONTROL, ModelVersionReady
from streamrft.schemas.codec import SAMPLE
from tests.helpers.cli import run_argv, run_ok, style_settings
from tests.helpers.paths import EXAMPLE
from tests.helpers.topics import groups_and_trainer_metrics

pytestmark = pytest.mark.integration

STEPS = 6


def _tasks(path) -> None:
    """Addition tasks whose conversation environment asks three more times: four turns."""
    with path.open("w") as f:
        for a in range(6):
            for b in range(6):
                row = {"id": f"add-{a}-{b}", "prompt": f"{a}+{b}=", "answer": str(a + b)}
                f.write(json.dumps({**row, "turns": ["sure?", "again?", "last?"]}) + "\n")


def test_long_episodes_take_newer_versions_between_turns(services, make_config, tmp_path):
    tasks = tmp_path / "turns.jsonl"
    _tasks(tasks)
    run_id = f"partial-{tmp_path.name[-8:]}"
    settings = [
        *style_settings("fully_async", 1, 1, 4),
        f"taskset.path={tasks}",
        "taskset.workflow=multi_turn",
        "explorer.partial_rollout=true",
        "explorer.engine=simulated",
        "explorer.simulated_seconds_per_token=0.01",  # 16 episodes x 8 tokens: 1.3 s a turn
        "explorer.max_new_tokens=8",
        "explorer.repeat_times=2",
    ]
    run_ok(run_argv(EXAMPLE, run_id, STEPS, tmp_path / "runs", services, *settings), tmp_path, 400)
    cfg = make_config(run={"id": run_id})
    groups, metrics = groups_and_trainer_metrics(cfg)
    control = asyncio.run(read_history(cfg.kafka, cfg.topics().control, CONTROL, "t-control"))
    samples = asyncio.run(read_history(cfg.kafka, cfg.topics().samples, SAMPLE, "t-samples"))
    published = {ev.version for ev in control if isinstance(ev, ModelVersionReady)}
    partial = [e for g in groups for e in g.experiences if e.segments]
    assert partial, "no episode took a newer version between its turns"
    for g in groups:
        assert g.model_version == min(e.model_version for e in g.experiences)
        for e in g.experiences:
            versions = [s.version for s in e.segments] or [e.model_version]
            assert set(versions) <= published
            mask = list(e.action_mask)
            turn_starts = {0} | {i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]}
            assert {s.start for s in e.segments} <= turn_starts  # never inside a turn
    # the decoded samples: the conversation turn by turn, the versions that sampled it
    by_id = {e.id: e for g in groups for e in g.experiences}
    assert len(samples) >= 2 * STEPS
    for sample in samples:
        exp = by_id[sample.experience_id]
        roles = [p.role for p in sample.parts]
        turns = int(exp.info["turns"])  # four, or fewer where the context ran out
        assert roles[: 2 * turns] == ["prompt", *["policy", "inserted"] * turns][: 2 * turns]
        assert roles.count("policy") == turns and len(roles) in (2 * turns, 2 * turns + 1)
        assert sample.versions == [seg.version for seg in exp.segments]
        assert sample.reward == exp.reward
    trained = [row.group_id for m in metrics for row in m.trained]
    assert len(trained) == len(set(trained)) == STEPS * 8  # each group trained once
    assert set(trained) <= {g.id for g in groups}  # the explorer ran ahead: not all trained
    final = next(m.values for m in reversed(metrics) if "trainer/stale_dropped" in m.values)
    assert final["trainer/stale_dropped"] == 0
