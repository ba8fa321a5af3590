"""The librdkafka data producer (``kafka.producer: confluent``) through the real broker:
the guarantees of the aiokafka one, side by side with it.

Skipped when ``confluent-kafka`` (the ``kafka-fast`` extra) is not installed.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl

import msgspec
import pytest
from aiokafka.errors import KafkaConnectionError

from streamrft.infra import admin, kafka
from streamrft.infra.config import from_dict
from streamrft.infra.consume import read_topic
from streamrft.infra.local.services import LocalServices
from streamrft.infra.produce import OutRecord, send_all, send_groups
from streamrft.infra.produce_confluent import ConfluentProducer
from streamrft.schemas import EXPERIENCE_GROUP
from streamrft.schemas.errors import ServiceError
from tests.helpers.certs import make_certs
from tests.helpers.groups import make_group

if os.environ.get("CI") == "true":  # the test extra installs it: CI runs these
    import confluent_kafka
else:
    confluent_kafka = pytest.importorskip(
        "confluent_kafka",
        reason="confluent-kafka is not installed (pip install -e '.[kafka-fast]')",
    )

pytestmark = pytest.mark.integration

PRODUCERS = ("aiokafka", "confluent")


def _kafka(cfg, producer: str):
    return msgspec.structs.replace(cfg.kafka, producer=producer)


async def _sent_and_read(cfg, producer: str, records: list[OutRecord]) -> list:
    kcfg = _kafka(cfg, producer)
    client = kafka.data_producer(kcfg, f"test-{producer}")
    await kafka.start_client(client, f"{producer} producer")
    try:
        assert await send_all(client, records, "test", outage_timeout_s=30) == len(records)
    finally:
        await client.stop()
    return await read_topic(kcfg, records[0].topic, None, "test-reader")


def test_every_record_once_in_order_with_its_headers_on_aiokafkas_partition(make_config):
    """Both producers, the same keyed records with headers (each to a fresh run's
    experiences topic): each record arrives once, in the order sent within its partition,
    with its headers, on the same partition."""

    async def scenario() -> dict[str, list]:
        out = {}
        for producer in PRODUCERS:
            cfg = make_config()
            topics = cfg.topics()
            await admin.ensure_topics(cfg.kafka, topics)
            records = [
                OutRecord(
                    topics.experiences,
                    f"value-{i}".encode() * (1 + i % 50),
                    key=f"task-{i % 13}".encode(),
                    headers=[("streamrft-type", b"t"), ("n", str(i).encode())],
                )
                for i in range(300)
            ]
            out[producer] = await _sent_and_read(cfg, producer, records)
        return out

    got = asyncio.run(scenario())
    placed = {}
    for producer, records in got.items():
        assert len(records) == 300, producer
        numbers = [int(dict(r.headers)["n"]) for r in records]
        assert sorted(numbers) == list(range(300)), producer  # each once
        for r in records:
            n = int(dict(r.headers)["n"])
            assert r.value == f"value-{n}".encode() * (1 + n % 50)
            assert r.key == f"task-{n % 13}".encode()
            assert list(r.headers) == [("streamrft-type", b"t"), ("n", str(n).encode())]
        for partition in {r.partition for r in records}:
            in_partition = [int(dict(r.headers)["n"]) for r in records if r.partition == partition]
            assert in_partition == sorted(in_partition), (producer, partition)
        placed[producer] = {r.key: r.partition for r in records}
    assert placed["confluent"] == placed["aiokafka"]  # murmur2 over the key, as aiokafka
    assert len(set(placed["aiokafka"].values())) > 1


def test_experience_groups_decode_whole(make_config):
    """The explorer's path (``send_groups``) through the confluent producer: every group
    decodes and validates, with the codec's headers."""
    cfg = make_config()
    topics = cfg.topics()
    sent = [make_group(topics.run, f"task-{i}", version=1) for i in range(40)]

    async def scenario() -> list:
        await admin.ensure_topics(cfg.kafka, topics)
        kcfg = _kafka(cfg, "confluent")
        client = kafka.data_producer(kcfg, "test-explorer")
        await kafka.start_client(client, "producer")
        try:
            assert await send_groups(client, topics.experiences, sent, "test", 30) == len(sent)
        finally:
            await client.stop()
        return await read_topic(kcfg, topics.experiences, EXPERIENCE_GROUP, "test-reader")

    records = asyncio.run(scenario())
    assert [r.error for r in records] == [None] * len(sent)
    assert sorted(r.obj.id for r in records) == sorted(g.id for g in sent)
    by_id = {g.id: g for g in sent}
    for r in records:
        assert r.obj == by_id[r.obj.id]
        assert list(r.headers) == EXPERIENCE_GROUP.headers()


