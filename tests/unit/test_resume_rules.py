"""Which config changes a resumed run refuses, and that the refusal names the field; a
finished run is started again only with ``--resume`` and steps left, its summary kept."""

from __future__ import annotations

import json

import msgspec
import pytest
import yaml

from streamrft.app.resume import (
    check_finished,
    check_resume,
    finished_run,
    keep_summary,
    resume_conflicts,
)
from streamrft.infra.config import from_dict, to_yaml
from streamrft.schemas.errors import ConfigError
from tests.helpers.paths import ADDITION


def _cfg(tmp_path, **sections):
    base = {
        "run": {"id": "r1", "dir": str(tmp_path)},
        "taskset": {"path": str(ADDITION)},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return from_dict(base)


def test_a_fresh_run_folder_is_not_a_resume(tmp_path):
    assert check_resume(_cfg(tmp_path)) is False


def test_changes_that_keep_the_checkpoint_usable_are_allowed(tmp_path):
    first = _cfg(tmp_path)
    first.run_dir.mkdir(parents=True)
    (first.run_dir / "config.yaml").write_text(to_yaml(first))
    later = _cfg(
        tmp_path,
        trainer={"lr": 1e-4, "max_steps": 500, "ppo_epochs": 3, "max_staleness": 2},
        explorer={"count": 3},
        synchronizer={"sync_interval": 2, "sync_offset": 1},
    )
    assert check_resume(later) is True


@pytest.mark.parametrize(
    ("section", "values", "field"),
    [
        ("model", {"hidden_size": 128}, "model.hidden_size"),
        ("model", {"lora": {"enabled": True}}, "model.lora.enabled"),
        ("kafka", {"partitions": 8}, "kafka.partitions"),
        ("run", {"seed": 7}, "run.seed"),
        # the feeder stamps batches of trainer.batch_size tasks; the trainer waits for them
        ("trainer", {"batch_size": 8}, "trainer.batch_size"),
        ("taskset", {"shuffle": False}, "taskset.shuffle"),
        ("object_store", {"bucket": "other-bucket"}, "object_store.bucket"),
    ],
)
def test_a_changed_fixed_field_is_refused_by_name(tmp_path, section, values, field):
    first = _cfg(tmp_path)
    first.run_dir.mkdir(parents=True)
    (first.run_dir / "config.yaml").write_text(to_yaml(first))
    with pytest.raises(ConfigError, match=rf"{field}: .* -> .*start a new run id"):
        check_resume(_cfg(tmp_path, **{section: values}))


def test_fields_unknown_to_an_older_config_count_as_equal(tmp_path):
    tree = msgspec.to_builtins(_cfg(tmp_path))
    older = yaml.safe_load(yaml.safe_dump(tree))
    del older["model"]["lora"]
    assert resume_conflicts(older, tree) == []


def _finished_folder(tmp_path, steps: int, max_steps: int):
    """A run folder as ``streamrft run`` leaves it: its config (``trainer.max_steps``), its
    newest checkpoint at ``steps``, its summary."""
    cfg = _cfg(tmp_path, trainer={"max_steps": max_steps})
    ckpt = cfg.run_dir / "checkpoints" / f"step_{steps:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"step": steps, "version": steps}))
    (cfg.run_dir / "checkpoints" / "latest").write_text(ckpt.name)
    (cfg.run_dir / "config.yaml").write_text(to_yaml(cfg))
    (cfg.run_dir / "summary.json").write_text(json.dumps({"steps": steps}))
    return cfg


def test_a_finished_run_is_not_started_again_by_its_id_alone(tmp_path):
    from streamrft.app.supervisor import run_with_services

    cfg = _finished_folder(tmp_path, steps=2, max_steps=2)
    summary = cfg.run_dir / "summary.json"
    before = summary.read_bytes()
    message = (
        r"run r1 finished: its checkpoint .*step_00000002 is at step 2 of trainer.max_steps 2 "
        r"\(its summary: .*summary.json\)\. Starting it again would train nothing: give a new "
        r"--run-id .* or --resume with --max-steps above 2"
    )
    with pytest.raises(ConfigError, match=message):
        check_finished(cfg, resume=False)
    # a higher step budget still needs --resume
    with pytest.raises(ConfigError, match=message):
        check_finished(_cfg(tmp_path, trainer={"max_steps": 5}), resume=False)
    # refused before anything starts: no services, the summary as it was
    with pytest.raises(ConfigError, match="Starting it again would train nothing"):
        run_with_services(cfg, summary, progress=False)
    assert summary.read_bytes() == before
    assert sorted(p.name for p in cfg.run_dir.iterdir()) == [
        "checkpoints",
        "config.yaml",
        "summary.json",
    ]


def test_resume_continues_a_finished_run_with_steps_left(tmp_path):
    cfg = _finished_folder(tmp_path, steps=2, max_steps=2)
    with pytest.raises(
        ConfigError, match=r"--resume: .* trainer.max_steps is 2: nothing left .* above 2"
    ):
        check_finished(cfg, resume=True)
    done = check_finished(_cfg(tmp_path, trainer={"max_steps": 3}), resume=True)
    assert done is not None and (done.step, done.max_steps) == (2, 2)
    assert check_finished(_cfg(tmp_path, trainer={"max_steps": 0}), resume=True) is not None
    # its summary is kept beside the new one, never replaced
    summary = cfg.run_dir / "summary.json"
    assert keep_summary(summary) == cfg.run_dir / "summary.1.json"
    summary.write_text("{}")
    assert keep_summary(summary) == cfg.run_dir / "summary.2.json"
    assert json.loads((cfg.run_dir / "summary.1.json").read_text()) == {"steps": 2}
    assert keep_summary(summary) is None


def test_a_run_with_steps_left_resumes_by_its_id(tmp_path):
    """Stopped, killed or failed before its last step: resumed as before, --resume or not."""
    cfg = _finished_folder(tmp_path, steps=1, max_steps=2)
    assert finished_run(cfg) is None
    assert check_finished(cfg, resume=False) is None and check_finished(cfg, resume=True) is None
    unlimited = _finished_folder(tmp_path / "other", steps=7, max_steps=0)
    assert finished_run(unlimited) is None


def test_resume_of_a_run_that_is_not_there_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--resume: there is no run r1 to resume in"):
        check_finished(_cfg(tmp_path), resume=True)
    assert check_finished(_cfg(tmp_path), resume=False) is None
