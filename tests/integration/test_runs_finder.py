"""``streamrft runs`` finds the broker ``streamrft run`` started for a run (its embedded
services, recorded in the run folder), as ``status`` and the dashboard do, beside one it is
named; with none running it says where it looked."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from streamrft.app.cli import main
from streamrft.infra import admin
from streamrft.infra.bus import EventSender
from streamrft.infra.config import from_dict
from streamrft.infra.local.services import LocalServices
from streamrft.schemas.codec import STATUS
from streamrft.schemas.events import RunState, StatusEvent
from tests.helpers.paths import ADDITION

pytestmark = pytest.mark.integration


async def _a_run_reports(cfg) -> None:
    """The run's topics, and a heartbeat of its trainer at step 4."""
    await admin.ensure_topics(cfg.kafka, cfg.topics())
    status = StatusEvent(
        component="trainer",
        role="trainer",
        state=RunState.RUNNING,
        step=4,
        version=3,
        created_at=time.time(),
    )
    async with EventSender(cfg, "trainer", "trainer") as sender:
        await sender.send(cfg.topics().status, STATUS, status, key="trainer")


def _runs_json(capsys) -> list[dict]:
    assert main(["runs", "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_runs_finds_the_embedded_broker_of_a_run_in_its_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # run.dir "runs", as `streamrft run` leaves it by default
    own = LocalServices(tmp_path / "runs" / "r1" / "services", object_store=False)
    named = LocalServices(tmp_path / "elsewhere", object_store=False)  # a config names it
    eps, services = own.start(), named.start()
    try:
        own.record()
        cfg = from_dict(
            {
                "run": {"id": "r1", "dir": "runs"},
                "kafka": {"bootstrap_servers": eps.bootstrap_servers},
                "taskset": {"path": str(ADDITION)},
            }
        )
        asyncio.run(_a_run_reports(cfg))
        [row] = _runs_json(capsys)
        assert (row["run"], row["state"], row["trainer_step"]) == ("r1", "active", 4)
        assert row["broker"] == eps.bootstrap_servers
        # the table names where it looked
        assert main(["runs"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0] == f"on {eps.bootstrap_servers} (run r1 (its embedded services))"
        assert out[2].split()[:2] == ["r1", "active"]
        # a broker named in a config is read as well, each broker's runs with their broker
        other = from_dict(
            {
                "run": {"id": f"o{time.time_ns()}"},
                "kafka": {"bootstrap_servers": services.bootstrap_servers},
                "taskset": {"path": str(ADDITION)},
            }
        )
        asyncio.run(_a_run_reports(other))
        (tmp_path / "c.yaml").write_text(
            f"kafka: {{bootstrap_servers: '{services.bootstrap_servers}'}}\n"
            f"taskset: {{path: '{ADDITION}'}}\n"
        )
        assert main(["runs", "c.yaml", "--json"]) == 0, capsys.readouterr().err
        rows = {r["run"]: r["broker"] for r in json.loads(capsys.readouterr().out)}
        assert rows["r1"] == eps.bootstrap_servers
        assert rows[other.run.id] == services.bootstrap_servers
    finally:
        own.stop()
        named.stop()
    # its services gone (the run ended), and nothing else named: where it looked
    assert main(["runs"]) == 2
    err = capsys.readouterr().err
    assert "no broker (none named; no run under runs/ has its services running" in err
