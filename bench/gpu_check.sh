#!/usr/bin/env bash
# GPU checks of the torch model runner, for a machine with CUDA (finishes in < 5 min):
#   1. pytest -m gpu          (CUDA IPC KV cache mapped by a spawned peer)
#   2. tests/engine/runner/test_model.py    with KVDRAIN_TEST_DEVICE=cuda (paged == dense, runner, transfer)
#   3. bench/model_step.py --device cuda   (paged vs dense contiguous cache, medium preset)
#   4. with a vLLM venv ($KVDRAIN_VLLM_VENV, else .venv-vllm: `make vllm` installs PyPI's
#      CUDA vllm on a GPU host): kvdrain replay examples/pd_idle.jsonl --engine vllm (P/D,
#      one GPU per instance where there are two, else sharing one); skipped without it
# then prints one summary table. Python: $KVDRAIN_PYTHON, else .venv/bin/python, else
# python3 -- the first whose torch sees CUDA; with none and no .venv, it creates .venv.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT

has_cuda() {
  [ -n "$1" ] && "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    >/dev/null 2>&1
}

pick_python() {
  for candidate in "${KVDRAIN_PYTHON:-}" .venv/bin/python python3; do
    if has_cuda "$candidate"; then echo "$candidate"; return 0; fi
  done
  return 1
}

PY=$(pick_python)
if [ -z "$PY" ] && [ ! -e .venv ]; then
  echo "creating .venv (system site-packages visible, so an installed CUDA torch is reused)"
  python3 -m venv --system-site-packages .venv && .venv/bin/pip install -q -e '.[test,model]'
  PY=$(pick_python)
fi
if [ -z "$PY" ]; then
  echo "error: no Python whose torch sees CUDA (tried \$KVDRAIN_PYTHON, .venv, python3)" >&2
  exit 1
fi
"$PY" -c 'import msgpack, pytest' || { echo "error: $PY lacks msgpack or pytest" >&2; exit 1; }
echo "python: $PY  $("$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())')"

ROWS=()
FAILED=0
run_step() {  # name, timeout seconds, command...
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  local took=$(( $(date +%s) - start ))
  local summary
  summary=$(grep -E "passed|failed|error|skipped|deselected" "$LOGS/$name.log" | tail -n 1)
  if [ "$rc" -eq 0 ]; then status=ok; else status="FAIL rc=$rc"; FAILED=1; fi
  [ "$rc" -eq 124 ] && status="TIMEOUT ${limit}s"
  ROWS+=("$(printf '%-22s %-14s %5ss  %s' "$name" "$status" "$took" "${summary:-}")")
  if [ "$rc" -ne 0 ]; then echo "---- $name (last 40 lines)"; tail -n 40 "$LOGS/$name.log"; fi
}

run_step pytest-gpu 120 "$PY" -m pytest -p no:cacheprovider -m gpu tests/
run_step test_model-cuda 150 env KVDRAIN_TEST_DEVICE=cuda \
  "$PY" -m pytest -p no:cacheprovider tests/engine/runner/test_model.py
run_step bench-model_step 150 "$PY" bench/model_step.py --device cuda
VLLM_VENV=${KVDRAIN_VLLM_VENV:-.venv-vllm}
if [ -x "$VLLM_VENV/bin/vllm" ]; then
  run_step replay-engine-vllm 600 "$PY" -m cli replay examples/pd_idle.jsonl --engine vllm \
    --vllm-venv "$VLLM_VENV" --no-live
  grep -E "ready in|launch to ready|VERIFIED|VIOLATION|INCONCLUSIVE|fault" \
    "$LOGS/replay-engine-vllm.log" | sed 's/^/  vllm | /'
else
  ROWS+=("$(printf '%-22s %-14s %5s   %s' replay-engine-vllm skipped - "no $VLLM_VENV (make vllm)")")
fi

echo
printf '%-22s %-14s %6s  %s\n' check result time detail
printf '%s\n' "${ROWS[@]}"
grep -E "^(model_step:|phase|decode|prefill)" "$LOGS/bench-model_step.log" | sed 's/^/  bench | /'
exit "$FAILED"
