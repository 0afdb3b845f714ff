#!/usr/bin/env bash
# The wheels hfport needs that the lent GPU machine lacks, downloaded here into gpu-wheels/ (git-ignored), to travel
# with the device call (`carry: ["gpu-wheels"]`) and be installed there offline by scripts/gpu_check.sh: that machine
# has no network. It has Python 3.12 with torch 2.11 (CUDA 13), transformers, accelerate, sentence-transformers,
# peft, onnxruntime, pyarrow, typer, httpx, anyio, h11, click, uvloop, prometheus-client, psutil, pyyaml and tqdm
# (/work/.library/device/KINDS.md's list), and not the service's web stack. What comes, and why:
#
#   fastapi, starlette            the service (server/app.py) and its ASGI core
#   uvicorn                       the server process (scripts/bench_gpu.py's /embed clients talk to one)
#   python-multipart              fastapi imports it for the upload route (POST /jobs/finetune/upload)
#   pydantic, pydantic-core       not in the image (nothing there needs it); fastapi, the settings, the train config
#   annotated-types,              pydantic's own needs
#   typing-inspection
#   typing-extensions             pydantic 2.14 needs a newer one than an image may carry (one copy: this one)
#   pydantic-settings,            server/settings.py (HFPORT_* variables) and its .env reader
#   python-dotenv
#   annotated-doc                 fastapi's; the image has one, this pins the version fastapi was tested with here
#   opentelemetry-api             fastapi 0.165 imports it at import (fastapi/telemetry), whatever the app uses
#   swagger-ui-bundle-v2          server/routes/docs.py (/docs served locally); its jinja2 is in the image. Missing
#                                 from the first GPU call: `hfport serve` stopped at import (tests/test_gpu_check.py
#                                 now checks that every core dependency is here or in the image)
#
# The versions are this repository's venv's (the ones the test suite ran with); pydantic-core is the one compiled
# wheel (cp312, manylinux). Usage: scripts/gpu_wheels.sh [DEST] (default gpu-wheels); PYTHON=... picks the pip.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-gpu-wheels}
python=${PYTHON:-python3}
wheels=(
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 python-multipart==0.0.34
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  pydantic-settings==2.16.3 python-dotenv==1.2.4 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  swagger-ui-bundle-v2==5.31.0
)
# hfport's core dependencies the image already holds (KINDS.md's package list); tests/test_gpu_check.py checks that
# every core dependency in pyproject.toml is either here or in `wheels`
in_image=(torch safetensors huggingface-hub tokenizers numpy typer accelerate pyyaml tqdm psutil prometheus-client)
rm -rf "$dest"
mkdir -p "$dest"
# --no-deps: each need is named above (pip would otherwise resolve against this machine's Python, not 3.12's)
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest" "${wheels[@]}"
count=$(find "$dest" -name '*.whl' | wc -l)
if [ "$count" -ne "${#wheels[@]}" ]; then
  echo "gpu_wheels.sh: expected ${#wheels[@]} wheels in $dest, got $count" >&2
  exit 1
fi
bytes=$(du -sb "$dest" | cut -f1)
ls -1 "$dest"
echo "$count wheels, $((bytes / 1024)) KiB in $dest (the whole tree travels within 64 MiB)"
if [ "$bytes" -gt $((16 * 1024 * 1024)) ]; then
  echo "gpu_wheels.sh: $dest is over 16 MiB; the call carries 64 MiB in all" >&2
  exit 1
fi
