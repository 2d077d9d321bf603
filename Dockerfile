# The image deploy/k8s runs: the diffcache package, torch and the non-CUDA Mooncake wheel (on
# every machine: the store takes tensors through pinned host memory), with `diffcache` as the
# entrypoint.
#   docker build -t diffcache:cpu .
#   docker build -t diffcache:cu130 --build-arg TORCH_INDEX=cu130 .
# Debian 12, as the machines `make up` is tested on.
FROM python:3.11-slim-bookworm

# "cpu", or the CUDA build of torch's wheel index (cu130, ...).
ARG TORCH_INDEX=cpu
ARG TORCH_VERSION=2.13.0

# Mooncake's binaries link libibverbs even for TCP, and libcurl and libnuma; ibverbs-providers
# holds the RDMA drivers (libmlx5) that store.protocol=rdma needs, a recommendation that
# --no-install-recommends would drop. The CUDA runtime comes with torch's wheels; the driver
# comes from the node (NVIDIA container toolkit).
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers libcurl4 libnuma1 \
 && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# torch from its own index first, in a layer of its own: from PyPI an unpinned torch is the
# multi-GB CUDA build even for the CPU image, and this layer rarely changes.
RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_INDEX}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY keys keys
COPY config config
COPY cachesvc cachesvc
COPY supervision supervision
COPY uploads uploads
COPY encoders encoders
COPY workers workers
COPY admission admission
COPY api api
COPY cli cli
COPY bench bench
# torch first, as the workers import it; then what the API imports without torch. The
# storage node's binary must find every library it links.
RUN pip install . \
 && python -c "import torch, mooncake.store, workers.queue.scripts, api.app" \
 && ! ldd "$(python -c 'import mooncake, os; print(os.path.dirname(mooncake.__file__))')/mooncake_client" | grep 'not found'

# The manifests mount a volume at /data and run as this user; without one, /data is still
# writable.
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /data diffcache \
 && mkdir /data && chown diffcache:diffcache /data
USER 10001
WORKDIR /data
ENV HOME=/data \
    DIFFCACHE_DATA_DIR=/data

ENTRYPOINT ["diffcache"]
CMD ["--help"]
