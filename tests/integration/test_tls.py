"""TLS on the wire: the S3 client against a real https S3 server (the JuiceFS gateway with a
certificate from a throwaway CA), and aiokafka clients' handshakes with a TLS endpoint that
demands a client certificate. (No SASL broker runs here: SASL options are unit-tested.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import subprocess
import time
import uuid

import pytest
import torch
import urllib3
from aiokafka.errors import KafkaConnectionError

from streamrft.infra import kafka
from streamrft.infra.config import from_dict
from streamrft.infra.local.services import _juicefs_bin, free_port
from streamrft.schemas.errors import ServiceError
from streamrft.sync.object_store import ObjectStoreLoader, ObjectStorePublisher
from tests.helpers.certs import make_certs

pytestmark = pytest.mark.integration

ACCESS, SECRET = "tlsuser", "tls-secret-key"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def https_store(tmp_path_factory, certs):
    """A JuiceFS S3 gateway that serves https only (MinIO's ``$HOME/.minio/certs``)."""
    root = tmp_path_factory.mktemp("https-store")
    cert_dir = root / "home" / ".minio" / "certs"
    cert_dir.mkdir(parents=True)
    (cert_dir / "public.crt").write_bytes(certs.server_cert.read_bytes())
    (cert_dir / "private.key").write_bytes(certs.server_key.read_bytes())
    exe, meta, log = _juicefs_bin(), f"sqlite3://{root / 'meta.db'}", root / "gateway.log"
    fmt = [exe, "format", meta, "tls", "--storage", "file", "--bucket", f"{root / 'data'}/"]
    subprocess.run(fmt, check=True, capture_output=True, timeout=60)
    port = free_port()
    env = {**os.environ, "HOME": str(root / "home"), "NO_COLOR": "1"}
    env |= {"MINIO_ROOT_USER": ACCESS, "MINIO_ROOT_PASSWORD": SECRET}
    argv = [exe, "gateway", meta, f"127.0.0.1:{port}", "--multi-buckets", "--no-usage-report"]
    argv += ["--no-banner", "--no-agent", "--metrics", "127.0.0.1:0", "--backup-meta", "0"]
    argv += ["--cache-dir", str(root / "cache"), "--cache-size", "0"]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        http = urllib3.PoolManager(cert_reqs="CERT_REQUIRED", ca_certs=str(certs.ca), retries=False)
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "https gateway not ready\n" + log.read_text()
            with contextlib.suppress(urllib3.exceptions.HTTPError):
                url = f"https://127.0.0.1:{port}/minio/health/live"
                if http.request("GET", url, timeout=1.0).status == 200:
                    break
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _store(endpoint: str, **fields):
    section = {"endpoint": endpoint, "access_key": ACCESS, "secret_key": SECRET, "secure": True}
    section["bucket"] = f"tls-{uuid.uuid4().hex[:12]}"
    return from_dict({"taskset": {"path": "t.jsonl"}, "object_store": section | fields})


def test_weights_travel_over_https_verified_by_the_configured_ca(https_store, certs):
    cfg = _store(https_store, ca_file=str(certs.ca))
    tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}
    event = ObjectStorePublisher(cfg.object_store, "tls-run").publish(tensors, version=1, step=1)
    got = ObjectStoreLoader(cfg.object_store).fetch(event)
    assert event.uri.startswith(f"s3://{cfg.object_store.bucket}/")
    assert set(got) == {"w", "b"} and all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_multipart_shards_over_https_round_trip_bit_exact(https_store, certs):
    """Parts and ranges go through presigned URLs on the same verified TLS connections."""
    cfg = _store(https_store, ca_file=str(certs.ca), part_size_mb=5, parallel=3)
    tensors = {"w": torch.randn(3_000_001), "h": torch.randn(1_000_001).half()}  # ~14 MiB
    event = ObjectStorePublisher(cfg.object_store, "tls-run").publish(tensors, version=2, step=2)
    got = ObjectStoreLoader(cfg.object_store).fetch(event)
    assert event.bytes > 10 << 20
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in tensors.items())


def test_https_server_of_an_unknown_ca_is_refused(https_store):
    cfg = _store(https_store)  # the system CAs do not know the test CA
    with pytest.raises(ServiceError, match="CERTIFICATE_VERIFY_FAILED"):
        ObjectStorePublisher(cfg.object_store, "tls-run")


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_cert_check_off_accepts_any_certificate(https_store):
    cfg = _store(https_store, cert_check=False)
    event = ObjectStorePublisher(cfg.object_store, "tls-run").publish({"x": torch.ones(2)}, 1, 1)
    assert torch.equal(ObjectStoreLoader(cfg.object_store).fetch(event)["x"], torch.ones(2))


# -- Kafka clients: the TLS handshake ----------------------------------------------------------


async def _handshake(cfg_fields: dict, server_cert, server_key, ca) -> list[dict]:
    """Start a producer against a TLS endpoint that requires a client certificate signed by
    ``ca``; return the client certificates of the handshakes that completed. The endpoint is
    not a broker, so the producer's start fails after the handshake either way."""
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca))
    server.load_cert_chain(str(server_cert), str(server_key))
    server.verify_mode = ssl.CERT_REQUIRED
    peers: list[dict] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peercert"))
        writer.close()

    listener = await asyncio.start_server(on_connect, "127.0.0.1", 0, ssl=server)
    port = listener.sockets[0].getsockname()[1]
    fields = {"bootstrap_servers": f"127.0.0.1:{port}", **cfg_fields}
    cfg = from_dict({"taskset": {"path": "t.jsonl"}, "kafka": fields}).kafka
    producer = kafka.event_producer(cfg, "tls-test")
    try:
        with pytest.raises(KafkaConnectionError):
            await asyncio.wait_for(producer.start(), 30)
    finally:
        await producer.stop()
        listener.close()
        await listener.wait_closed()
    return peers


def _subject(cert: dict) -> dict:
    return dict(x[0] for x in cert["subject"])


def test_kafka_client_presents_its_certificate_and_checks_the_brokers(certs):
    mutual = {
        "security_protocol": "SSL",
        "ssl_cafile": str(certs.ca),
        "ssl_certfile": str(certs.client_cert),
        "ssl_keyfile": str(certs.client_key),
    }
    peers = asyncio.run(_handshake(mutual, certs.server_cert, certs.server_key, certs.ca))
    assert peers and _subject(peers[0]) == {"commonName": "streamrft-client"}
    # a broker whose certificate names another host: refused, unless the check is off
    other = (certs.other_host_cert, certs.other_host_key, certs.ca)
    assert asyncio.run(_handshake(mutual, *other)) == []
    unchecked = asyncio.run(_handshake({**mutual, "ssl_check_hostname": False}, *other))
    assert unchecked and _subject(unchecked[0]) == {"commonName": "streamrft-client"}
    # without a client certificate the endpoint refuses the handshake
    no_cert = {"security_protocol": "SSL", "ssl_cafile": str(certs.ca)}
    assert asyncio.run(_handshake(no_cert, certs.server_cert, certs.server_key, certs.ca)) == []
