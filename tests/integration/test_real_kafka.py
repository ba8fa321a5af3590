"""Kafka features the embedded Tansu broker gets wrong (DESIGN.md, "Local services"), on
Apache Kafka: an idempotent producer, the end offset after a multi-record batch, and a
time-based seek. They run only on the ``containers`` backend (``--services=containers``, or
``auto`` with Docker); ``tests/conftest.py`` skips them on the local one.

Clients come from :mod:`streamrft.infra.kafka` (the project's producer, reader and admin
settings), except the idempotent producer: the project never enables idempotence, so that
one is built here with the project's security options.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import NewTopic

from streamrft.infra import kafka
from streamrft.infra.consume import assign_from_beginning

pytestmark = [pytest.mark.integration, pytest.mark.real_kafka]

RECORDS = 50


async def _new_topic(cfg) -> TopicPartition:
    """A fresh single-partition topic; returns its partition 0."""
    name = f"real-kafka-{uuid.uuid4().hex[:12]}"
    admin = kafka.admin_client(cfg.kafka)
    await kafka.start_client(admin, "topic admin")
    try:
        await admin.create_topics([NewTopic(name, 1, cfg.kafka.replication_factor)])
    finally:
        await admin.close()
    return TopicPartition(name, 0)


async def _read_all(cfg, tp: TopicPartition, want: int, timeout_s: float = 30.0) -> list:
    """Every record of ``tp`` from its beginning: stops at ``want`` records or the timeout,
    then reads for one more second so that a duplicate past ``want`` would show."""
    reader = kafka.topic_reader(cfg.kafka, "test-real-kafka-reader")
    await kafka.start_client(reader, "reader")
    try:
        await assign_from_beginning(reader, tp.topic)
        got: list = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(got) < want and loop.time() < deadline:
            for records in (await reader.getmany(timeout_ms=200)).values():
                got.extend(records)
        settle = loop.time() + 1.0
        while loop.time() < settle:
            for records in (await reader.getmany(timeout_ms=200)).values():
                got.extend(records)
        return got
    finally:
        await reader.stop()


def test_idempotent_producer_delivers_each_record_exactly_once(make_config):
    """InitProducerId succeeds, every record carries a sequence number, and a reader sees
    each record once, in order."""
    cfg = make_config()

    async def scenario():
        tp = await _new_topic(cfg)
        producer = AIOKafkaProducer(
            bootstrap_servers=cfg.kafka.bootstrap_servers,
            client_id="test-idempotent-producer",
            acks="all",
            enable_idempotence=True,
            max_request_size=cfg.kafka.max_request_bytes,
            **kafka.security_options(cfg.kafka),
        )
        await kafka.start_client(producer, "idempotent producer")
        try:
            futures = [
                await producer.send(tp.topic, f"record-{i}".encode(), partition=tp.partition)
                for i in range(RECORDS)
            ]
            offsets = [meta.offset for meta in await asyncio.gather(*futures)]
            txn = producer._txn_manager  # where aiokafka keeps the producer id and sequences
            producer_id, sequence = txn.producer_id, txn.sequence_number(tp)
        finally:
            await producer.stop()
        return offsets, producer_id, sequence, await _read_all(cfg, tp, RECORDS)

    offsets, producer_id, sequence, records = asyncio.run(scenario())
    assert producer_id >= 0, "InitProducerId gave no producer id"
    assert sequence == RECORDS, "records were not sent with idempotent sequence numbers"
    assert offsets == list(range(RECORDS))
    assert [r.value for r in records] == [f"record-{i}".encode() for i in range(RECORDS)]
    assert [r.offset for r in records] == list(range(RECORDS))


def test_end_offset_after_a_multi_record_batch_counts_every_record(make_config):
    """One produce batch of RECORDS records: the "latest" offset is RECORDS, and a reader
    that seeks to the end stands there."""
    cfg = make_config()

    async def scenario():
        tp = await _new_topic(cfg)
        producer = kafka.data_producer(cfg.kafka, "test-batch-producer")
        await kafka.start_client(producer, "producer")
        try:
            batch = producer.create_batch()
            for i in range(RECORDS):
                assert batch.append(key=None, value=f"r{i}".encode(), timestamp=None) is not None
            await (await producer.send_batch(batch, tp.topic, partition=tp.partition))
        finally:
            await producer.stop()
        reader = kafka.topic_reader(cfg.kafka, "test-end-offset-reader")
        await kafka.start_client(reader, "reader")
        try:
            end = await reader.end_offsets([tp])
            reader.assign([tp])
            await reader.seek_to_end(tp)
            position = await reader.position(tp)
        finally:
            await reader.stop()
        return end[tp], position, await _read_all(cfg, tp, RECORDS)

    end, position, records = asyncio.run(scenario())
    assert end == RECORDS
    assert position == RECORDS
    assert len(records) == RECORDS  # the batch really holds them all


def test_offsets_for_times_finds_the_first_record_at_or_after_a_timestamp(make_config):
    """Records one second apart: a time between two finds the later one, the exact time of
    one finds it, a time before all finds the first, a time after all finds none."""
    cfg = make_config()
    base_ms = int(time.time() * 1000) - 60_000  # recent: older records may be retention-deleted

    async def scenario():
        tp = await _new_topic(cfg)
        producer = kafka.event_producer(cfg.kafka, "test-timed-producer")
        await kafka.start_client(producer, "producer")
        try:
            for i in range(10):
                await producer.send_and_wait(
                    tp.topic,
                    f"t{i}".encode(),
                    partition=tp.partition,
                    timestamp_ms=base_ms + i * 1000,
                )
        finally:
            await producer.stop()
        reader = kafka.topic_reader(cfg.kafka, "test-offsets-for-times-reader")
        await kafka.start_client(reader, "reader")
        try:
            return {
                probe: (await reader.offsets_for_times({tp: base_ms + probe}))[tp]
                for probe in (3500, 7000, -60_000, 60_000)
            }
        finally:
            await reader.stop()

    found = asyncio.run(scenario())
    assert (found[3500].offset, found[3500].timestamp) == (4, base_ms + 4000)
    assert (found[7000].offset, found[7000].timestamp) == (7, base_ms + 7000)
    assert (found[-60_000].offset, found[-60_000].timestamp) == (0, base_ms)
    assert found[60_000] is None
