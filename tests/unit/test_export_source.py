"""Where ``export --run-id`` takes a run's newest checkpoint: its run folder's, with the
network left alone, once the embedded services of the finished run are gone or its store
does not answer; its object store while that is up."""

from __future__ import annotations

import json
import logging
import socket

import pytest

from streamrft.app.export import run_checkpoint, services_gone, store_unusable
from streamrft.infra.config import from_dict, to_yaml
from streamrft.schemas.errors import StreamRFTError
from tests.helpers.paths import ADDITION
from tests.helpers.probes import free_port

pytestmark = pytest.mark.unit


def _cfg(tmp_path, checkpoint_store: str = "auto", **object_store):
    return from_dict(
        {
            "run": {"id": "r1", "dir": str(tmp_path / "runs")},
            "taskset": {"path": str(ADDITION)},
            "object_store": object_store,
            "trainer": {"checkpoint_store": checkpoint_store},
        }
    )


def _finished(tmp_path, endpoint: str):
    """A run folder as a finished ``streamrft run`` with embedded services leaves it: its
    resolved config naming the store that stopped with it, its services' folder without
    a state file, two checkpoints."""
    cfg = _cfg(tmp_path)
    folder = cfg.run_dir
    (folder / "services" / "logs").mkdir(parents=True)
    (folder / "config.yaml").write_text(to_yaml(_cfg(tmp_path, endpoint=endpoint)))
    for step in (1, 2):
        ckpt = folder / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "state.json").write_text(json.dumps({"step": step}))
    (folder / "checkpoints" / "latest").write_text("step_00000002")
    return cfg


def test_a_finished_runs_checkpoint_comes_from_its_folder(tmp_path, caplog, monkeypatch):
    dead = f"127.0.0.1:{free_port()}"
    cfg = _finished(tmp_path, dead)
    assert services_gone(cfg) == (
        "its embedded broker and object store stopped with it (the run has ended)"
    )

    def no_network(*args, **kwargs):
        raise AssertionError(f"the network was asked: {args}")

    monkeypatch.setattr(socket, "create_connection", no_network)
    with caplog.at_level(logging.INFO, logger="streamrft.app.export"):
        assert run_checkpoint(cfg) == cfg.run_dir / "checkpoints" / "step_00000002"
    assert "run r1: its embedded broker and object store stopped with it" in caplog.text


def test_a_store_that_does_not_answer_leaves_the_folders_checkpoint(tmp_path, caplog):
    dead = f"127.0.0.1:{free_port()}"
    cfg = _finished(tmp_path, dead)
    named = _cfg(tmp_path, endpoint=dead)  # the config names the store: not embedded
    assert services_gone(named) is None
    assert store_unusable(named) == f"its object store {dead} does not answer"
    with caplog.at_level(logging.INFO, logger="streamrft.app.export"):
        assert run_checkpoint(named).name == "step_00000002"
    assert f"its object store {dead} does not answer" in caplog.text
    local = _cfg(tmp_path, checkpoint_store="local", endpoint=dead)
    assert store_unusable(local) == (
        "it keeps its checkpoints on its trainer's disk (trainer.checkpoint_store)"
    )
    assert store_unusable(_cfg(tmp_path)) == "it has no object store"
    # nothing in the folder either: said, with why the store was not asked
    (cfg.run_dir / "checkpoints" / "latest").unlink()
    with pytest.raises(
        StreamRFTError,
        match=r"no complete checkpoint in .*checkpoints, nor in its object store \(its embedded",
    ):
        run_checkpoint(cfg)
