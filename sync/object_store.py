"""Weight sync through an S3-compatible object store, with the ``minio`` SDK.

A version lives at ``s3://<bucket>/<run id>/v<version:08d>/`` (see :mod:`.versions` for
the two-phase protocol). Works against MinIO, AWS S3, SeaweedFS and the embedded JuiceFS
gateway alike: only put/get of objects (multipart uploads, ranged GETs), no listing, no
notifications required.

The SDK creates the bucket and signs every request; the bulk bytes travel through
presigned URLs on the SDK's own connection pool (see :class:`S3Store`): bodies straight
from the tensors' memory, downloads straight into one buffer, no payload hashing but the
sha256 the manifest records.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import logging
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, BinaryIO

import torch
import urllib3
from minio import Minio
from minio.deleteobjects import DeleteObject
from minio.error import S3Error, ServerError

from streamrft.infra.config import ObjectStoreConfig
from streamrft.schemas.errors import IntegrityError, ServiceError, StoreUnavailable, SyncError
from streamrft.sync.versions import StoreLoader, StorePublisher

#: How long a presigned URL stays valid (it is used at once; this only absorbs clock skew
#: and a slow part).
PRESIGN_TTL = timedelta(hours=1)
#: S3's limit on the parts of one multipart upload (a larger shard gets larger parts).
MAX_PARTS = 10_000


def tls_options(cfg: ObjectStoreConfig) -> dict[str, Any]:
    """urllib3 certificate options for https: the configured CA, or no check at all."""
    if not cfg.secure:
        return {}
    if not cfg.cert_check:
        return {"cert_reqs": "CERT_NONE"}
    if cfg.ca_file:
        return {"cert_reqs": "CERT_REQUIRED", "ca_certs": cfg.ca_file}
    return {}  # urllib3's default: CERT_REQUIRED against the system CAs


QUICK_TIMEOUT = urllib3.Timeout(connect=3, read=5)
"""The timeouts of a client for small records that must not hold their caller long
(``quick``): a request to a store that does not answer fails within seconds."""


def make_http(cfg: ObjectStoreConfig, quick: bool = False) -> urllib3.PoolManager:
    """The connection pool of one store client: enough connections for two shards'
    ``parallel`` transfers at once, retries of 5xx answers and dropped connections;
    ``quick``: :data:`QUICK_TIMEOUT` and one retry (small records)."""
    return urllib3.PoolManager(
        timeout=QUICK_TIMEOUT if quick else urllib3.Timeout(connect=5, read=120),
        maxsize=max(16, 2 * cfg.parallel + 2),
        retries=urllib3.Retry(
            total=1 if quick else 3, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]
        ),
        **tls_options(cfg),
    )


def make_client(cfg: ObjectStoreConfig, http: urllib3.PoolManager | None = None) -> Minio:
    if not cfg.endpoint:
        raise ServiceError("object_store.endpoint: no object store configured or started")
    return Minio(
        cfg.endpoint,
        access_key=cfg.access_key,
        secret_key=cfg.secret_key,
        secure=cfg.secure,
        region=cfg.region,
        http_client=http or make_http(cfg),
    )


def ensure_bucket(client: Minio, bucket: str) -> None:
    try:
        if not client.bucket_exists(bucket):
            client.make_bucket(bucket)
    except S3Error as exc:
        if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise ServiceError(f"object store bucket {bucket!r}: {exc}") from exc
    except (urllib3.exceptions.HTTPError, ServerError) as exc:
        raise ServiceError(f"object store at {client._base_url.host}: {exc}") from exc


_SIGNATURE = re.compile(r"(X-Amz-Signature=)[0-9a-fA-F]+")


class MaskSignatures(logging.Filter):
    """Masks presigned URLs' signatures in a logger's records: urllib3 logs the whole URL
    of a request it retries, and the signature grants that request for an hour."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = _SIGNATURE.sub(r"\1...", message)
        if masked != message:
            record.msg, record.args = masked, ()
        return True


