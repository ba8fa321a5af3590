"""The local broker and object store start, serve real clients and stop cleanly."""

from __future__ import annotations

import asyncio
import io
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from minio import Minio

from streamrft.infra.local import services
from streamrft.infra.local.services import Endpoints, LocalServices
from streamrft.schemas.errors import ConfigError, ServiceError

pytestmark = pytest.mark.integration


def _port_open(hostport: str) -> bool:
    host, port = hostport.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0); it is dead all the same
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rpartition(")")[2].split()[0] == "Z"


async def _kafka_roundtrip(bootstrap: str, payload: bytes) -> bytes:
    topic = f"t-{uuid.uuid4().hex}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, payload)
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        fetch_max_wait_ms=50,
    )
    await consumer.start()
    try:
        msg = await asyncio.wait_for(consumer.getone(), timeout=10)
    finally:
        await consumer.stop()
    return msg.value


def _s3_roundtrip(eps: Endpoints, payload: bytes) -> bytes:
    client = Minio(eps.s3_endpoint, eps.access_key, eps.secret_key, secure=False)
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    client.make_bucket(bucket)
    client.put_object(bucket, "dir/obj.bin", io.BytesIO(payload), len(payload))
    resp = client.get_object(bucket, "dir/obj.bin")
    try:
        return resp.read()
    finally:
        resp.close()
        resp.release_conn()


def test_local_services_serve_and_stop(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    svc = LocalServices(tmp_path, startup_timeout_s=20)
    with svc:
        started_s = time.perf_counter() - t0
        eps = svc.endpoints
        assert eps.bootstrap_servers and eps.s3_endpoint
        assert eps.bootstrap_servers.startswith("127.0.0.1:")
        assert svc.start() == eps  # idempotent
        pids = [s.pid for s in svc._services.values()]
        assert len(pids) == 2

        assert asyncio.run(_kafka_roundtrip(eps.bootstrap_servers, b"hello")) == b"hello"
        payload = os.urandom(100_000)
        assert _s3_roundtrip(eps, payload) == payload
    assert started_s < 10
    assert all(_pid_gone(p) for p in pids)
    assert not _port_open(eps.bootstrap_servers)
    assert not _port_open(eps.s3_endpoint)
    assert (tmp_path / "logs" / "broker.log").stat().st_size > 0
    assert (tmp_path / "logs" / "object_store.log").stat().st_size > 0
    svc.stop()  # twice is fine
    with pytest.raises(ServiceError):
        _ = svc.endpoints


def test_broker_on_s3_storage_survives_restart(tmp_path: Path) -> None:
    """With s3 storage, topics and records outlive a restart of both services."""
    topic = f"t-{uuid.uuid4().hex}"

    async def produce(bootstrap: str) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, 1, 1)])
        finally:
            await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
        await producer.start()
        try:
            await producer.send_and_wait(topic, b"durable")
        finally:
            await producer.stop()

    async def consume(bootstrap: str) -> bytes:
        consumer = AIOKafkaConsumer(
            topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", fetch_max_wait_ms=50
        )
        await consumer.start()
        try:
            return (await asyncio.wait_for(consumer.getone(), timeout=10)).value
        finally:
            await consumer.stop()

    with LocalServices(tmp_path, broker_storage="s3") as svc:
        asyncio.run(produce(svc.endpoints.bootstrap_servers))
        eps = svc.endpoints
        client = Minio(eps.s3_endpoint, eps.access_key, eps.secret_key, secure=False)
        assert client.bucket_exists(services.BROKER_BUCKET)
    with LocalServices(tmp_path, broker_storage="s3") as svc:
        assert asyncio.run(consume(svc.endpoints.bootstrap_servers)) == b"durable"


