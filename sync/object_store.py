"""Weight sync through an S3-compatible object store, via the ``minio`` SDK only.

A version lives at ``s3://<bucket>/<run id>/v<version:08d>/`` (see :mod:`.versions` for
the two-phase protocol). Works against MinIO, AWS S3, SeaweedFS and the embedded JuiceFS
gateway alike: only put/get of whole objects, no listing, no notifications required.
"""

from __future__ import annotations

import hashlib
import io
from concurrent.futures import ThreadPoolExecutor

import urllib3
from minio import Minio
from minio.error import S3Error, ServerError

from streamrft.infra.config import ObjectStoreConfig
from streamrft.schemas.errors import ServiceError, StoreUnavailable, SyncError
from streamrft.sync.versions import StoreLoader, StorePublisher
from streamrft.sync.weights import sha256_hex


def tls_options(cfg: ObjectStoreConfig) -> dict[str, str]:
    """urllib3 certificate options for https: the configured CA, or no check at all."""
    if not cfg.secure:
        return {}
    if not cfg.cert_check:
        return {"cert_reqs": "CERT_NONE"}
    if cfg.ca_file:
        return {"cert_reqs": "CERT_REQUIRED", "ca_certs": cfg.ca_file}
    return {}  # urllib3's default: CERT_REQUIRED against the system CAs


def make_client(cfg: ObjectStoreConfig) -> Minio:
    if not cfg.endpoint:
        raise ServiceError("object_store.endpoint: no object store configured or started")
    http = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=5, read=120),
        maxsize=16,
        retries=urllib3.Retry(total=3, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
        **tls_options(cfg),
    )
    return Minio(
        cfg.endpoint,
        access_key=cfg.access_key,
        secret_key=cfg.secret_key,
        secure=cfg.secure,
        region=cfg.region,
        http_client=http,
    )


def ensure_bucket(client: Minio, bucket: str) -> None:
    try:
        if not client.bucket_exists(bucket):
            client.make_bucket(bucket)
    except S3Error as exc:
        if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise ServiceError(f"object store bucket {bucket!r}: {exc}") from exc
    except urllib3.exceptions.HTTPError as exc:
        raise ServiceError(f"object store at {client._base_url.host}: {exc}") from exc


_TRANSIENT_CODES = frozenset(
    {"InternalError", "ServiceUnavailable", "SlowDown", "XMinioServerNotInitialized"}
)


def store_error(action: str, exc: Exception) -> SyncError:
    """The error to raise for a failed request: :class:`StoreUnavailable` (retriable) when
    the store did not answer or answered 5xx, a plain :class:`SyncError` otherwise."""
    reason = getattr(exc, "reason", None)  # MaxRetryError wraps the last failure
    if isinstance(exc, urllib3.exceptions.SSLError) or isinstance(
        reason, urllib3.exceptions.SSLError
    ):
        return SyncError(f"{action}: TLS failed (check object_store.ca_file/cert_check): {exc}")
    transient = isinstance(exc, urllib3.exceptions.HTTPError | ServerError) or (
        isinstance(exc, S3Error) and exc.code in _TRANSIENT_CODES
    )
    kind = StoreUnavailable if transient else SyncError
    return kind(f"{action}: {exc}")


def parse_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise SyncError(f"not an s3:// uri: {uri!r}")
    bucket, _, key = uri[5:].partition("/")
    return bucket, key


class S3Store:
    """A :class:`~streamrft.sync.versions.BlobStore` over one bucket."""

    def __init__(self, cfg: ObjectStoreConfig, create_bucket: bool) -> None:
        self.cfg = cfg
        self.client = make_client(cfg)
        if create_bucket:
            ensure_bucket(self.client, cfg.bucket)

    def put(self, key: str, data: bytes, content_type: str) -> None:
        """Multipart upload: ``part_size_mb`` parts, ``parallel`` of them in flight."""
        try:
            self.client.put_object(
                self.cfg.bucket,
                key,
                io.BytesIO(data),
                len(data),
                content_type=content_type,
                part_size=self.cfg.part_size_mb << 20,
                num_parallel_uploads=self.cfg.parallel,
            )
        except (S3Error, ServerError, urllib3.exceptions.HTTPError) as exc:
            raise store_error(f"uploading s3://{self.cfg.bucket}/{key}", exc) from exc

    def get(self, key: str) -> bytes:
        return self.get_hashed(key)[0]

    def get_hashed(self, key: str) -> tuple[bytes | bytearray, str]:
        """The whole object and its sha256.

        A large object comes as ``parallel`` ranged GETs into one buffer (no extra copy);
        each range is hashed, in order, while the later ranges are still downloading.
        """
        bucket, part = self.cfg.bucket, self.cfg.part_size_mb << 20
        try:
            size = self.client.stat_object(bucket, key).size or 0
            if size <= part or self.cfg.parallel == 1:
                data = self._read_range(bucket, key, 0, 0, None)
                return data, sha256_hex(data)
            buf = bytearray(size)
            view = memoryview(buf)
            ranges = [(off, min(part, size - off)) for off in range(0, size, part)]
            digest = hashlib.sha256()
            with ThreadPoolExecutor(self.cfg.parallel, thread_name_prefix="s3-get") as pool:
                futures = [
                    pool.submit(self._read_range, bucket, key, o, n, view[o : o + n])
                    for o, n in ranges
                ]
                for (o, n), fut in zip(ranges, futures, strict=True):
                    fut.result()
                    digest.update(view[o : o + n])
            return buf, digest.hexdigest()
        except (S3Error, ServerError, urllib3.exceptions.HTTPError) as exc:
            raise store_error(f"downloading s3://{bucket}/{key}", exc) from exc

    def _read_range(self, bucket: str, key: str, offset: int, length: int, into: memoryview | None):
        resp = self.client.get_object(bucket, key, offset=offset, length=length)
        try:
            if into is None:
                return resp.read()
            filled = 0
            while filled < length:
                n = resp.readinto(into[filled:])
                if not n:
                    raise SyncError(f"s3://{bucket}/{key}: short read at {offset + filled}")
                filled += n
            return None
        finally:
            resp.close()
            resp.release_conn()

    def uri(self, key: str) -> str:
        return f"s3://{self.cfg.bucket}/{key}"

    def key(self, uri: str) -> str:
        bucket, key = parse_uri(uri)
        if bucket != self.cfg.bucket:
            raise SyncError(f"{uri} is not in bucket {self.cfg.bucket!r} (object_store.bucket)")
        return key


class ObjectStorePublisher(StorePublisher):
    """Trainer side: versions under ``s3://<bucket>/<run id>/`` (bucket created if missing)."""

    def __init__(self, cfg: ObjectStoreConfig, run_id: str) -> None:
        super().__init__(
            S3Store(cfg, create_bucket=True), "object_store", run_id, cfg.shard_size_mb << 20
        )
        self.client = self.store.client


class ObjectStoreLoader(StoreLoader):
    """Explorer side: fetch a version from the bucket and verify every byte."""

    def __init__(self, cfg: ObjectStoreConfig) -> None:
        super().__init__(S3Store(cfg, create_bucket=False))