for _name in ("urllib3", "urllib3.connectionpool", "urllib3.util.retry"):
    logging.getLogger(_name).addFilter(MaskSignatures())

_TRANSIENT_CODES = frozenset(
    {"InternalError", "ServiceUnavailable", "SlowDown", "XMinioServerNotInitialized"}
)


def store_error(action: str, exc: Exception) -> SyncError:
    """The error to raise for a failed request: :class:`StoreUnavailable` (retriable) when
    the store did not answer or answered 5xx, a plain :class:`SyncError` otherwise. The
    signature of a presigned URL in the message is masked (it grants the request)."""
    text = _SIGNATURE.sub(r"\1...", str(exc))
    reason = getattr(exc, "reason", None)  # MaxRetryError wraps the last failure
    if isinstance(exc, urllib3.exceptions.SSLError) or isinstance(
        reason, urllib3.exceptions.SSLError
    ):
        return SyncError(f"{action}: TLS failed (check object_store.ca_file/cert_check): {text}")
    transient = isinstance(exc, urllib3.exceptions.HTTPError | ServerError) or (
        isinstance(exc, S3Error) and exc.code in _TRANSIENT_CODES
    )
    kind = StoreUnavailable if transient else SyncError
    return kind(f"{action}: {text}")


def response_error(action: str, status: int, body: bytes) -> SyncError:
    """The error for an S3 error answer (``<Error><Code>...``): :class:`StoreUnavailable`
    for a 5xx or a transient code, a plain :class:`SyncError` otherwise."""
    code = message = ""
    with contextlib.suppress(ET.ParseError):
        root = ET.fromstring(body)
        code, message = root.findtext("Code") or "", root.findtext("Message") or ""
    kind = StoreUnavailable if status >= 500 or code in _TRANSIENT_CODES else SyncError
    return kind(f"{action}: HTTP {status} {code}: {message or body[:200]!r}")


def xml_text(body: bytes, tag: str, action: str) -> str:
    """The text of the first ``tag`` element (any namespace) of an S3 answer."""
    try:
        text = ET.fromstring(body).findtext(f".//{{*}}{tag}")
    except ET.ParseError as exc:
        raise SyncError(f"{action}: unreadable answer {body[:200]!r}") from exc
    if not text:
        raise SyncError(f"{action}: no {tag} in the answer {body[:200]!r}")
    return text


def complete_body(etags: list[str]) -> bytes:
    """The CompleteMultipartUpload request: every part's number and ETag, in order."""
    root = ET.Element("CompleteMultipartUpload")
    for number, etag in enumerate(etags, start=1):
        part = ET.SubElement(root, "Part")
        ET.SubElement(part, "PartNumber").text = str(number)
        ET.SubElement(part, "ETag").text = etag
    return ET.tostring(root)


def parse_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise SyncError(f"not an s3:// uri: {uri!r}")
    bucket, _, key = uri[5:].partition("/")
    return bucket, key


def split_parts(chunks: Sequence[memoryview], part_size: int) -> list[list[memoryview]]:
    """``chunks`` regrouped into parts of ``part_size`` bytes (the last one shorter), each a
    list of slices of the chunks: nothing copied."""
    parts: list[list[memoryview]] = [[]]
    room = part_size
    for chunk in chunks:
        chunk = chunk.cast("B")
        while len(chunk):
            if not room:
                parts.append([])
                room = part_size
            parts[-1].append(chunk[:room])
            chunk, room = chunk[room:], room - min(room, len(chunk))
    return parts


def results_in_order(futures: list[Future], then: Callable[[int], None] | None = None) -> list:
    """The futures' results in order, ``then(i)`` run as each one is in; on the first
    failure the ones not started yet are cancelled and it is raised."""
    results = []
    try:
        for i, future in enumerate(futures):
            results.append(future.result())
            if then is not None:
                then(i)
    except BaseException:
        for future in futures:
            future.cancel()
        raise
    return results


