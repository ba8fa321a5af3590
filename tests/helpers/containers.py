"""Apache Kafka and MinIO in Docker through testcontainers: the ``containers`` test backend.

Needs the ``containers`` extra (``pip install -e '.[containers]'``) and a Docker daemon.
The images and broker settings are those of ``compose.yaml``, so the tests meet the stack
that users run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from streamrft.infra.local.services import Endpoints

KAFKA_IMAGE = "apache/kafka:3.9.0"
MINIO_IMAGE = "minio/minio:RELEASE.2025-04-22T22-12-26Z"
ACCESS_KEY = "streamrft"
SECRET_KEY = "streamrft-secret"
CLUSTER_ID = "E7kL2mDvRnuGfijRVNWAbw"
START_TIMEOUT_S = 120
"""Seconds to wait for "Kafka Server started" after the container runs (the image is
pulled before that)."""

# as in compose.yaml: topics are created by streamrft, messages up to kafka.max_request_bytes
BROKER_SETTINGS = {
    "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
    "KAFKA_MESSAGE_MAX_BYTES": str(16 << 20),
    "KAFKA_REPLICA_FETCH_MAX_BYTES": str(16 << 20),
    "KAFKA_SOCKET_REQUEST_MAX_BYTES": str(100 << 20),
    "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
    "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
}


def docker_problem() -> str | None:
    """Why the containers backend cannot run here, or None when a Docker daemon answers."""
    try:
        import requests
        from docker.errors import DockerException
        from testcontainers.core.docker_client import DockerClient
    except ImportError as exc:
        return f"testcontainers is not installed ({exc}); pip install -e '.[containers]'"
    try:
        client = DockerClient(timeout=10).client  # asks the daemon for its API version
        try:
            client.ping()
        finally:
            client.close()
    except (DockerException, requests.RequestException, OSError) as exc:
        return f"no Docker daemon reachable ({type(exc).__name__}: {exc})"
    return None


def _container_classes() -> tuple[type, type]:
    try:  # testcontainers 4.15 moved them (the old paths still work, with a warning)
        from testcontainers.community.kafka import KafkaContainer
        from testcontainers.community.minio import MinioContainer
    except ImportError:
        from testcontainers.kafka import KafkaContainer
        from testcontainers.minio import MinioContainer
    return KafkaContainer, MinioContainer


def _apache_kafka(kafka_container: type) -> object:
    """testcontainers' ``KafkaContainer`` on the apache/kafka image in KRaft mode.

    ``KafkaContainer`` boots Confluent's cp-kafka image only: its start script runs
    ``/etc/confluent/docker/*`` (and ``with_kraft`` checks a Confluent version). This keeps
    its listeners, KRaft settings, start-up hand-shake and log wait, and replaces the start
    script with the apache/kafka image's entry point (``/etc/kafka/docker/run``), which reads
    the same ``KAFKA_*`` variables and formats the log directory with ``CLUSTER_ID``.
    """

    class ApacheKafkaContainer(kafka_container):
        def configure(self) -> None:
            self.kraft_enabled = True
            self._configure_kraft()  # CLUSTER_ID, roles, voters, listeners; waits for KRaft

        def tc_start(self) -> None:
            # the advertised address is known only once Docker has mapped the port
            host = self.get_container_host_ip()
            port = self.get_exposed_port(self.port)
            inside = "$(hostname -i | cut -d' ' -f1)"
            script = (
                "#!/bin/sh\n"
                f"export KAFKA_ADVERTISED_LISTENERS=PLAINTEXT://{host}:{port},BROKER://{inside}:9092\n"
                "exec /etc/kafka/docker/run\n"
            )
            self.create_file(script.encode(), self.TC_START_SCRIPT)

    container = ApacheKafkaContainer(KAFKA_IMAGE).with_cluster_id(CLUSTER_ID)
    for name, value in BROKER_SETTINGS.items():
        container.with_env(name, value)
    return container


@contextmanager
def running_containers() -> Iterator[Endpoints]:
    """Start Apache Kafka and MinIO, yield where they answer, stop both."""
    kafka_container, minio_container = _container_classes()
    with ExitStack() as stack:
        kafka = _apache_kafka(kafka_container)
        stack.callback(kafka.stop)
        kafka.start(timeout=START_TIMEOUT_S)
        minio = minio_container(MINIO_IMAGE, access_key=ACCESS_KEY, secret_key=SECRET_KEY)
        # testcontainers sets MINIO_ACCESS_KEY / MINIO_SECRET_KEY, names MinIO deprecated
        minio.with_env("MINIO_ROOT_USER", ACCESS_KEY).with_env("MINIO_ROOT_PASSWORD", SECRET_KEY)
        stack.callback(minio.stop)
        minio.start()
        yield Endpoints(
            bootstrap_servers=kafka.get_bootstrap_server(),
            s3_endpoint=minio.get_config()["endpoint"],
            access_key=ACCESS_KEY,
            secret_key=SECRET_KEY,
        )
