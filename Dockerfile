# bulkgen service image: the OpenAI-compatible Files + Batches API, with an embedded Ray runtime
# (or joining a cluster via RAY_ADDRESS / --ray-address).
#
# CPU (default):   docker build -t bulkgen:cpu .
# NVIDIA GPUs:     docker build -t bulkgen:cuda \
#                    --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#                  then run with the NVIDIA container toolkit: docker run --gpus all ...
#                  (or base on nvidia/cuda:*-runtime with Python 3.11 if the wheel's bundled CUDA
#                  libraries do not match the host driver).
# Storage:         -e BULKGEN_STORAGE=s3://bucket/prefix [-e AWS_ENDPOINT_URL=http://minio:9000]
#                  default is the /data volume.

ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    BULKGEN_STORAGE=/data \
    HF_HUB_OFFLINE=1

RUN groupadd --gid 1000 bulkgen \
 && useradd --uid 1000 --gid bulkgen --create-home --shell /usr/sbin/nologin bulkgen \
 && mkdir -p /data /app \
 && chown bulkgen:bulkgen /data

# torch first and pinned: the biggest layer, cached across code changes, and never an unpinned CUDA pull.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /app
COPY . /app
# The bundled model (bulkgen/models/bundled) is package data, so a plain install finds it.
RUN pip install . && bulkgen --version

USER bulkgen
VOLUME ["/data"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

ENTRYPOINT ["bulkgen"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