def test_up_status_down_roundtrip(tmp_path: Path) -> None:
    assert services.status(tmp_path) is None
    assert services.down(tmp_path) is False
    # start from a separate interpreter that exits: the services must outlive it
    code = textwrap.dedent(
        f"""
        from pathlib import Path
        from streamrft.infra.local.services import up
        print(up(Path({str(tmp_path)!r})))
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    st = services.status(tmp_path)
    assert st is not None and st["running"], st
    assert set(st["services"]) == {"broker", "object_store"}
    assert (tmp_path / "services.json").stat().st_mode & 0o077 == 0
    eps = Endpoints(**st["endpoints"])
    assert asyncio.run(_kafka_roundtrip(eps.bootstrap_servers, b"x")) == b"x"
    assert _s3_roundtrip(eps, b"y") == b"y"

    assert services.up(tmp_path) == eps  # already running: reused
    pids = [rec["pid"] for rec in st["services"].values()]
    assert services.down(tmp_path) is True
    assert all(_pid_gone(p) for p in pids)
    assert not _port_open(eps.bootstrap_servers)
    assert not _port_open(eps.s3_endpoint)
    assert services.status(tmp_path) is None
    assert services.down(tmp_path) is False


def test_broker_only_and_bad_config(tmp_path: Path) -> None:
    with LocalServices(tmp_path, object_store=False) as svc:
        eps = svc.endpoints
        assert eps.s3_endpoint is None and eps.access_key is None
        assert eps.bootstrap_servers is not None
        assert not (tmp_path / "object_store").exists()
    with pytest.raises(ConfigError):
        LocalServices(tmp_path, broker_storage="disk")
    with pytest.raises(ConfigError):
        LocalServices(tmp_path, broker_storage="s3", object_store=False)
    with pytest.raises(ConfigError):
        LocalServices(tmp_path, secret_key="short")


def test_startup_failure_reports_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A service that exits at once raises ServiceError carrying its log, leaving nothing."""
    monkeypatch.setattr(services, "_broker_bin", lambda: "/bin/false")
    svc = LocalServices(tmp_path, object_store=False, startup_timeout_s=5)
    with pytest.raises(ServiceError, match="exited with code 1"):
        svc.start()
    assert svc._services == {}


def test_startup_timeout_reports_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A service that never answers times out with ServiceError and is killed."""
    fake = tmp_path / "fake-broker"
    fake.write_text("#!/bin/sh\necho fake broker up\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setattr(services, "_broker_bin", lambda: str(fake))
    svc = LocalServices(tmp_path, object_store=False, startup_timeout_s=1)
    t0 = time.perf_counter()
    with pytest.raises(ServiceError, match="did not become ready") as err:
        svc.start()
    assert time.perf_counter() - t0 < 30  # its 1 s, not the fake's 60 s (a busy machine: slack)
    assert "fake broker up" in str(err.value)
    assert svc._services == {}


def test_broker_killed_under_load_loses_no_acknowledged_record(tmp_path: Path) -> None:
    """SIGKILL of an s3-storage broker while a producer keeps sending, then a restart on
    the same port: every record the broker acknowledged is still there afterwards (the
    gate keeps clients out until the restarted broker has read every partition)."""
    import asyncio

    from aiokafka import TopicPartition

    from streamrft.infra import admin, kafka
    from streamrft.infra.config import KafkaConfig
    from streamrft.infra.retry import retrying
    from streamrft.schemas.topics import TopicNames

    topics = TopicNames("t", "gate")
    acked: set[bytes] = set()

    async def produce(cfg: KafkaConfig, stop: asyncio.Event) -> None:
        producer = kafka.data_producer(cfg, "load")
        await kafka.start_client(producer, "load")
        n = 0
        try:
            while not stop.is_set():
                batch = [b"m%05d" % (n + k) for k in range(5)]

                async def attempt(batch=batch) -> None:
                    futures = [await producer.send(topics.experiences, v, key=v) for v in batch]
                    await asyncio.gather(*futures)

                await retrying("load", attempt, 60)
                acked.update(batch)
                n += 5
                await asyncio.sleep(0.02)
        finally:
            await producer.stop()

    async def scenario(svc: LocalServices) -> dict[bytes, int]:
        cfg = KafkaConfig(bootstrap_servers=svc.endpoints.bootstrap_servers)
        await admin.ensure_topics(cfg, topics)
        stop = asyncio.Event()
        load = asyncio.create_task(produce(cfg, stop))
        while len(acked) < 100:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(svc.kill, "broker")
        before_restart = len(acked)
        await asyncio.sleep(2)
        await asyncio.to_thread(svc.restart, "broker")
        while len(acked) < before_restart + 100:  # the producer came back and went on
            await asyncio.sleep(0.05)
        stop.set()
        await load
        reader = kafka.topic_reader(cfg, "check")
        await kafka.start_client(reader, "check")
        reader.assign([TopicPartition(topics.experiences, p) for p in range(4)])
        await reader.seek_to_beginning()
        seen: dict[bytes, int] = {}
        quiet = 0
        while quiet < 5:
            batches = await reader.getmany(timeout_ms=300)
            quiet = 0 if batches else quiet + 1
            for records in batches.values():
                for rec in records:
                    seen[rec.value] = seen.get(rec.value, 0) + 1
        await reader.stop()
        return seen

    with LocalServices(tmp_path, broker_storage="s3") as svc:
        public = svc.endpoints.bootstrap_servers
        seen = asyncio.run(scenario(svc))
        assert svc.endpoints.bootstrap_servers == public  # clients keep their address
    assert len(acked) >= 200
    assert sorted(acked - set(seen)) == []  # nothing acknowledged was lost


def test_concurrent_producers_on_s3_storage_lose_nothing(tmp_path: Path) -> None:
    """Four producers sending single events to one partition of an s3-storage broker:
    every acknowledged event is read back (the gate lets one produce in at a time)."""
    import asyncio

    from aiokafka import TopicPartition

    from streamrft.infra import admin, kafka
    from streamrft.infra.config import KafkaConfig
    from streamrft.schemas.topics import TopicNames

    topics = TopicNames("t", "concurrent")
    acked: set[bytes] = set()

    async def produce(cfg: KafkaConfig, name: str, n: int) -> None:
        producer = kafka.event_producer(cfg, name)
        await kafka.start_client(producer, name)
        try:
            for i in range(n):
                value = f"{name}-{i:04d}".encode()
                await producer.send_and_wait(topics.metrics, value, key=b"one-partition")
                acked.add(value)
        finally:
            await producer.stop()

    async def scenario(bootstrap: str) -> set[bytes]:
        cfg = KafkaConfig(bootstrap_servers=bootstrap, control_fetch_max_wait_ms=500)
        await admin.ensure_topics(cfg, topics)
        await asyncio.gather(*(produce(cfg, f"p{k}", 60) for k in range(4)))
        reader = kafka.topic_reader(cfg, "check")
        await kafka.start_client(reader, "check")
        reader.assign([TopicPartition(topics.metrics, 0)])
        await reader.seek_to_beginning()
        seen: set[bytes] = set()
        quiet = 0
        while quiet < 5 and len(seen) < len(acked):
            batches = await reader.getmany(timeout_ms=500)
            quiet = 0 if batches else quiet + 1
            seen.update(rec.value for records in batches.values() for rec in records)
        await reader.stop()
        return seen

    with LocalServices(tmp_path, broker_storage="s3") as svc:
        seen = asyncio.run(scenario(svc.endpoints.bootstrap_servers))
    assert len(acked) == 240
    assert sorted(acked - seen) == []


def test_restart_on_a_port_in_use_reports_it(tmp_path: Path) -> None:
    """A restart keeps the service's port; when something else holds it by then, the
    restart fails with a ServiceError that names the port and carries the broker's log."""
    with LocalServices(tmp_path, object_store=False, startup_timeout_s=20) as svc:
        port = svc._services["broker"].port
        svc.kill("broker")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
            # SO_REUSEADDR: the killed broker's connections may linger in TIME_WAIT
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            with pytest.raises(ServiceError) as err:
                svc.restart("broker")
        message = str(err.value)
        assert f"127.0.0.1:{port}" in message
        assert "in use" in message
        assert "broker.log" in message
        assert "addr" in message.lower().split("broker.log", 1)[1]  # the broker's own words
        assert "broker" not in svc._services
