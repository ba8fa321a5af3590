"""The object store's pure helpers: parts cut from tensor views without copies, S3 error
answers mapped to retriable or not, presigned signatures kept out of error messages."""

from __future__ import annotations

import pytest
import urllib3

from streamrft.schemas.errors import StoreUnavailable, SyncError
from streamrft.sync.object_store import complete_body, response_error, split_parts, store_error

pytestmark = pytest.mark.unit


def test_split_parts_cuts_across_chunks_without_copying():
    a, b, c = bytes(range(10)), bytes(range(100, 103)), bytes(range(200, 217))
    chunks = [memoryview(a), memoryview(b), memoryview(c)]
    parts = split_parts(chunks, 8)
    assert [sum(len(p) for p in part) for part in parts] == [8, 8, 8, 6]
    assert b"".join(bytes(p) for part in parts for p in part) == a + b + c
    assert {id(p.obj) for part in parts for p in part} == {id(a), id(b), id(c)}  # slices only
    assert split_parts([memoryview(a)], 10) == [[memoryview(a)]]
    assert [len(p) for p in split_parts([memoryview(a)], 3)] == [1, 1, 1, 1]


def test_s3_error_answers_are_retriable_only_when_transient():
    slow = b"<Error><Code>SlowDown</Code><Message>reduce your rate</Message></Error>"
    assert isinstance(response_error("uploading k", 503, slow), StoreUnavailable)
    missing = response_error("downloading k", 404, b"<Error><Code>NoSuchKey</Code></Error>")
    assert type(missing) is SyncError and "HTTP 404 NoSuchKey" in str(missing)
    assert isinstance(response_error("x", 502, b"<html>bad gateway</html>"), StoreUnavailable)
    assert type(response_error("x", 403, b"")) is SyncError


def test_presigned_signature_stays_out_of_error_messages():
    url = "/b/k?X-Amz-Credential=ak&X-Amz-Signature=0123456789abcdef&partNumber=1"
    exc = urllib3.exceptions.MaxRetryError(
        None, url, urllib3.exceptions.NewConnectionError(None, "refused")
    )
    err = store_error("uploading s3://b/k", exc)
    assert isinstance(err, StoreUnavailable)
    assert "0123456789abcdef" not in str(err) and "X-Amz-Signature=..." in str(err)


def test_complete_body_lists_parts_in_order():
    body = complete_body(['"e1"', '"e2"'])
    assert body == (
        b'<CompleteMultipartUpload><Part><PartNumber>1</PartNumber><ETag>"e1"</ETag></Part>'
        b'<Part><PartNumber>2</PartNumber><ETag>"e2"</ETag></Part></CompleteMultipartUpload>'
    )


def test_urllib3s_own_log_lines_carry_no_presigned_signature():
    import logging

    from streamrft.sync.object_store import MaskSignatures

    url = "/bucket/run/v00000001/model.safetensors?X-Amz-Date=1&X-Amz-Signature=0123abcdef"
    record = logging.LogRecord(
        "urllib3.connectionpool", logging.WARNING, __file__, 1, "Retrying after: %s", (url,), None
    )
    assert MaskSignatures().filter(record)
    assert record.getMessage().endswith("X-Amz-Signature=...")
    for name in ("urllib3.connectionpool", "urllib3.util.retry"):  # where urllib3 logs them
        assert any(isinstance(f, MaskSignatures) for f in logging.getLogger(name).filters)
