# syntax=docker/dockerfile:1
# ktserve images: one Dockerfile, two variants, both installed by scripts/install.sh (the README's path).
#   docker build -t ktserve:gpu .                          attention on the GPU, routed experts on the CPU
#   docker build -t ktserve:cpu --build-arg VARIANT=cpu .  no GPU; with no config it serves the demo model
# docker-compose.yml builds and runs both; docs/docker.md explains how.

ARG VARIANT=gpu
# PyPI's torch==2.13.0 for Linux is a CUDA 13.0 build that brings its own CUDA libraries, so the base only
# has to match its major version (host driver >= 580). For a CUDA 12 driver build both from CUDA 12.8:
#   --build-arg CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
#   --build-arg GPU_TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
# kt-kernel 0.7 ships wheels for CPython 3.11 and 3.12 on glibc >= 2.35 only: Ubuntu 24.04 (3.12) and
# Debian 12 (3.11) both fit; Ubuntu 22.04's Python 3.10 does not.
ARG CPU_IMAGE=python:3.11-slim-bookworm
# Replaces the variant's base above, e.g. with a Debian image made locally where no registry serves one
# (deploy/build-cpu-image.sh). It must bring python3 (3.11 or 3.12) with venv and CA certificates.
ARG BASE_IMAGE=
ARG KTSERVE_TORCH=torch==2.13.0
# An extra package index for torch; pip takes the highest version, and a local build tag such as
# 2.13.0+cpu sorts above plain 2.13.0, so the index's build wins. Empty: PyPI's CUDA build.
ARG GPU_TORCH_INDEX=
ARG CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu

# FlashInfer (the gpu extra) compiles its attention kernels with nvcc on first use, so the GPU image carries
# the compiler and CUDA headers of the base's version (change both with CUDA_IMAGE: cuda-nvcc-12-8 ...).
ARG CUDA_JIT_PACKAGES="cuda-nvcc-13-0 cuda-cudart-dev-13-0 cuda-cccl-13-0"

FROM ${BASE_IMAGE:-${CUDA_IMAGE}} AS gpu-os
ARG CUDA_JIT_PACKAGES
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv gcc libc6-dev ${CUDA_JIT_PACKAGES} \
 && rm -rf /var/lib/apt/lists/*

FROM ${BASE_IMAGE:-${CPU_IMAGE}} AS cpu-os

# The torch index is set in these build-only stages so that it never reaches the served image.
FROM gpu-os AS gpu-toolchain
ARG GPU_TORCH_INDEX
ENV PIP_EXTRA_INDEX_URL=${GPU_TORCH_INDEX} \
    KTSERVE_EXTRAS=gpu

FROM cpu-os AS cpu-toolchain
ARG CPU_TORCH_INDEX
# gcc builds the decode kernel (engines/kt/experts/decode_kernel) in the build stage; the served image takes the
# built library with the source tree and needs no compiler
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
ENV PIP_EXTRA_INDEX_URL=${CPU_TORCH_INDEX} \
    KTSERVE_EXTRAS=

FROM ${VARIANT}-toolchain AS build
ARG KTSERVE_TORCH
ENV KTSERVE_VENV=/opt/ktserve/venv \
    KTSERVE_PYTHON=python3 \
    KTSERVE_TORCH=${KTSERVE_TORCH}
WORKDIR /opt/ktserve/src
# First only the files that decide what gets installed, so a code change does not reinstall torch.
COPY pyproject.toml ./
COPY scripts/install.sh scripts/
# Where pip must use a local index or proxy, pass its settings as a build secret (`--secret
# id=pip.conf,src=...`): read by these two RUN steps only, never stored in a layer.
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    bash scripts/install.sh "$KTSERVE_EXTRAS"
COPY . .
# The editable install maps the top-level packages present when it ran (none, above), so run it again
# with the code in place. Its up-to-date stamp would skip the run: drop it. Every dependency is already
# satisfied, so this only registers the package (seconds); `ktserve --help` proves it imports.
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    rm -f "$KTSERVE_VENV/.ktserve-install" \
 && bash scripts/install.sh "$KTSERVE_EXTRAS" \
 && "$KTSERVE_VENV/bin/ktserve" --help > /dev/null

FROM ${VARIANT}-os AS runtime
# A fixed high uid: no clash with host users, and numeric for orchestrators that check runAsNonRoot.
RUN useradd --system --no-log-init --uid 10001 --user-group --create-home --shell /usr/sbin/nologin ktserve \
 && mkdir -p /models /adapters /cache /config /data \
 && chown 10001:10001 /cache /data
COPY --from=build /opt/ktserve /opt/ktserve
ENV PATH=/opt/ktserve/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    API_HOST=0.0.0.0 \
    API_PORT=8000 \
    KTSERVE_CACHE_DIR=/cache \
    KTSERVE_DATA_DIR=/data \
    HF_HOME=/cache/huggingface \
    FLASHINFER_WORKSPACE_BASE=/cache
# Relative paths in configs (kt_optimize_rules/...) resolve against the source tree.
WORKDIR /opt/ktserve/src
USER 10001:10001
VOLUME ["/models", "/adapters", "/cache", "/data"]
EXPOSE 8000
# /health answers 503 while the model loads, which urlopen raises on; a large model takes many minutes.
# No --start-interval: builders older than Docker Engine 25 refuse it (podman 4 stops the build there).
HEALTHCHECK --interval=30s --timeout=10s --start-period=30m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('API_PORT', '8000'), timeout=8)"]
LABEL org.opencontainers.image.title="ktserve" \
      org.opencontainers.image.description="OpenAI-compatible server for DeepSeek MoE models with CPU/GPU expert offload" \
      org.opencontainers.image.licenses="Apache-2.0"
# Config by file (pass its path: `docker run ... ktserve:gpu /config/server.yaml`) or by API_* variables.
ENTRYPOINT ["ktserve", "serve"]
