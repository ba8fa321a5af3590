"""Which config changes a resumed run refuses, and that the refusal names the field."""

from __future__ import annotations

import msgspec
import pytest
import yaml

from streamrft.app.resume import check_resume, resume_conflicts
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