def raw_body(resp: urllib3.BaseHTTPResponse) -> http.client.HTTPResponse | None:
    """The standard library response under urllib3's, whose ``readinto`` receives the body
    straight into the caller's buffer (urllib3's reads into a new ``bytes`` and copies it
    over); None where it is not at hand."""
    raw = getattr(resp, "_fp", None)
    return raw if isinstance(raw, http.client.HTTPResponse) else None


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


def check_range_answer(
    resp: urllib3.BaseHTTPResponse, offset: int, length: int, size: int, where: str
) -> None:
    """Raise unless ``resp``, the answer to a GET of ``length`` bytes from ``offset`` of an
    object the manifest says is ``size`` bytes, brings exactly those bytes: an
    :class:`IntegrityError` when the object has another size (``Content-Range``'s total, or
    a whole-object answer's ``Content-Length``), a :class:`SyncError` when the store sent
    other bytes than asked (it ignored ``Range``, or answered another range)."""
    if resp.status == 206:
        header = resp.headers.get("Content-Range", "")
        match = _CONTENT_RANGE.fullmatch(header.strip())
        if match is None or int(match[3]) != size:
            total = int(match[3]) if match else -1
            raise IntegrityError(f"{where}: {total} bytes, the manifest says {size}")
        if (int(match[1]), int(match[2])) != (offset, offset + length - 1):
            raise SyncError(f"{where}: asked for bytes {offset}+{length}, got {header!r}")
        return
    if (total := int(resp.headers.get("Content-Length", -1))) != size:
        raise IntegrityError(f"{where}: {total} bytes, the manifest says {size}")
    if length != size:
        raise SyncError(
            f"{where}: the store ignored the Range header (it sent the whole object for bytes "
            f"{offset}+{length}); it cannot serve ranged downloads"
        )