def test_a_step_waits_for_its_acks_not_for_the_linger(make_config):
    """``send_all`` sends what lingers as soon as all is queued: with a linger of a minute
    the records are acknowledged long before it (without, the wait below times out)."""
    cfg = make_config(kafka={"linger_ms": 60_000})
    topics = cfg.topics()
    records = [OutRecord(topics.tasks, b"x" * 1000, key=f"k{i}".encode()) for i in range(8)]

    async def scenario() -> None:
        await admin.ensure_topics(cfg.kafka, topics)
        for producer in PRODUCERS:
            client = kafka.data_producer(_kafka(cfg, producer), "test")
            await kafka.start_client(client, "producer")
            try:
                sent = await asyncio.wait_for(send_all(client, records, "step", 30), 20)
                assert sent == len(records)
            finally:
                await client.stop()

    asyncio.run(scenario())


def test_one_flush_worker_however_many_sends_and_none_after_stop(make_config, monkeypatch):
    """Every ``send_all`` asks for the lingering records to go now; one worker thread does
    it for the producer's life and is gone once it stops (at 41ac149 each ask started a
    thread, about 8 per sender per 30 s while the broker was down, and threads still
    flushing after stop called into the closed loop)."""
    import threading

    from streamrft.infra import produce_confluent

    started: list[threading.Thread] = []

    class Counted(threading.Thread):
        def start(self) -> None:
            if self.name.endswith("-flush"):
                started.append(self)
            super().start()

    monkeypatch.setattr(produce_confluent.threading, "Thread", Counted)
    cfg = make_config(kafka={"linger_ms": 60_000, "producer": "confluent"})
    topics = cfg.topics()
    records = [OutRecord(topics.tasks, b"x" * 100, key=f"k{i}".encode()) for i in range(3)]

    async def scenario() -> None:
        await admin.ensure_topics(cfg.kafka, topics)
        client = kafka.data_producer(cfg.kafka, "one-flusher")
        await kafka.start_client(client, "producer")
        try:
            for _ in range(20):
                assert await asyncio.wait_for(send_all(client, records, "step", 30), 20) == 3
        finally:
            await client.stop()

    asyncio.run(scenario())
    assert len(started) == 1
    assert not started[0].is_alive()  # joined by stop()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_broker_down_is_the_same_clear_error(make_config, monkeypatch):
    """No broker at the address: both producers' start ends in the same ServiceError."""
    monkeypatch.setattr(kafka, "CONNECT_RETRY_S", 1.0)
    monkeypatch.setattr(kafka, "CONNECT_TIMEOUT_S", 1.0)
    cfg = make_config(kafka={"bootstrap_servers": f"127.0.0.1:{_closed_port()}"})

    async def start(producer: str) -> ServiceError:
        client = kafka.data_producer(_kafka(cfg, producer), "test")
        with pytest.raises(ServiceError) as caught:
            await kafka.start_client(client, "explorer-0 producer")
        return caught.value

    for producer in PRODUCERS:
        error = asyncio.run(start(producer))
        assert str(error).startswith("explorer-0 producer: cannot reach the Kafka broker: ")
        assert error.retriable


def test_a_record_over_the_limit_is_the_same_error(make_config):
    """A record larger than ``kafka.max_request_bytes``: a non-retriable ServiceError from
    the produce path, at once, with either producer."""
    cfg = make_config(kafka={"max_request_bytes": 1 << 20})
    topics = cfg.topics()

    async def send(producer: str) -> ServiceError:
        client = kafka.data_producer(_kafka(cfg, producer), "test")
        await kafka.start_client(client, "producer")
        try:
            with pytest.raises(ServiceError) as caught:
                await send_all(client, [OutRecord(topics.tasks, b"x" * (2 << 20))], "big", 30)
        finally:
            await client.stop()
        return caught.value

    async def scenario() -> list[ServiceError]:
        await admin.ensure_topics(cfg.kafka, topics)
        return [await send(p) for p in PRODUCERS]

    for error in asyncio.run(scenario()):
        assert not error.retriable


def test_partitions_for_a_topic_are_aiokafkas(make_config):
    """``partitions_for`` (the feeder places its tasks with it) answers the same with
    either producer."""
    cfg = make_config()
    topics = cfg.topics()

    async def partitions(producer: str) -> set[int]:
        client = kafka.data_producer(_kafka(cfg, producer), "test")
        await kafka.start_client(client, "producer")
        try:
            return set(await client.partitions_for(topics.tasks))
        finally:
            await client.stop()

    async def scenario() -> dict[str, set[int]]:
        await admin.ensure_topics(cfg.kafka, topics)
        return {p: await partitions(p) for p in PRODUCERS}

    got = asyncio.run(scenario())
    assert got["confluent"] == got["aiokafka"] == set(range(cfg.kafka.partitions))


def test_nothing_is_lost_when_the_broker_is_down_then_back(make_config, tmp_path):
    """Both producers, a step's records sent while the broker is dead (SIGKILL) and
    restarted 4 s later (storage that survives the restart): ``send_all`` rides out the
    outage and every record is on the topic afterwards."""
    with LocalServices(tmp_path / "services", broker_storage="s3") as svc:
        for producer in PRODUCERS:
            cfg = make_config(
                kafka={"bootstrap_servers": svc.endpoints.bootstrap_servers, "producer": producer}
            )
            topics = cfg.topics()
            records = [
                OutRecord(topics.tasks, f"r{i}".encode(), key=f"k{i % 5}".encode())
                for i in range(50)
            ]

            async def scenario(cfg=cfg, topics=topics, records=records) -> list:
                await admin.ensure_topics(cfg.kafka, topics)
                client = kafka.data_producer(cfg.kafka, "test")
                await kafka.start_client(client, "producer")
                try:
                    svc.kill("broker")
                    step = asyncio.create_task(send_all(client, records, "outage", 90))
                    await asyncio.sleep(4)
                    assert not step.done()
                    await asyncio.to_thread(svc.restart, "broker")
                    assert await step == len(records)
                finally:
                    await client.stop()
                return await read_topic(cfg.kafka, topics.tasks, None, "test-reader")

            got = asyncio.run(scenario())
            assert {r.value for r in got} == {r.value for r in records}, producer


