# The streamrft image: the package installed as the README installs it (the pinned torch
# wheel first, then `pip install .`), the examples and deploy/run.yaml beside it, and
# `streamrft` as the entrypoint, run by a non-root user (uid 10001).
#
#   docker build -t streamrft:cpu .
#   docker run --rm streamrft:cpu run examples/arithmetic.yaml      # the tiny example, embedded services
#
# GPU variant: a CUDA base and torch from a CUDA index (pick the index your driver runs;
# the image was never built, see docs/deploying.md):
#
#   docker build -t streamrft:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#
# Same-host weight sync (synchronizer.method shared or auto) goes through /dev/shm: give
# the trainer room there (`docker run --shm-size=8g`, compose `shm_size`) and let the
# explorers on its host share it (`--ipc=host`, or `--ipc=container:<trainer>`) with one
# run.host_id. Everything else reaches the explorers through the object store.

# A Debian or Ubuntu image (apt-get, python3 3.10+); the CUDA images are Ubuntu.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

# torch first, from its own index, so that pyproject's torch range never pulls another build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# optional extras of the package, comma-separated (kafka-fast, monitor, models, ...)
ARG EXTRAS=""
ARG DEBIAN_FRONTEND=noninteractive

RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/streamrft
RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

# the package, non-editable: only what pyproject.toml maps into `streamrft`
WORKDIR /usr/src/streamrft
COPY pyproject.toml README.md ./
COPY schemas/ schemas/
COPY infra/ infra/
COPY sync/ sync/
COPY producers/ producers/
COPY consumers/ consumers/
COPY app/ app/
COPY client/ client/
RUN pip install --no-cache-dir "/usr/src/streamrft${EXTRAS:+[${EXTRAS}]}"

# the working folder: examples/ and deploy/run.yaml as in the repository (a config's
# relative paths are taken from its own folder), runs/ written by the processes
WORKDIR /opt/streamrft
COPY examples/ examples/
COPY deploy/run.yaml deploy/run.yaml
RUN groupadd --system --gid 10001 streamrft \
    && useradd --system --uid 10001 --gid streamrft --create-home --home-dir /home/streamrft streamrft \
    && mkdir runs \
    && chown streamrft:streamrft runs

USER 10001:10001
# monitor.http_port as the compose file and the manifests set it: /healthz, /readyz, /metrics
EXPOSE 9400
ENTRYPOINT ["streamrft"]
CMD ["--help"]
