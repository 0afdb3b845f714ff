#!/usr/bin/env bash
# One prepared call on the lent GPU machine (an H200, 16 cores, no network): install the carried wheels offline, run
# the CUDA tests (tests/test_cuda.py, `pytest -m cuda`), then scripts/bench_gpu.py; everything it writes goes under
# $OUT (at most 8 files come back: env.txt, tests.log, cuda-tests.xml, bench.json, bench.log, summary.txt). The
# stages' time limits add up to under 8 minutes, so a second try fits a session's 15 minutes of device time.
#
# From the developer's machine, with the device tool:
#   scripts/gpu_wheels.sh                                         # once: the wheels that machine lacks (~3 MiB)
#   run(command="bash scripts/gpu_check.sh", carry=["gpu-wheels"], timeout_s=540)
# Anywhere (CI runs it):
#   scripts/gpu_check.sh --dry-run      # the plan: stages, limits, commands, the benchmark's shapes; no GPU, no install
# An A/B against an earlier commit in the same call (how a change's speed is claimed):
#   scripts/gpu_check.sh --prepare-ab REV                         # here: REV's hfport/, scripts/, tests/ into gpu-ab/
#   run(command="bash scripts/gpu_check.sh", carry=["gpu-wheels", "gpu-ab"], timeout_s=540)
# With gpu-ab/ present the benchmark stage runs the sections GPU_AB_SECTIONS names (default: inference, ~75 s a side
# on an H200) for REV, then for this tree (bench-base.json, bench-head.json), each side within GPU_AB_SIDE_S (120),
# instead of every section once; the tests get less time (they took 31-39 s on an H200). finetune adds ~70 s a side:
# GPU_AB_SECTIONS="finetune inference" GPU_AB_SIDE_S=170 GPU_TESTS_S=45 still fits (465 s).
#
# Environment: OUT (default ./gpu-out), PYTHON (python3), GPU_WHEELS (gpu-wheels), GPU_TESTS_S (110: the first run took 39 s), GPU_BENCH_S
# (260: the benchmark's budget; its stage gets 30 s more to write its report).
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
ab=${GPU_AB:-gpu-ab}
case "${1:-}" in
  --dry-run) dry=1 ;;
  --prepare-ab)
    rev=${2:?usage: scripts/gpu_check.sh --prepare-ab REV}
    rm -rf "$ab" && mkdir -p "$ab" || exit 1
    git archive "$rev" hfport scripts tests | tar -x -C "$ab" || exit 1
    git rev-parse --short "$rev" > "$ab/REVISION"
    echo "$ab: $(cat "$ab/REVISION")'s hfport/, scripts/, tests/ ($(du -sh "$ab" | cut -f1)); carry it with the call"
    exit 0 ;;
  "") ;;
  *) echo "usage: scripts/gpu_check.sh [--dry-run | --prepare-ab REV]" >&2; exit 2 ;;
esac
out=${OUT:-$PWD/gpu-out}
python=${PYTHON:-python3}
wheels=${GPU_WHEELS:-gpu-wheels}
tests_s=${GPU_TESTS_S:-110}
bench_s=${GPU_BENCH_S:-260}
install_s=30
env_s=20
mkdir -p "$out"
# offline, unbuffered; CUBLAS_WORKSPACE_CONFIG before CUDA starts: the deterministic-resume test needs it
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1 \
  TOKENIZERS_PARALLELISM=false CUBLAS_WORKSPACE_CONFIG=:4096:8

# -n 0: one process (pyproject's addopts would start two xdist workers: one GPU, one file, so a second worker's
# start-up would only eat into the stage's limit)
tests_cmd=("$python" -m pytest -m cuda tests/test_cuda.py -n 0 -q -rs -p no:cacheprovider --junitxml="$out/cuda-tests.xml")
# the benchmark with the tokenizers' own threads on (their default, and what users get): TOKENIZERS_PARALLELISM=false
# above is for pytest's forks; the third GPU run measured sentence-transformers 1.9x faster with the threads on
bench_cmd=(env -u TOKENIZERS_PARALLELISM "$python" scripts/bench_gpu.py --budget "$bench_s" --out "$out/bench.json")
base_cmd=()
if [ -d "$ab" ]; then  # A/B: two runs of the sections a change claims speed on, REV's first
  tests_s=${GPU_TESTS_S:-60}
  side_s=${GPU_AB_SIDE_S:-120}
  bench_s=$((2 * side_s))
  read -r -a ab_sections <<< "${GPU_AB_SECTIONS:-inference}"
  ab_args=(--sections "${ab_sections[@]}" --budget "$((side_s - 20))")
  base_cmd=(env -u TOKENIZERS_PARALLELISM "$python" "$ab/scripts/bench_gpu.py" "${ab_args[@]}" --out "$out/bench-base.json")
  bench_cmd=(env -u TOKENIZERS_PARALLELISM "$python" scripts/bench_gpu.py "${ab_args[@]}" --out "$out/bench-head.json")
