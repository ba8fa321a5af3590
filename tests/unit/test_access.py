"""The Kafka access table (``infra/access.py``): a client beyond its process's role is
refused in strict mode (every test process) and logged once otherwise; the ACLs and the
``kafka-acls.sh`` lines generated from it."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiokafka import TopicPartition

from streamrft.app.acls import kafka_acls_lines, parse_principals
from streamrft.app.cli import ACCESS_ROLES, main
from streamrft.infra import access, kafka
from streamrft.infra.access import ROLES, STRICT_ENV, AccessError, acl_rows
from streamrft.infra.config import KafkaConfig
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.topics import TopicNames

pytestmark = pytest.mark.unit

TOPICS = TopicNames("streamrft", "r1")
BROKER = KafkaConfig(bootstrap_servers="127.0.0.1:1")  # never reached


@pytest.fixture
def as_role():
    def become(role):
        access.set_role(role)

    yield become
    access.set_role(None)


def test_a_client_beyond_its_role_is_refused_before_it_reaches_a_broker(as_role):
    as_role("explorer")

    async def go():
        producer = kafka.data_producer(BROKER, "x")
        with pytest.raises(
            AccessError, match=r"role explorer may not write 'streamrft\.r1\.tasks'"
        ):
            await producer.send(TOPICS.tasks, b"{}")
        await producer.stop()
        with pytest.raises(AccessError, match="may not read"):
            kafka.event_reader(BROKER, [TOPICS.metrics], "x")
        reader = kafka.event_reader(BROKER, [TOPICS.control], "x")  # its own: fine
        with pytest.raises(AccessError, match="may not read"):
            reader.assign([TopicPartition(TOPICS.experiences, 0)])
        await reader.stop()  # never started: closed at once
        with pytest.raises(AccessError, match="may not group"):
            kafka.group_reader(BROKER, "streamrft.r1.trainer", "x")
        await kafka.task_consumer(BROKER, TOPICS.tasks, TOPICS.explorers_group, "x").stop()

    asyncio.run(go())


def test_outside_strict_mode_it_is_an_error_logged_once(as_role, monkeypatch, caplog):
    monkeypatch.delenv(STRICT_ENV)
    as_role("evaluator")
    with caplog.at_level(logging.ERROR, "streamrft.infra.access"):
        for _ in range(3):
            access.check("write", TOPICS.experiences)
    said = [r.getMessage() for r in caplog.records if r.name == "streamrft.infra.access"]
    assert said == [
        "role evaluator may not write 'streamrft.r1.experiences' by the access table "
        "(infra/access.py); the run's Kafka ACLs would refuse it"
    ]


def test_a_process_with_no_role_is_not_checked(as_role):
    as_role(None)
    access.check("write", TOPICS.tasks)
    access.check("create", "r1")
    with pytest.raises(AccessError, match="unknown role"):
        access.set_role("admin")


def test_every_command_names_a_role_of_the_table():
    assert set(ACCESS_ROLES.values()) <= set(ROLES)
    assert set(ROLES) - set(ACCESS_ROLES.values()) <= {"app"} | {"operator"}


def test_the_acls_follow_the_table():
    rows = {(r.kind, r.pattern, r.name, r.operation) for r in acl_rows(TOPICS, ("explorer",))}
    assert ("topic", "literal", "streamrft.r1.experiences", "WRITE") in rows
    assert ("topic", "literal", "streamrft.r1.tasks", "READ") in rows
    assert ("group", "literal", "streamrft.r1.explorers", "READ") in rows
    assert not any(op == "CREATE" for *_, op in rows)  # explorers make no topics
    assert ("topic", "literal", "streamrft.r1.tasks", "WRITE") not in rows
    trainer = {(r.kind, r.name, r.operation) for r in acl_rows(TOPICS, ("trainer",))}
    assert ("group", "streamrft.r1.explorers", "DESCRIBE") in trainer  # reads their offsets
    assert ("group", "streamrft.r1.explorers", "READ") not in trainer
    assert ("topic", "streamrft.r1.", "CREATE") in trainer


def test_kafka_acls_lines(capsys):
    lines = kafka_acls_lines(TOPICS, parse_principals(["feeder=User:feed"]), "k:9092")
    assert lines[0].startswith("kafka-acls.sh --bootstrap-server k:9092 --add --allow-principal")
    assert (
        "kafka-acls.sh --bootstrap-server k:9092 --add --allow-principal User:feed "
        "--operation WRITE --topic streamrft.r1.tasks"
    ) in lines
    assert len(lines) == len(acl_rows(TOPICS, ("feeder",)))
    with pytest.raises(ConfigError, match="no role 'admin'"):
        parse_principals(["admin=User:x"])
    with pytest.raises(ConfigError, match="ROLE=PRINCIPAL"):
        parse_principals(["trainer"])
    assert main(["acls", "--run-id", "r2", "--principal", "supervisor=User:sup"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert (
        "kafka-acls.sh --bootstrap-server BROKER:9092 --add --allow-principal User:sup "
        "--operation CREATE --topic streamrft.r2. --resource-pattern-type prefixed"
    ) in out
    assert access.role() is None  # main() gives back the role it found


def test_only_the_trainer_may_commit_in_the_run_s_record_group(as_role):
    """The group a trainer vouches for its run definition in (``infra/run_record.py``): a
    commit needs READ on it, which only the trainer gets; a joiner reads it (DESCRIBE)."""
    group = TOPICS.group("record")
    rows = {
        (r.role, r.operation) for r in acl_rows(TOPICS) if r.kind == "group" and r.name == group
    }
    assert {role for role, op in rows if op == "READ"} == {"trainer"}
    assert {role for role, op in rows if op == "DESCRIBE"} == {
        "trainer", "explorer", "evaluator", "serve", "feeder", "operator"
    }  # fmt: skip
    as_role("explorer")
    access.check("group", group)  # reads where the trainer's record is
    with pytest.raises(AccessError, match="may not commit"):
        access.check("commit", group)
    as_role("trainer")
    access.check("commit", group)