class S3Store:
    """A :class:`~streamrft.sync.versions.BlobStore` over one bucket.

    Bulk bytes (shard parts, ranges) go through presigned URLs on the client's own
    connection pool (its TLS settings included): a presigned request signs the query with
    ``UNSIGNED-PAYLOAD``, so no per-request sha256 of the payload is computed, and a body
    is sent as the list of tensor views it already is. Integrity rests on the manifest,
    whose sha256 travels in the event, and on each shard's sha256 in it, checked by every
    reader before a tensor is returned (and by TLS in transit with ``secure``).
    """

    def __init__(self, cfg: ObjectStoreConfig, create_bucket: bool, quick: bool = False) -> None:
        self.cfg = cfg
        self.http = make_http(cfg, quick)
        self.client = make_client(cfg, self.http)
        self.part_size = cfg.part_size_mb << 20
        if create_bucket:
            ensure_bucket(self.client, cfg.bucket)

    # -- requests ---------------------------------------------------------------------------
    def _request(
        self,
        action: str,
        method: str,
        key: str,
        *,
        query: dict[str, str] | None = None,
        body: Sequence[memoryview] | bytes | None = None,
        headers: dict[str, str] | None = None,
        stream: bool = False,
    ) -> urllib3.BaseHTTPResponse:
        """One presigned request; a failure raises the :func:`response_error` for it."""
        params: dict[str, str | list[str] | tuple[str]] | None = dict(query) if query else None
        url = self.client.get_presigned_url(
            method, self.cfg.bucket, key, PRESIGN_TTL, extra_query_params=params
        )
        try:
            resp = self.http.urlopen(
                method, url, body=body, headers=headers, preload_content=not stream
            )
        except urllib3.exceptions.HTTPError as exc:
            raise store_error(action, exc) from exc
        if resp.status >= 300:
            body = resp.data  # preloaded, or read now (a small error document)
            resp.release_conn()
            raise response_error(action, resp.status, body)
        if not stream and method == "POST" and resp.data.lstrip().startswith(b"<Error"):
            raise response_error(action, 500, resp.data)  # S3 may fail a POST inside a 200
        return resp

    # -- writing ----------------------------------------------------------------------------
    def put(self, key: str, data: bytes, content_type: str) -> None:
        self.write(key, [memoryview(data)], content_type)

    def write(self, key: str, chunks: Sequence[memoryview], content_type: str) -> None:
        """One PUT up to ``part_size_mb``; a multipart upload of ``part_size_mb`` parts,
        ``parallel`` of them in flight, above it. Bodies are the chunks' own memory."""
        size = sum(c.nbytes for c in chunks)
        part_size = max(self.part_size, -(-size // MAX_PARTS))
        action = f"uploading s3://{self.cfg.bucket}/{key}"
        if size <= part_size:
            headers = {"Content-Length": str(size), "Content-Type": content_type}
            self._request(action, "PUT", key, body=list(chunks), headers=headers)
            return
        resp = self._request(
            action, "POST", key, query={"uploads": ""}, headers={"Content-Type": content_type}
        )
        upload_id = xml_text(resp.data, "UploadId", action)
        try:
            parts = split_parts(chunks, part_size)
            with ThreadPoolExecutor(min(self.cfg.parallel, len(parts)), "s3-put") as pool:
                futures = [
                    pool.submit(self._put_part, action, key, upload_id, n, part)
                    for n, part in enumerate(parts, start=1)
                ]
                etags = results_in_order(futures)
            body = complete_body(etags)
            self._request(action, "POST", key, query={"uploadId": upload_id}, body=body)
        except BaseException:
            with contextlib.suppress(SyncError):  # best effort: the parts would only linger
                self._request(f"aborting {action}", "DELETE", key, query={"uploadId": upload_id})
            raise

    def _put_part(
        self, action: str, key: str, upload_id: str, number: int, body: list[memoryview]
    ) -> str:
        query = {"partNumber": str(number), "uploadId": upload_id}
        headers = {"Content-Length": str(sum(len(c) for c in body))}
        resp = self._request(
            f"{action} (part {number})", "PUT", key, query=query, body=body, headers=headers
        )
        return resp.headers.get("ETag", "")

    # -- reading ----------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        return self._request(f"downloading s3://{self.cfg.bucket}/{key}", "GET", key).data

    def get_hashed(self, key: str, size: int) -> tuple[torch.Tensor, str]:
        """The object as a uint8 tensor, from ``parallel`` ranged GETs of ``part_size_mb``
        straight into it; each range is hashed, in order, while later ones download."""
        buf = torch.empty(size, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        ranges = [(off, min(self.part_size, size - off)) for off in range(0, size, self.part_size)]
        digest = hashlib.sha256()
        if not ranges:  # an empty object: still check that it exists and is empty
            self._read_range(key, 0, view, size)
        with ThreadPoolExecutor(max(1, min(self.cfg.parallel, len(ranges))), "s3-get") as pool:
            spans = [(off, view[off : off + n]) for off, n in ranges]
            futures = [pool.submit(self._read_range, key, off, span, size) for off, span in spans]
            results_in_order(futures, lambda i: digest.update(spans[i][1]))  # releases the GIL
        return buf, digest.hexdigest()

    def download_to(self, key: str, size: int, out: BinaryIO) -> str:
        """The object ``key``, which must be ``size`` bytes long, written to ``out`` in
        parts of ``object_store.part_size_mb`` (memory bounded by one part); returns the
        sha256 of what was written."""
        digest = hashlib.sha256()
        if size == 0:  # still check that it exists and is empty, as get_hashed does
            self._read_range(key, 0, memoryview(bytearray()), 0)
        buffer = memoryview(bytearray(min(self.part_size, size)))
        offset = 0
        while offset < size:
            part = buffer[: min(len(buffer), size - offset)]
            self._read_range(key, offset, part, size)
            digest.update(part)
            out.write(part)
            offset += len(part)
        return digest.hexdigest()

    def _read_range(self, key: str, offset: int, into: memoryview, size: int) -> None:
        """Fill ``into`` with the object's bytes from ``offset``; the object must be
        ``size`` bytes long."""
        where = f"s3://{self.cfg.bucket}/{key}"
        headers = {"Range": f"bytes={offset}-{offset + len(into) - 1}"} if len(into) else None
        resp = self._request(f"downloading {where}", "GET", key, headers=headers, stream=True)
        try:
            check_range_answer(resp, offset, len(into), size, where)
            raw, filled = raw_body(resp), 0
            while filled < len(into):
                n = (raw or resp).readinto(into[filled:])
                if not n:
                    raise SyncError(f"{where}: short read at {offset + filled}")
                filled += n
            if raw is None:  # the raw response ends itself at its Content-Length
                resp.drain_conn()
        except urllib3.exceptions.HTTPError as exc:
            resp.close()
            raise store_error(f"downloading {where}", exc) from exc
        except (http.client.HTTPException, OSError) as exc:  # the raw response's own
            resp.close()
            raise StoreUnavailable(f"downloading {where}: connection lost: {exc!r}") from exc
        except SyncError:
            resp.close()
            raise
        finally:
            resp.release_conn()

    # -- naming -----------------------------------------------------------------------------
    def uri(self, key: str) -> str:
        return f"s3://{self.cfg.bucket}/{key}"

    def remove(self, prefix: str) -> int:
        """Delete every object under ``prefix``; how many (a store that does not answer:
        :class:`StoreUnavailable`, like any other request)."""
        action = f"removing s3://{self.cfg.bucket}/{prefix}"
        try:
            names = [
                DeleteObject(o.object_name)
                for o in self.client.list_objects(self.cfg.bucket, prefix=prefix, recursive=True)
            ]
            errors = list(self.client.remove_objects(self.cfg.bucket, names)) if names else []
        except (S3Error, ServerError, urllib3.exceptions.HTTPError) as exc:
            raise store_error(action, exc) from exc
        if errors:
            raise SyncError(f"{action}: {errors[0]}")
        return len(names)

    def remove_leftovers(self, prefix: str) -> int:
        """Abort the multipart uploads under ``prefix`` that were never completed (a
        trainer killed mid-upload: their parts take space and no listing shows them); how
        many. Its one writer is the trainer, so none of them is still in progress."""
        action = f"aborting unfinished uploads under s3://{self.cfg.bucket}/{prefix}"
        aborted = 0
        key_marker = upload_marker = None
        try:
            while True:
                # minio's own request for ListMultipartUploads (it has no public one)
                page = self.client._list_multipart_uploads(
                    self.cfg.bucket,
                    prefix=prefix,
                    key_marker=key_marker,
                    upload_id_marker=upload_marker,
                )
                for upload in page.uploads:
                    if upload.object_name is None or upload.upload_id is None:
                        continue
                    self.client._abort_multipart_upload(
                        self.cfg.bucket, upload.object_name, upload.upload_id
                    )
                    aborted += 1
                if not page.is_truncated or not page.uploads:
                    return aborted
                key_marker, upload_marker = page.next_key_marker, page.next_upload_id_marker
        except (S3Error, ServerError, urllib3.exceptions.HTTPError) as exc:
            raise store_error(action, exc) from exc

    def key(self, uri: str) -> str:
        bucket, key = parse_uri(uri)
        if bucket != self.cfg.bucket:
            raise SyncError(f"{uri} is not in bucket {self.cfg.bucket!r} (object_store.bucket)")
        return key


class ObjectStorePublisher(StorePublisher):
    """Trainer side: versions under ``s3://<bucket>/<run id>/`` (bucket created if missing)."""

    def __init__(self, cfg: ObjectStoreConfig, run_id: str) -> None:
        store = S3Store(cfg, create_bucket=True)
        super().__init__(store, "object_store", run_id, cfg.shard_size_mb << 20)
        self.client = store.client


class ObjectStoreLoader(StoreLoader):
    """Explorer side: fetch a version from the bucket and verify every byte."""

    def __init__(self, cfg: ObjectStoreConfig, run_id: str | None = None) -> None:
        super().__init__(S3Store(cfg, create_bucket=False), run_id)