fi
total=$((install_s + env_s + tests_s + bench_s + 30))
reports="bench.json"
[ "${#base_cmd[@]}" -gt 0 ] && reports="bench-base.json bench-head.json"

if [ "$dry" = 1 ]; then
  cat <<EOF
gpu_check.sh plan (dry run: nothing installed, no GPU used), limits adding up to $total s (under 480):
  1. install  ${install_s}s  pip install --no-index --no-deps --target /tmp/site $wheels/*.whl ($(ls "$wheels"/*.whl 2>/dev/null | wc -l) wheels here; scripts/gpu_wheels.sh fetches them)
  2. env      ${env_s}s  nvidia-smi, torch / CUDA / transformers versions, varlen_attn or not -> $out/env.txt
  3. tests    ${tests_s}s  ${tests_cmd[*]}
  4. bench    $((bench_s + 30))s  ${base_cmd[*]:+A/B against $(cat "$ab/REVISION" 2>/dev/null): ${base_cmd[*]}; then }${bench_cmd[*]}
  files back: env.txt tests.log cuda-tests.xml $reports bench.log summary.txt (under $out)
EOF
  if [ "$total" -ge 480 ]; then
    echo "gpu_check.sh: the limits add up to $total s, not under 8 minutes" >&2
    exit 1
  fi
  "$python" scripts/bench_gpu.py --dry-run --out "$out/bench-plan.json" > /dev/null || exit 1
  echo "  bench plan: $out/bench-plan.json"
  exit 0
fi

started=$(date +%s)
stage() { echo "== $1 ($(( $(date +%s) - started )) s in)" | tee -a "$out/summary.txt"; }

stage "1. install the carried wheels"
if ls "$wheels"/*.whl > /dev/null 2>&1; then
  timeout "$install_s" "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl 2>&1 | tail -5 | tee -a "$out/summary.txt"
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no wheels under $wheels (run scripts/gpu_wheels.sh and carry the folder); the serve section will fail" \
    | tee -a "$out/summary.txt"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

stage "2. the machine"
{
  timeout 5 nvidia-smi 2>&1 | head -20
  timeout "$env_s" "$python" - <<'PY'
import importlib.metadata as m, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for p in ("transformers", "accelerate", "sentence-transformers", "fastapi", "pydantic", "uvicorn"):
    try:
        print(p, m.version(p))
    except m.PackageNotFoundError:
        print(p, "missing")
from hfport.nn import varlen
print("varlen_attn", "yes" if varlen.VARLEN_ATTN is not None else "no (padded SDPA fallback)")
PY
} > "$out/env.txt" 2>&1
tail -4 "$out/env.txt" | tee -a "$out/summary.txt"

stage "3. CUDA tests"
timeout "$tests_s" "${tests_cmd[@]}" > "$out/tests.log" 2>&1
tests_rc=$?
tail -15 "$out/tests.log" | tee -a "$out/summary.txt"
echo "tests exit $tests_rc (124: stopped at ${tests_s}s)" | tee -a "$out/summary.txt"

stage "4. benchmark"
if [ "${#base_cmd[@]}" -gt 0 ]; then
  echo "A/B: $(cat "$ab/REVISION") first, then this tree" | tee -a "$out/summary.txt"
  timeout "$side_s" "${base_cmd[@]}" > "$out/bench.log" 2>&1
  base_rc=$?
  timeout "$side_s" "${bench_cmd[@]}" >> "$out/bench.log" 2>&1
  bench_rc=$?
  [ "$base_rc" = 0 ] || bench_rc=$base_rc
else
  timeout $((bench_s + 30)) "${bench_cmd[@]}" > "$out/bench.log" 2>&1
  bench_rc=$?
fi
tail -5 "$out/bench.log" | tee -a "$out/summary.txt"
echo "bench exit $bench_rc" | tee -a "$out/summary.txt"
stage "done"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
