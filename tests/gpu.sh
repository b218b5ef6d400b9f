#!/usr/bin/env bash
# One command for a GPU machine: the GPU-only tests, every concept's --bench, and a short training run,
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

section "GPU tests (pytest -m gpu)" 150 python -m pytest -q -m gpu tests/
for f in muonclip.py kda.py attnres.py; do
  [ -f "$f" ] && section "python $f --bench" 90 python "$f" --bench
done
section "Training run (default GPU config)" 150 python train.py --max_iters=600 --eval_interval=200 \
  --log_interval=50 --out_dir=out/gpu_run
echo "report: $REPORT"
