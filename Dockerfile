# CPN image: API server, agent and runtime in one (CPU torch; mount your own for GPUs).
FROM python:3.11-slim
WORKDIR /app
RUN apt-get update && apt-get install -y --no-install-recommends iproute2 curl && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY cpn ./cpn
COPY layers ./layers
COPY migrations ./migrations
COPY web ./web
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install --no-cache-dir -e .
ENV CPN_HOST=0.0.0.0 CPN_PORT=8080
EXPOSE 8080
CMD ["cpn", "serve"]
