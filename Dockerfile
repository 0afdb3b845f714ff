# The hfport service image: `hfport serve` with the job store, registry and runs under /data.
#   CPU (default):  docker build -t hfport .
#   CUDA:           docker build -t hfport:cuda --build-arg TORCH_VARIANT=cu128 .
#                   docker run --gpus all ...   (TORCH_VARIANT is the wheel index tag of the CUDA build to install)
#   run:            docker run -p 127.0.0.1:8000:8000 -v hfport-data:/data -e HFPORT_API_TOKEN=... hfport
#                   (without HFPORT_API_TOKEN the first start generates one, keeps it in /data/api_token and
#                   prints it once: the server refuses a non-loopback bind without a token)
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

# torch first, from the index of the chosen build, so the dependency resolution below keeps it
RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY hfport ./hfport
COPY server ./server
# editable, so server/static/ (the dashboard page, not a Python file) is served from /app/server as-is
RUN pip install -e . && python -c "import hfport, server.app; assert server.app.__file__.startswith('/app/')"

RUN useradd --create-home --uid 1000 hfport && mkdir -p /data && chown hfport /data
USER hfport
# inside the container the server must listen on all interfaces for -p to reach it; publish the port on the
# host's loopback (-p 127.0.0.1:8000:8000) or put a reverse proxy in front; the entry point makes sure a token is set
ENV HFPORT_HOST=0.0.0.0 HFPORT_PORT=8000 HFPORT_DATA_DIR=/data
VOLUME /data
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('HFPORT_PORT', '8000'), timeout=3)"
ENTRYPOINT ["python", "-m", "server.entrypoint"]
