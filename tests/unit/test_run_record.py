"""The run's record (``infra/run_record.py``): fingerprints, the config a joiner builds from
it (its own credentials and overrides), a feeder's check of its task files, the event's
bounds."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from streamrft.infra.config import from_dict, to_yaml
from streamrft.infra.run_record import (
    check_fingerprints,
    config_of_record,
    fingerprint,
    joining_kafka,
    make_record,
    record_text,
)
from streamrft.schemas.codec import CONTROL
from streamrft.schemas.errors import ConfigError, SchemaError
from streamrft.schemas.events import RunDefined, validate_control

pytestmark = pytest.mark.unit


def run_config(tmp_path, **sections):
    tasks = tmp_path / "tasks.jsonl"
    if not tasks.exists():
        tasks.write_text('{"id": "a", "prompt": "1+1=", "answer": "2"}\n')
    base = {
        "run": {"id": "r1"},
        "kafka": {"bootstrap_servers": "broker:9092", "topic_prefix": "team"},
        "object_store": {"endpoint": "store:9000", "access_key": "ak", "secret_key": "sk"},
        "taskset": {"path": str(tasks)},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return from_dict(base)


def test_a_fingerprint_is_the_sha256_of_the_bytes_and_of_a_folders_files(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_bytes(b"x" * 3_000_000)  # over one read chunk
    assert fingerprint(f) == "sha256:" + hashlib.sha256(b"x" * 3_000_000).hexdigest()
    folder = tmp_path / "set"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.arrow").write_bytes(b"bb")
    (folder / "sub" / "c.json").write_bytes(b"c")
    by_hand = hashlib.sha256(b"b.arrow\0bb" + b"sub/c.json\0c").hexdigest()
    assert fingerprint(folder) == f"sha256:{by_hand}"
    (folder / "sub" / "c.json").write_bytes(b"C")
    assert fingerprint(folder) != f"sha256:{by_hand}"


def test_the_record_holds_the_config_without_secrets_and_each_task_file(tmp_path):
    (tmp_path / "eval.jsonl").write_text('{"id": "e", "prompt": "2+2=", "answer": "4"}\n')
    cfg = run_config(tmp_path, eval={"path": str(tmp_path / "eval.jsonl")})
    record = make_record(cfg)
    assert record.config_yaml == to_yaml(cfg) and "sk" not in record.config_yaml.split()
    assert record.fingerprints == {
        "taskset.path": fingerprint(tmp_path / "tasks.jsonl"),
        "eval.path": fingerprint(tmp_path / "eval.jsonl"),
    }
    assert CONTROL.decode(CONTROL.encode(record)) == record  # a control event like the others
    text = record_text(record)
    assert text.endswith(record.config_yaml)
    assert f"# eval.path: {record.fingerprints['eval.path']}\n" in text


def test_a_joiner_builds_the_runs_config_with_its_own_secrets_and_overrides(tmp_path, monkeypatch):
    cfg = run_config(tmp_path)
    record = make_record(cfg)
    monkeypatch.delenv("STREAMRFT_S3_SECRET_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"object_store.secret_key: redacted in the run.s record"):
        config_of_record(record)
    monkeypatch.setenv("STREAMRFT_S3_ACCESS_KEY", "ak")
    monkeypatch.setenv("STREAMRFT_S3_SECRET_KEY", "sk")
    joined = config_of_record(record, ["explorer.threads=4", "model.device=cpu"])
    assert joined.object_store.secret_key == "sk" and joined.explorer.threads == 4
    mine = {"explorer": cfg.explorer, "run": cfg.run, "synchronizer": cfg.synchronizer}
    assert msgspec.structs.replace(joined, **mine) == cfg  # the rest is the run's
    (tmp_path / "tasks.jsonl").unlink()  # an explorer elsewhere has no task files: fine
    config_of_record(record)
    with pytest.raises(ConfigError, match=r"taskset.path: .* does not exist"):
        config_of_record(record, check_files=True)


def test_the_broker_settings_of_a_joiner(monkeypatch):
    monkeypatch.setenv("STREAMRFT_KAFKA_SASL_PASSWORD", "pw")
    kafka = joining_kafka(
        "b:1", ["kafka.topic_prefix=team", "trainer.lr=1", "kafka.security_protocol=SASL_SSL"]
    )
    assert (kafka.bootstrap_servers, kafka.topic_prefix) == ("b:1", "team")
    assert kafka.sasl_password == "pw" and kafka.security_protocol == "SASL_SSL"
    with pytest.raises(ConfigError, match=r"^kafka: "):
        joining_kafka("b:1", ["kafka.partitions=-1"])


def test_a_feeders_task_files_are_checked_against_the_record(tmp_path):
    cfg = run_config(tmp_path)
    record = make_record(cfg)
    check_fingerprints(cfg, record)  # the same file
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes((tmp_path / "tasks.jsonl").read_bytes())
    moved = msgspec.structs.replace(
        cfg, taskset=msgspec.structs.replace(cfg.taskset, path=str(copy))
    )
    check_fingerprints(moved, record)  # a copy elsewhere: compared by field, not path
    copy.write_text('{"id": "a", "prompt": "1+1=", "answer": "3"}\n')
    with pytest.raises(ConfigError, match=r"taskset.path: .* is not the run's task file"):
        check_fingerprints(moved, record)
    copy.unlink()
    with pytest.raises(ConfigError, match=r"taskset.path: .* does not exist here"):
        check_fingerprints(moved, record)


def test_a_record_out_of_bounds_is_refused():
    with pytest.raises(SchemaError, match="empty config"):
        validate_control(RunDefined(config_yaml="  "))
    many = {f"taskset.sources[{i}].path": "sha256:0" for i in range(300)}
    with pytest.raises(SchemaError, match="at most 256 fingerprints"):
        validate_control(RunDefined(config_yaml="a: 1", fingerprints=many))


def test_a_trainer_started_anywhere_keeps_the_fields_the_run_was_defined_with(tmp_path):
    """The resume rule (``app/resume.py``) against the run's record on its broker: a field
    the run must keep is refused, naming it; others (the learning rate) may change."""
    from streamrft.app.run_record import check_against_record

    cfg = run_config(tmp_path)
    record = make_record(cfg)
    check_against_record(cfg, None, make_record(cfg).fingerprints)  # a new run
    check_against_record(cfg, record, make_record(cfg).fingerprints)
    faster = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, lr=0.5))
    check_against_record(faster, record, make_record(faster).fingerprints)
    other = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, partitions=8))
    with pytest.raises(ConfigError, match=r"defined on its broker .* kafka.partitions: 4 -> 8"):
        check_against_record(other, record, make_record(other).fingerprints)


def test_on_another_host_the_task_files_are_compared_by_their_bytes_not_their_paths(tmp_path):
    from streamrft.app.run_record import check_against_record

    cfg = run_config(tmp_path)
    record = make_record(cfg)
    other_host = tmp_path / "elsewhere.jsonl"
    other_host.write_bytes((tmp_path / "tasks.jsonl").read_bytes())
    moved = msgspec.structs.replace(
        cfg, taskset=msgspec.structs.replace(cfg.taskset, path=str(other_host))
    )
    check_against_record(moved, record, make_record(moved).fingerprints)  # the same bytes elsewhere
    absent = msgspec.structs.replace(
        cfg, taskset=msgspec.structs.replace(cfg.taskset, path=str(tmp_path / "none.jsonl"))
    )
    check_against_record(
        absent, record, make_record(absent).fingerprints
    )  # a trainer without the task files: nothing to compare
    other_host.write_text('{"id": "b", "prompt": "2+2=", "answer": "4"}\n')
    with pytest.raises(ConfigError, match=r"other task files than taskset.path: .*elsewhere"):
        check_against_record(moved, record, make_record(moved).fingerprints)


def test_what_names_the_recording_host_stays_there(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMRFT_S3_SECRET_KEY", "sk")
    cfg = run_config(
        tmp_path,
        run={"host_id": "host-a", "dir": "/srv/a/runs"},
        monitor={"http_port": 9400, "http_host": "0.0.0.0", "log_format": "json"},
    )
    elsewhere = tmp_path / "b"
    elsewhere.mkdir()
    joined = config_of_record(make_record(cfg), base=elsewhere)
    assert joined.run.host_id == ""  # found on this host (host name and boot id)
    # the trainer's probe port would be taken on its host: a joiner serves none unless told
    assert (joined.monitor.http_port, joined.monitor.http_host) == (0, "127.0.0.1")
    assert joined.monitor.log_format == "json"  # the run's, not the host's
    assert joined.run.dir == "runs"  # its own run folder, in its working folder
    assert joined.run.id == "r1" and joined.run.seed == cfg.run.seed
    # the filesystem method's shared folder is the run's, not one under this host's folder
    assert joined.synchronizer.fs_dir == "/srv/a/runs/weights"
    own = run_config(tmp_path, synchronizer={"fs_dir": "/shared/w"})
    assert config_of_record(make_record(own)).synchronizer.fs_dir == "/shared/w"
    assert config_of_record(make_record(cfg), ["run.dir=/data/runs"]).run.dir == "/data/runs"
