# The serving image. GPU by default: PyPI's torch is a CUDA build (it also runs on the CPU).
# A CPU-only, much smaller image: --build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index (its /whl/cpu URL)>
# Bake ImageNet weights in at build time: --build-arg BAKE_WEIGHTS=true (needs network at build time).
# No C++ compiler (about 370 MB less, and no --compile): --build-arg COMPILER=false.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS builder
ARG TORCH_INDEX_URL=""
ARG BAKE_WEIGHTS=false
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TORCH_HOME=/opt/torch PATH=/opt/venv/bin:$PATH
COPY pyproject.toml README.md /src/
COPY client /src/client
COPY server /src/server
# One RUN, one layer: on copy-on-write-less storage (vfs) every layer is a full copy of torch.
RUN python -m venv /opt/venv && mkdir -p /opt/torch \
 && if [ -n "$TORCH_INDEX_URL" ]; then pip install torch torchvision --index-url "$TORCH_INDEX_URL"; fi \
 && pip install "/src[server,tracing]" \
 && if [ "$BAKE_WEIGHTS" = "true" ]; then \
      python -c "from torchvision.models import ResNet18_Weights as W; W.IMAGENET1K_V1.get_state_dict(progress=False)"; \
    fi

FROM ${BASE_IMAGE} AS runtime
# Metadata first and the two large copies last, so no layer after them copies torch again.
# g++: --compile builds its kernels at start-up (inductor's C++ on the CPU, Triton's launchers on CUDA). It adds
# about 370 MB; --build-arg COMPILER=false leaves it out (then --compile fails at start-up, saying why).
# /var/cache/resnet: the place for --compile-cache; a volume mounted there (compose's) starts out owned by resnet.
# tini runs as PID 1 (the ENTRYPOINT): it passes docker stop's SIGTERM on from the first instant (a PID 1 with no
# handler yet ignores it) and reaps orphans (inductor's compile workers after an engine dies) that would otherwise
# pile up as zombies.
ARG COMPILER=true
RUN apt-get update -q \
 && apt-get install -y -q --no-install-recommends tini $([ "$COMPILER" = "true" ] && echo g++) \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --create-home resnet \
 && mkdir -p /var/cache/resnet && chown resnet:resnet /var/cache/resnet
ENV PATH=/opt/venv/bin:$PATH \
    TORCH_HOME=/opt/torch \
    PYTHONUNBUFFERED=1 \
    RESNET_SERVER_HOST=0.0.0.0 \
    RESNET_SERVER_PORT=50051 \
    RESNET_SERVER_HTTP_PORT=8080 \
    RESNET_SERVER_METRICS_PORT=8000
EXPOSE 50051 8080 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["resnet-client", "health", "--server", "127.0.0.1:50051", "--timeout", "3"]
ENTRYPOINT ["tini", "--", "resnet-server"]
USER resnet
COPY --from=builder /opt/venv /opt/venv
# TORCH_HOME: writable by the server (weights download there once); compose mounts a volume on it.
COPY --from=builder --chown=resnet:resnet /opt/torch /opt/torch
