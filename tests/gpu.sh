#!/usr/bin/env bash
# One command for a GPU machine: the GPU-only tests, the end-to-end test in bf16, every benchmark (bench.py),
# and a short training run,
# written to one markdown report. Budget: under 8 minutes on one H100/H200.
#
#   bash tests/gpu.sh [report.md]        # default report: out/gpu_report.md
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT="${1:-out/gpu_report.md}"
mkdir -p "$(dirname "$REPORT")" out
LOG=out/gpu_logs
mkdir -p "$LOG"

section() {  # section TITLE TIMEOUT_S CMD... : run CMD, append its output (or its failure) to the report
  local title="$1" limit="$2"; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$LOG/current.txt" 2>&1
  local rc=$?
  {
    echo "## $title"
    echo
    echo "\`$*\` — exit $rc, $(( $(date +%s) - t0 )) s"
    echo
    if grep -q "^|" "$LOG/current.txt"; then tail -80 "$LOG/current.txt"
    else echo '```'; tail -40 "$LOG/current.txt"; echo '```'; fi
    echo
  } >>"$REPORT"
}

{
  echo "# GPU check — $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
  python -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.version.cuda)"
  git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /'
  echo '```'
  echo
} >"$REPORT"

# flash-linear-attention, the speed anchor for KDA's benchmark: the GPU machine has no network, so its
# wheels travel with the working tree in wheels/ (git-ignored; fill it with the command in the README)
if ! python -c "import fla" 2>/dev/null && ls wheels/fla_core-*.whl >/dev/null 2>&1; then
  python -m pip install --quiet --no-index --no-deps wheels/fla_core-*.whl wheels/einops-*.whl \
    >"$LOG/fla_install.txt" 2>&1 || echo "fla install failed: see $LOG/fla_install.txt" >>"$REPORT"
fi
python -c "import fla; print('fla', fla.__version__, '(the benchmark anchor)')" >>"$REPORT" 2>&1 \
  || echo "fla: not installed, the KDA benchmark runs without the anchor" >>"$REPORT"
echo >>"$REPORT"

# time limits add up to 480 s, the 8-minute budget, even if every step runs to its limit
section "GPU tests (pytest -m gpu)" 90 python -m pytest -q -m gpu tests/
# every idea through Triton against the reference in bf16 autocast (tests/test_e2e.py, per-dtype
# tolerances); most of its limit is first-run JIT: ~1 s per kernel configuration, and the Newton-Schulz
# autotuner compiles its configs for each distinct matrix shape of the tiny model
section "End to end: Triton vs reference, bf16 (tests/test_e2e.py)" 80 python -m pytest -q -s tests/test_e2e.py
# every benchmark (bench.py, one section per op)
section "python bench.py muonclip" 45 python bench.py muonclip
section "python bench.py kda" 60 python bench.py kda
section "python bench.py attnres" 40 python bench.py attnres
section "python bench.py swarm" 10 python bench.py swarm
# the main job as a user runs it: the default GPU config (KKKA + block AttnRes + image rows + MuonClip)
section "Training run: python train.py (the default GPU config)" 150 python train.py --out_dir=out/gpu_run
section "Default run: text val loss still falling at the end (<= 5 epochs, no overfitting)" 5 \
  python tests/summarize_run.py out/gpu_run/log.jsonl --require_falling
echo "report: $REPORT"
