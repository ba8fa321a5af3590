"""Weight sync through an S3-compatible object store, via the ``minio`` SDK only.

Layout of one version: ``s3://<bucket>/<run id>/v<version:08d>/``

- ``model-00001-of-000NN.safetensors`` ... the shards, uploaded first;
- ``manifest.json`` last, holding every shard's sha256 and size.

A version exists when its manifest does (never decided from a prefix listing). The loader
checks the manifest against the digest in the ``ModelVersionReady`` event, then each shard
against the manifest, before anything reaches the model.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Mapping

import torch
import urllib3
from minio import Minio
from minio.error import S3Error

from streamrft.infra.config import ObjectStoreConfig
from streamrft.schemas.codec import decode_manifest, encode_manifest
from streamrft.schemas.errors import IntegrityError, ServiceError, SyncError
from streamrft.schemas.events import ModelVersionReady
from streamrft.schemas.weights import ShardInfo, WeightManifest
from streamrft.sync.weights import decode_shard, sha256_hex, shard_state_dict, verify

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"


def make_client(cfg: ObjectStoreConfig) -> Minio:
    if not cfg.endpoint:
        raise ServiceError("object_store.endpoint: no object store configured or started")
    http = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=5, read=120),
        maxsize=16,
        retries=urllib3.Retry(total=3, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
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


def version_prefix(run_id: str, version: int) -> str:
    return f"{run_id}/v{version:08d}"


def parse_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise SyncError(f"not an s3:// uri: {uri!r}")
    bucket, _, key = uri[5:].partition("/")
    return bucket, key


class ObjectStorePublisher:
    """Trainer side: write a version's shards, then its manifest, then describe the event."""

    method = "object_store"

    def __init__(self, cfg: ObjectStoreConfig, run_id: str) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.client = make_client(cfg)
        ensure_bucket(self.client, cfg.bucket)

    def _put(self, key: str, data: bytes, content_type: str) -> None:
        try:
            self.client.put_object(
                self.cfg.bucket,
                key,
                io.BytesIO(data),
                len(data),
                content_type=content_type,
                part_size=self.cfg.part_size_mb << 20,
            )
        except (S3Error, urllib3.exceptions.HTTPError) as exc:
            raise SyncError(f"uploading s3://{self.cfg.bucket}/{key}: {exc}") from exc

    def publish(
        self, tensors: Mapping[str, torch.Tensor], version: int, step: int
    ) -> ModelVersionReady:
        prefix = version_prefix(self.run_id, version)
        shards = list(shard_state_dict(tensors, self.cfg.shard_size_mb << 20))
        infos = []
        for i, (names, data) in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            self._put(f"{prefix}/{name}", data, "application/octet-stream")
            infos.append(
                ShardInfo(name=name, sha256=sha256_hex(data), bytes=len(data), tensors=names)
            )
        manifest = WeightManifest(
            version=version,
            step=step,
            run=self.run_id,
            shards=infos,
            total_bytes=sum(s.bytes for s in infos),
            created_at=time.time(),
        )
        blob = encode_manifest(manifest)
        self._put(f"{prefix}/{MANIFEST}", blob, "application/json")
        return ModelVersionReady(
            version=version,
            method=self.method,
            uri=f"s3://{self.cfg.bucket}/{prefix}/{MANIFEST}",
            manifest_sha256=sha256_hex(blob),
            bytes=manifest.total_bytes,
            step=step,
            created_at=time.time(),
        )


class ObjectStoreLoader:
    """Explorer side: fetch a version and verify every byte before returning tensors."""

    def __init__(self, cfg: ObjectStoreConfig) -> None:
        self.cfg = cfg
        self.client = make_client(cfg)

    def _get(self, bucket: str, key: str) -> bytes:
        try:
            resp = self.client.get_object(bucket, key)
            try:
                return resp.read()
            finally:
                resp.close()
                resp.release_conn()
        except (S3Error, urllib3.exceptions.HTTPError) as exc:
            raise SyncError(f"downloading s3://{bucket}/{key}: {exc}") from exc

    def fetch(self, event: ModelVersionReady) -> dict[str, torch.Tensor]:
        bucket, key = parse_uri(event.uri)
        blob = self._get(bucket, key)
        verify(blob, event.manifest_sha256, f"manifest of version {event.version}")
        manifest = decode_manifest(blob)
        if manifest.version != event.version:
            raise IntegrityError(
                f"manifest at {event.uri} is version {manifest.version}, event says {event.version}"
            )
        prefix = key.rsplit("/", 1)[0]
        tensors: dict[str, torch.Tensor] = {}
        for shard in manifest.shards:
            data = self._get(bucket, f"{prefix}/{shard.name}")
            what = f"shard {shard.name} of version {event.version}"
            verify(data, shard.sha256, what)
            tensors.update(decode_shard(data, what))
        return tensors
