"""Configuration: typed loading, errors that name the field, overrides, paths, run ids."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from streamrft.infra.config import Config, from_dict, load_config, with_run_id
from streamrft.infra.taskset import read_taskset
from streamrft.schemas.errors import ConfigError
from tests.helpers.configs import cfg_of, write_config
from tests.helpers.paths import EXAMPLE, ROOT

pytestmark = pytest.mark.unit

# -- from_dict -------------------------------------------------------------------------------


def test_defaults_and_values():
    cfg = from_dict(cfg_of(trainer={"batch_size": 8, "lr": 0.01}, run={"name": "arith"}))
    assert isinstance(cfg, Config)
    assert cfg.trainer.batch_size == 8
    assert cfg.trainer.lr == 0.01
    assert cfg.trainer.grad_clip == 1.0  # default kept
    assert cfg.algorithm.type == "grpo"
    assert cfg.algorithm.clip_low is None  # left to the preset
    assert cfg.run.name == "arith"
    with pytest.raises(AttributeError):
        cfg.trainer.batch_size = 4  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(
    ("sections", "pattern"),
    [
        ({"trainer": {"batch_size": "many"}}, r"^trainer\.batch_size: Expected `int`, got `str`"),
        ({"trainer": {"batch_size": 0}}, r"^trainer\.batch_size: .*>= 1"),
        ({"algorithm": {"clip_low": 1.5}}, r"^algorithm\.clip_low: .*<= 1"),
        ({"algorithm": {"is_cap": 0}}, r"^algorithm\.is_cap: .*> 0"),
        (
            {"algorithm": {"off_policy_correction": "tis"}},
            r"^algorithm\.off_policy_correction: Invalid enum value 'tis'",
        ),
        ({"trainer": {"clip_low": 0.2}}, r"^trainer\.clip_low: moved to algorithm\.clip_low$"),
        ({"trainer": {"kl_coef": 0.1}}, r"^trainer\.kl_coef: moved to algorithm\.kl_loss_coef$"),
        (
            {"algorithm": {"is_mask_low": 2.0, "is_mask_high": 1.5}},
            r"^algorithm\.is_mask_low: 2\.0 is not below algorithm\.is_mask_high 1\.5$",
        ),
        ({"kafka": {"session_timeout_ms": 10}}, r"^kafka\.session_timeout_ms: .*>= 1000"),
        ({"trainer": {"batch_sise": 4}}, r"^trainer: .*unknown field `batch_sise`"),
        ({"trainers": {}}, r"^config: .*unknown field `trainers`"),
        (
            {"synchronizer": {"method": "carrier_pigeon"}},
            r"^synchronizer\.method: Invalid enum value 'carrier_pigeon'",
        ),
        (
            {"synchronizer": {"staging": "gpu"}},
            r"^synchronizer\.staging: Invalid enum value 'gpu'",
        ),
        ({"algorithm": {"loss_agg_mode": "sum"}}, r"^algorithm\.loss_agg_mode: "),
        ({"run": {"name": "my run"}}, r"^run\.name: "),
    ],
)
def test_errors_name_the_field(sections, pattern):
    with pytest.raises(ConfigError, match=pattern):
        from_dict(cfg_of(**sections))


def test_numbers_in_strings_are_converted():
    # YAML users write "3" by accident; strict=False converts it instead of failing
    assert from_dict(cfg_of(trainer={"batch_size": "3"})).trainer.batch_size == 3


@pytest.mark.parametrize(
    ("staleness", "offset", "interval", "ok"),
    [
        (0, 0, 1, True),  # on-policy: needs 0
        (0, 1, 1, False),  # needs 1
        (1, 1, 1, True),
        (1, 1, 2, False),  # needs 2
        (2, 1, 2, True),
        (3, 2, 3, False),  # needs 4
        (4, 2, 3, True),
    ],
)
def test_staleness_cross_field_rule(staleness, offset, interval, ok):
    data = cfg_of(
        trainer={"max_staleness": staleness},
        synchronizer={"sync_offset": offset, "sync_interval": interval},
    )
    if ok:
        assert from_dict(data).trainer.max_staleness == staleness
    else:
        with pytest.raises(
            ConfigError,
            match=rf"^trainer\.max_staleness: {staleness} .*"
            rf"use >= {offset + interval - 1}",
        ):
            from_dict(data)


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({}, r"^taskset\.path: "),
        (cfg_of(model={"source": "path"}), r"^model\.path: "),
        (cfg_of(model={"hidden_size": 30, "num_heads": 4}), r"^model\.hidden_size: 30 "),
        (cfg_of(explorer={"repeat_times": 1}), r"^explorer\.repeat_times: "),
        (cfg_of(object_store={"secret_key": "short"}), r"^object_store\.secret_key: "),
    ],
)
def test_other_cross_field_rules(data, pattern):
    with pytest.raises(ConfigError, match=pattern):
        from_dict(data)


def test_short_secret_is_fine_for_an_external_store():
    cfg = from_dict(cfg_of(object_store={"secret_key": "short", "endpoint": "s3.example:9000"}))
    assert cfg.object_store.secret_key == "short"


# -- load_config -----------------------------------------------------------------------------


def test_load_config_resolves_taskset_against_the_config_folder(tmp_path, monkeypatch):
    path = write_config(tmp_path / "exp", {"taskset": {"path": "data/tasks.jsonl"}})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(path)
    assert Path(cfg.taskset.path) == (tmp_path / "exp" / "data" / "tasks.jsonl").resolve()
    assert Path(cfg.taskset.path).is_absolute()


def test_load_config_keeps_absolute_paths(tmp_path):
    absolute = tmp_path / "abs.jsonl"
    absolute.write_text("{}\n")
    path = write_config(tmp_path / "exp", {"taskset": {"path": str(absolute)}})
    assert load_config(path).taskset.path == str(absolute)


def test_load_config_missing_taskset_file(tmp_path):
    path = write_config(tmp_path, {"taskset": {"path": "data/nope.jsonl"}})
    with pytest.raises(ConfigError, match=r"^taskset\.path: .*nope\.jsonl.* does not exist"):
        load_config(path)


def test_load_config_missing_eval_file(tmp_path):
    path = write_config(
        tmp_path, {"taskset": {"path": "data/tasks.jsonl"}, "eval": {"path": "data/eval.jsonl"}}
    )
    with pytest.raises(ConfigError, match=r"^eval\.path: .*eval\.jsonl.* does not exist"):
        load_config(path)


def test_the_old_eval_fields_still_work_with_a_warning(tmp_path, caplog):
    """``taskset.eval_path`` and ``trainer.eval_interval`` moved to ``eval.path`` and
    ``eval.interval``: the old names give the new fields (the path relative to the config
    file, as before) and a warning naming both; both names at once with different values
    are refused."""
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "eval.jsonl").write_text('{"id": "e", "prompt": "1+1=", "answer": "2"}\n')
    old = {"taskset": {"path": "data/tasks.jsonl", "eval_path": "data/eval.jsonl"}}
    old["trainer"] = {"eval_interval": 7}
    with caplog.at_level("WARNING", logger="streamrft.infra.config"):
        cfg = load_config(write_config(tmp_path, old))
    assert cfg.eval.path == str(tmp_path / "data" / "eval.jsonl")
    assert cfg.eval.interval == 7
    said = caplog.text
    assert "taskset.eval_path is deprecated: it is eval.path now" in said
    assert "trainer.eval_interval is deprecated: it is eval.interval now" in said
    same = {**old, "eval": {"interval": 7}}
    assert load_config(write_config(tmp_path, same)).eval.interval == 7
    both = {**old, "eval": {"interval": 3}}
    with pytest.raises(ConfigError, match=r"trainer\.eval_interval: 7 and eval\.interval: 3"):
        load_config(write_config(tmp_path, both))


def test_load_config_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_load_config_invalid_yaml(tmp_path):
    path = write_config(tmp_path, "trainer: [unclosed\n  lr: : 1\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(path)


def test_load_config_top_level_must_be_a_mapping(tmp_path):
    path = write_config(tmp_path, "- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)


def test_load_config_field_errors_name_the_field(tmp_path):
    path = write_config(
        tmp_path, {"taskset": {"path": "data/tasks.jsonl"}, "trainer": {"batch_size": -2}}
    )
    with pytest.raises(ConfigError, match=r"^trainer\.batch_size: "):
        load_config(path)


def test_overrides_are_applied(tmp_path):
    path = write_config(
        tmp_path,
        {"taskset": {"path": "data/tasks.jsonl"}, "trainer": {"lr": 0.001, "batch_size": 4}},
    )
    cfg = load_config(
        path,
        [
            "trainer.lr=0.5",
            "explorer.temperature=0.7",
            "monitor.progress=false",
            "run.name=from-cli",
        ],
    )
    assert cfg.trainer.lr == 0.5
    assert cfg.trainer.batch_size == 4  # untouched sibling kept
    assert cfg.explorer.temperature == 0.7  # section created by the override
    assert cfg.monitor.progress is False
    assert cfg.run.name == "from-cli"


def test_override_errors(tmp_path):
    path = write_config(tmp_path, {"taskset": {"path": "data/tasks.jsonl"}})
    with pytest.raises(ConfigError, match=r"expected key\.path=value"):
        load_config(path, ["trainer.lr"])
    with pytest.raises(ConfigError, match=r"^trainer\.lr: "):
        load_config(path, ["trainer.lr=-1"])
    with pytest.raises(ConfigError, match="is not a section"):
        load_config(path, ["taskset.path.deeper=1"])


def test_override_of_a_relative_taskset_path(tmp_path):
    path = write_config(tmp_path / "exp", {"taskset": {"path": "data/missing.jsonl"}})
    cfg = load_config(path, ["taskset.path=data/tasks.jsonl"])
    assert Path(cfg.taskset.path) == (tmp_path / "exp" / "data" / "tasks.jsonl").resolve()


def test_example_config_loads():
    cfg = load_config(EXAMPLE)
    assert cfg.run.name == "arithmetic"
    assert Path(cfg.taskset.path).is_file()


# -- run ids ---------------------------------------------------------------------------------


def test_with_run_id():
    cfg = from_dict(cfg_of(run={"name": "arith"}))
    with pytest.raises(ConfigError, match=r"^run\.id: "):
        cfg.topics()

    given = with_run_id(cfg, "arith-7")
    assert given.run.id == "arith-7"
    assert given.topics().tasks == "streamrft.arith-7.tasks"
    assert cfg.run.id is None  # the original is unchanged
    assert given.trainer == cfg.trainer

    derived = with_run_id(cfg)
    assert re.fullmatch(r"arith-\d{8}-\d{6}-[0-9a-f]{4}", derived.run.id)
    assert with_run_id(cfg).run.id != derived.run.id  # two runs in the same second differ
    assert derived.run_dir == Path("runs") / derived.run.id

    configured = from_dict(cfg_of(run={"name": "arith", "id": "fixed"}))
    assert with_run_id(configured).run.id == "fixed"
    assert with_run_id(configured, "override").run.id == "override"

    with pytest.raises(ConfigError):
        with_run_id(cfg, "has.dot")


def test_bad_run_id_error_names_run_id():
    with pytest.raises(ConfigError, match=r"^run\.id: "):
        from_dict(cfg_of(run={"name": "fine", "id": "bad.id"}))
    cfg = from_dict(cfg_of(run={"name": "fine"}))
    with pytest.raises(ConfigError, match=r"^run\.id: "):
        with_run_id(cfg, "bad.id")


def test_config_round_trips_through_builtins():
    cfg = from_dict(cfg_of(trainer={"lr": 0.25}))
    assert from_dict(msgspec.to_builtins(cfg)) == cfg


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_every_example_config_loads_and_its_tasksets_read(name):
    """The examples the README names are valid configs whose task files exist and read."""
    cfg = load_config(ROOT / "examples" / name)
    for path in filter(None, (cfg.taskset.path, cfg.eval.path)):
        assert read_taskset(path, cfg.taskset), path
    if cfg.model.source == "path":  # a prepared model: `streamrft models prepare ...`
        assert "models/" in cfg.model.path


def test_keep_best_names_an_evaluation_metric_of_the_trainer():
    cfg = load_config(EXAMPLE, ["trainer.keep_best=eval/pass@4"])
    assert cfg.trainer.keep_best == "eval/pass@4"
    with pytest.raises(ConfigError, match=r"trainer.keep_best: 'train/loss' is not an evaluation"):
        load_config(EXAMPLE, ["trainer.keep_best=train/loss"])
    with pytest.raises(ConfigError, match=r"needs the trainer's own evaluation"):
        load_config(EXAMPLE, ["trainer.keep_best=eval/accuracy", "eval.count=1"])
