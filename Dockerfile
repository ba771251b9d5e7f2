# CPN image: API server, agent and runtime in one.
#   CPU (default):  docker build -t cpn .
#   NVIDIA GPUs:    docker build --build-arg TORCH_VARIANT=cu128 -t cpn:cuda .
# TORCH_VARIANT names a PyTorch wheel index (cpu, cu126, cu128, ...): the CUDA wheels carry their own
# CUDA and NCCL libraries, so the image needs only the host's NVIDIA driver and container toolkit
# (`docker run --gpus all`, or the nvidia.com/gpu resource on Kubernetes). Check a GPU machine with
# `cpn bench gpu --json` (docs/gpus.md).
FROM python:3.11-slim
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
WORKDIR /app
RUN apt-get update && apt-get install -y --no-install-recommends iproute2 curl && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY cpn ./cpn
COPY layers ./layers
COPY migrations ./migrations
COPY web ./web
RUN pip install --no-cache-dir torch==${TORCH_VERSION} --index-url https://download.pytorch.org/whl/${TORCH_VARIANT} \
 && pip install --no-cache-dir -e .
ENV CPN_HOST=0.0.0.0 CPN_PORT=8080
EXPOSE 8080
CMD ["cpn", "serve"]
