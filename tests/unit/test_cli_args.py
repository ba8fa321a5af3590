"""The command line reads alike everywhere: the config is the first argument (optional
where a command works without one), the old ``--config`` still works and warns, ``--run-id``
says what it is for in each command, and ``--version`` answers."""

from __future__ import annotations

import pytest

from streamrft.app.cli import build_parser, main, parse_args

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("argv", "config", "rest"),
    [
        (["tail", "c.yaml", "metrics", "--run-id", "r"], "c.yaml", {"target": "metrics"}),
        (["tail", "metrics", "--run-id", "r"], None, {"target": "metrics"}),
        (["status", "c.yaml", "--run-id", "r"], "c.yaml", {}),
        (["status", "--run-id", "r"], None, {}),
        (["topics", "c.yaml"], "c.yaml", {}),
        (["publish", "c.yaml", "tasks", "f.jsonl", "--run-id", "r"], "c.yaml", {"kind": "tasks"}),
        (["publish", "tasks", "f.jsonl", "--run-id", "r"], None, {"file": "f.jsonl"}),
        # options between the arguments: CONFIG is still the first of them
        (["publish", "c.yaml", "--run-id", "r", "tasks", "f.jsonl"], "c.yaml", {"kind": "tasks"}),
        (["tail", "c.yaml", "--run-id", "r", "metrics"], "c.yaml", {"target": "metrics"}),
        (["tail", "--max", "3", "metrics"], None, {"target": "metrics", "max": 3}),
        (["dashboard", "c.yaml"], "c.yaml", {}),
        (["export-metrics", "c.yaml", "--run-id", "r"], "c.yaml", {}),
    ],
)
def test_the_config_is_the_first_argument_and_optional_where_it_can_be(argv, config, rest):
    _, args = parse_args(argv)
    assert args.config == config and args.command == argv[0]
    assert {k: getattr(args, k) for k in rest} == rest


def test_the_old_config_option_still_works_and_warns(tmp_path, capsys):
    missing = tmp_path / "nowhere.yaml"
    # parsed into the same place as CONFIG: the run is looked for with that file's settings
    assert main(["status", "--config", str(missing), "--run-id", "r"]) == 2
    err = capsys.readouterr().err
    assert "--config is now the first argument, CONFIG" in err
    assert "nowhere.yaml" in err and "does not exist" in err
    with pytest.raises(SystemExit) as stop:
        main(["status", "a.yaml", "--config", "b.yaml", "--run-id", "r"])
    assert stop.value.code == 2 and "give the config once" in capsys.readouterr().err


def test_run_id_help_says_what_it_is_for_in_each_command():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices

    def run_id_help(command: str) -> str:
        return next(a.help for a in sub[command]._actions if a.dest == "run_id")

    assert "resumes it" in run_id_help("run") and "<run.name>-<timestamp>" in run_id_help("run")
    for command in ("train", "explore", "serve"):
        assert run_id_help(command).startswith("the run to join (required")
    assert run_id_help("feed").startswith("the run to publish the taskset to (required")
    assert run_id_help("score").startswith("the run whose checkpoints to score (required")
    for command in ("train", "explore", "feed", "serve", "score"):
        assert "default" not in run_id_help(command)


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("streamrft 0.")
