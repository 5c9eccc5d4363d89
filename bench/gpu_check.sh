#!/usr/bin/env bash
# The GPU check (docs/gpu.md): install from a wheelhouse, run the CUDA lane, then the GPU benchmarks.
#
#   bench/gpu_check.sh [--wheelhouse DIR] [--tokenizer DIR] [--out DIR] [--python PY] [--cpu-dry-run]
#
#   --wheelhouse DIR  pip install --no-index --find-links DIR -e '.[test,bench,inspect]' first (make gpu-bundle)
#   --tokenizer DIR   the embedded tokenizer's files (make gpu-bundle): random-weight models build from it alone
#                     (default .gpu/tokenizer where it exists, else the embedded model's)
#   --out DIR         where the results go (default $OUT, else ./gpu-out); also copied to bench/results/
#   --python PY       the Python whose torch is the node's (default python3)
#   --cpu-dry-run     every part at toy size on the CPU, to catch bugs before device time is spent
#
# Writes 8 files, gpu_*.json / gpu_*.md naming the GPU: gpu_lane.md, gpu_env.json, gpu_grpo.{json,md},
# gpu_route.{json,md}, gpu_summary.md, and gpu_logs.tar.gz (every step's whole log, for what went wrong: the
# device tool brings back 8 files). Budgets (seconds, for one H100; override by environment): install 90,
# lane 240 (pytest -m cuda, in parallel where pytest-xdist is installed; 192 s with -n 8 on an H200), GRPO vs
# TRL 150, route 45: about 8 min. On the H200 (2026-11-27) the install took 35 s, and GRPO's 150 s held agl's
# step at the 135M shape only (GRPO_S=600 alone for all three shapes and TRL).
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELHOUSE="" TOKENIZER="" OUT_DIR="${OUT:-}" PY=python3 DRY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --wheelhouse) WHEELHOUSE="$2"; shift 2 ;;
        --tokenizer) TOKENIZER="$2"; shift 2 ;;
        --out) OUT_DIR="$2"; shift 2 ;;
        --python) PY="$2"; shift 2 ;;
        --cpu-dry-run) DRY="--cpu-dry-run"; shift ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
OUT_DIR="${OUT_DIR:-gpu-out}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
[ -z "$TOKENIZER" ] && [ -d .gpu/tokenizer ] && TOKENIZER=.gpu/tokenizer
TOKENIZER_ARG=()
[ -n "$TOKENIZER" ] && TOKENIZER_ARG=(--tokenizer "$(cd "$TOKENIZER" && pwd)")
LOGS="$(mktemp -d)"
export PYTHONPATH="$PWD" AGL_CACHE="${AGL_CACHE:-$LOGS/cache}" CUBLAS_WORKSPACE_CONFIG=":4096:8"
# model=tiny and the shapes build from the tokenizer's files (conf/model/smollm2.yaml, tests/conftest.py)
[ -n "$TOKENIZER" ] && export AGL_TOKENIZER="${TOKENIZER_ARG[1]}"
INSTALL_S="${INSTALL_S:-90}" LANE_S="${LANE_S:-240}" GRPO_S="${GRPO_S:-150}" ROUTE_S="${ROUTE_S:-45}"
started=$SECONDS
say() { echo "[gpu_check $((SECONDS - started))s] $*"; }

# 1. install (offline): the node keeps its own torch (its transformers, 5.17, is below agl's floor: 5.24 travels)
if [ -n "$WHEELHOUSE" ]; then
    say "installing from $WHEELHOUSE"
    if ! timeout "$INSTALL_S" "$PY" -m pip install --quiet --no-index --find-links "$WHEELHOUSE" \
        -e '.[test,bench,inspect]' >"$LOGS/install.log" 2>&1; then
        tail -20 "$LOGS/install.log"
        printf '# GPU check: the install failed\n\n```\n%s\n```\n' "$(tail -30 "$LOGS/install.log")" \
            >"$OUT_DIR/gpu_summary.md"
        exit 1
    fi
fi
"$PY" -c "import torch, agl; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 1

# The shapes' random weights are built on the CPU into the model cache meanwhile (no GPU: the lane is not timed)
if [ -z "$DRY" ]; then
    "$PY" -c "
import sys
from bench.common import model_config
from agl.policy.weights import resolve_model_path
for shape in sys.argv[2:]:
    cfg = model_config(shape)
    resolve_model_path(cfg.path, cfg.cache_dir, cfg.tiny, sys.argv[1] or None)
" "${TOKENIZER_ARG[1]:-}" shape_smollm2_135m shape_qwen25_05b shape_qwen25_15b >"$LOGS/build.log" 2>&1 &
    BUILD_PID=$!
fi

# 2. the CUDA lane: every test that takes `device`, on cuda, and tests/test_cuda.py (on a CPU: all skip)
say "the CUDA lane"
PARALLEL=()
"$PY" -c "import xdist" 2>/dev/null && PARALLEL=(-n 8)
# -v: each test's verdict is in the log as it ends, also when the budget stops the lane before its summary
timeout --kill-after=10 "$LANE_S" "$PY" -m pytest -v -rfE --tb=short --durations=25 -m cuda -p no:cacheprovider \
    -p no:benchmark "${PARALLEL[@]}" tests >"$LOGS/lane.log" 2>&1
lane_rc=$?
{
    echo "\`pytest -m cuda tests\` (${PARALLEL[*]:-one process}), exit code $lane_rc$([ $lane_rc = 124 ] && echo ': stopped at its budget')."
    echo
    echo '```'
    # the verdicts as they came (-v: "[gw3] [ 10%] FAILED tests/..."), then the summary if the lane got to it
    grep -E "(FAILED|ERROR) tests/|^=+ .*(passed|failed|error)" "$LOGS/lane.log" | tail -40
    echo '```'
} >"$OUT_DIR/gpu_lane.md"
tail -3 "$LOGS/lane.log"
[ -n "${BUILD_PID:-}" ] && { wait "$BUILD_PID" || tail -5 "$LOGS/build.log"; }

# 3. the benchmarks
say "env"
timeout 60 "$PY" bench/gpu_bench.py env --out "$OUT_DIR" $DRY >"$LOGS/env.log" 2>&1 || tail -20 "$LOGS/env.log"
say "GRPO vs TRL"
timeout $((GRPO_S + 15)) "$PY" bench/gpu_bench.py grpo --out "$OUT_DIR" --budget-s "$GRPO_S" "${TOKENIZER_ARG[@]}" \
    $DRY >"$LOGS/grpo.log" 2>&1 || tail -20 "$LOGS/grpo.log"
say "route decode"
timeout $((ROUTE_S + 30)) "$PY" bench/gpu_bench.py route --out "$OUT_DIR" --budget-s "$ROUTE_S" "${TOKENIZER_ARG[@]}" \
    $DRY >"$LOGS/route.log" 2>&1 || tail -20 "$LOGS/route.log"
"$PY" bench/gpu_bench.py summary --out "$OUT_DIR" $DRY

# 4. into the checkout's bench/results/ too (not a dry run's: no GPU figures)
if [ -z "$DRY" ] && [ -d bench/results ] && [ "$OUT_DIR" != "$PWD/bench/results" ]; then
    cp "$OUT_DIR"/gpu_*.json "$OUT_DIR"/gpu_*.md bench/results/ 2>/dev/null
fi
tar -czf "$OUT_DIR/gpu_logs.tar.gz" -C "$LOGS" --exclude=cache . 2>/dev/null
say "done: $(ls "$OUT_DIR" | tr '\n' ' ')"
[ "$lane_rc" = 0 ]