def test_stop_fails_what_the_broker_did_not_take(make_config, tmp_path):
    """A record still undelivered when ``stop`` gives up waiting (the broker is dead) fails
    its future with a ServiceError instead of leaving its sender waiting for ever."""
    with LocalServices(tmp_path / "services", object_store=False) as svc:
        cfg = make_config(kafka={"bootstrap_servers": svc.endpoints.bootstrap_servers})
        topics = cfg.topics()

        async def scenario() -> BaseException | None:
            await admin.ensure_topics(cfg.kafka, topics)
            producer = ConfluentProducer(kafka.confluent_options(cfg.kafka, "test"), 1.0)
            await producer.start()
            svc.kill("broker")
            future = await producer.send(topics.tasks, b"x", key=b"k")
            await producer.stop()
            await asyncio.wait([future], timeout=5)
            assert future.done(), "the record's future was left pending after stop()"
            return future.exception()

        error = asyncio.run(scenario())
    assert isinstance(error, ServiceError) and not error.retriable
    assert "_PURGE" in str(error)


# -- security: the same options, mapped to librdkafka's ----------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


async def _handshake(cfg_fields: dict, server_cert, server_key, ca) -> list[dict]:
    """Start a confluent producer against a TLS endpoint that requires a client certificate
    signed by ``ca``; the client certificates of the handshakes that completed. The endpoint
    is not a broker, so the start fails after the handshake either way."""
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca))
    server.load_cert_chain(str(server_cert), str(server_key))
    server.verify_mode = ssl.CERT_REQUIRED
    peers: list[dict] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peercert"))
        writer.close()

    listener = await asyncio.start_server(on_connect, "127.0.0.1", 0, ssl=server)
    port = listener.sockets[0].getsockname()[1]
    fields = {"bootstrap_servers": f"127.0.0.1:{port}", "producer": "confluent", **cfg_fields}
    cfg = from_dict({"taskset": {"path": "t.jsonl"}, "kafka": fields}).kafka
    producer = kafka.data_producer(cfg, "tls-test")
    try:
        with pytest.raises(KafkaConnectionError):
            await producer.start()
    finally:
        await producer.stop()
        listener.close()
        await listener.wait_closed()
    return peers


def _subject(cert: dict) -> dict:
    return dict(x[0] for x in cert["subject"])


def test_tls_client_certificate_and_broker_hostname_check(certs, monkeypatch):
    """``kafka.ssl_*`` reach librdkafka: the client presents its certificate, refuses a
    broker whose certificate names another host unless ``ssl_check_hostname`` is off."""
    monkeypatch.setattr(kafka, "CONNECT_TIMEOUT_S", 2.0)
    mutual = {
        "security_protocol": "SSL",
        "ssl_cafile": str(certs.ca),
        "ssl_certfile": str(certs.client_cert),
        "ssl_keyfile": str(certs.client_key),
    }
    peers = asyncio.run(_handshake(mutual, certs.server_cert, certs.server_key, certs.ca))
    assert peers and _subject(peers[0]) == {"commonName": "streamrft-client"}
    other = (certs.other_host_cert, certs.other_host_key, certs.ca)
    assert asyncio.run(_handshake(mutual, *other)) == []
    unchecked = asyncio.run(_handshake({**mutual, "ssl_check_hostname": False}, *other))
    assert unchecked and _subject(unchecked[0]) == {"commonName": "streamrft-client"}


def test_sasl_options_are_librdkafkas_and_accepted(certs):
    """SASL over TLS: mechanism, user and password under librdkafka's names, and librdkafka
    takes the whole option set (it checks names, values and the TLS files when built)."""
    cfg = from_dict(
        {
            "taskset": {"path": "t.jsonl"},
            "kafka": {
                "bootstrap_servers": "127.0.0.1:1",
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "SCRAM-SHA-512",
                "sasl_username": "alice",
                "sasl_password": "pw-1",
                "ssl_cafile": str(certs.ca),
            },
        }
    ).kafka
    options = kafka.confluent_options(cfg, "c")
    assert {k: options[k] for k in ("security.protocol", "sasl.mechanism")} == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
    }
    assert (options["sasl.username"], options["sasl.password"]) == ("alice", "pw-1")
    assert options["ssl.ca.location"] == str(certs.ca)
    assert (options["acks"], options["enable.idempotence"]) == ("all", False)
    confluent_kafka.Producer(options)  # raises KafkaException on an option it refuses
