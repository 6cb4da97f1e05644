# bulkgen image: the OpenAI-compatible Files + Batches API (`bulkgen serve`), the inbox watcher
# (`bulkgen watch`) and Ray's own processes (KubeRay runs `ray start` in it), on Ray's official image.
#
# NVIDIA GPUs (default):  docker build -t bulkgen:0.1.0-cu128 .
#                         docker run --gpus all -p 127.0.0.1:8000:8000 --shm-size=4g bulkgen:0.1.0-cu128
# CPU only:               docker build --build-arg FLAVOR=cpu -t bulkgen:0.1.0-cpu .
# Storage:                -e BULKGEN_STORAGE=s3://bucket/prefix [-e AWS_ENDPOINT_URL=http://minio:9000];
#                         default is the /data volume.
#
# Every base is a pinned tag (Ray version, Python 3.11, CUDA 12.8 or CPU), and torch is pinned and taken
# from the wheel index that matches the base's CUDA, so a rebuild gets the same stack.

ARG RAY_VERSION=2.60.0
ARG FLAVOR=gpu

FROM rayproject/ray:${RAY_VERSION}-py311-cu128 AS gpu-base
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

FROM rayproject/ray:${RAY_VERSION}-py311-cpu AS cpu-base
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${FLAVOR}-base AS image
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    BULKGEN_STORAGE=/data \
    HF_HUB_OFFLINE=1

# Ray's images run as `ray` (uid 1000, gid 100) with their Python in ~/anaconda3: install there as that user.
USER root
RUN mkdir -p /data && chown 1000:100 /data
USER ray

# torch first and pinned: the biggest layer, cached across code changes, and never an unpinned CUDA pull.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# A regular (non-editable) install: the package, with the bundled model as package data, is copied into
# site-packages and the source is removed; the check proves the installed copy finds its model.
# Through the lock (requirements/lock.txt, torch left out): the image runs the releases CI tested.
COPY --chown=1000:100 pyproject.toml README.md /tmp/bulkgen-src/
COPY --chown=1000:100 requirements/lock.txt /tmp/bulkgen-src/requirements/lock.txt
COPY --chown=1000:100 bulkgen /tmp/bulkgen-src/bulkgen
RUN pip install -c /tmp/bulkgen-src/requirements/lock.txt /tmp/bulkgen-src \
 && rm -rf /tmp/bulkgen-src \
 && bulkgen --version \
 && python -c "from bulkgen.models.registry import BUNDLED_MODEL as m; assert (m / 'model.safetensors').is_file(), m"
COPY --chown=1000:100 samples /home/ray/samples

WORKDIR /home/ray
VOLUME ["/data"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

ENTRYPOINT ["bulkgen"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
