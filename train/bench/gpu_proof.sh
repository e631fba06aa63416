#!/usr/bin/env bash
# One call on a machine with one NVIDIA GPU: every GPU path of trainbox run for real, the figures written as JSON
# after each step (a call cut off by its time limit still leaves the steps it finished).
#
#   bash train/bench/gpu_proof.sh OUT            on the GPU machine, from the checkout (539 s on one H200, 2026-11-30;
#                                                the tests took 161 s of it, the bench 303 s)
#   bash train/bench/gpu_proof.sh OUT --dry-run  on a CPU: every step's command, checked to start, none measured
#
# Steps, in this order: (1) the GPU-marked tests, with a time limit; (2) make bench's GPU rows: ResNet-50 at 224 px,
# bf16, channels_last, synthetic data on the device, trainbox vs the bare loop (target >= 0.97) and its images/s,
# then real JPEGs the bench makes, decoded by the loader workers and by --decode gpu, against that (target >= 0.90
# for the better), and the per-step cost of --model-ema and Mixup/CutMix on the GPU; (3) an exact resume on the
# one GPU at a 4-worker-equivalent global batch (--grad-accum 4, --deterministic): stopped and resumed, model.pt
# bit-identical to the uninterrupted run; (4) a --task segmentation run on the GPU; (5) FSDP2 on NCCL where 2 GPUs or
# more are visible (gpt-small, bf16, sharded checkpoints, stopped and resumed). OUT/gpu_proof.json holds each
# step's result with the device, the date and the commit; OUT/bench/bench.json and OUT/gpu-tests.xml the details.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?give the output folder: bash train/bench/gpu_proof.sh OUT [--dry-run]}
DRY=${2:-}
# A GPU machine without `make setup` (no network for the lock): its own python3, which holds torch, stands in for
# .venv, so that the tests of `make train`'s refusals find the environment the Makefile runs.
if [ "$DRY" != "--dry-run" ] && [ ! -e .venv/bin/python ] && python3 -c 'import torch' 2>/dev/null; then
  mkdir -p .venv/bin && printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > .venv/bin/python &&
    chmod +x .venv/bin/python && touch .venv/.installed-cu130
fi
PY=${PY:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}
# Every step runs `python -m` from the checkout's root (cd above), which puts the checkout's train/ and tests/ first
# on sys.path, installed or not; the tests' own processes get it from tests/helpers.py's env_for_tests.
mkdir -p "$OUT"
RESULT="$OUT/gpu_proof.json"

note() {  # note STEP STATUS SECONDS [DETAIL]: the step's line in gpu_proof.json, written at once
  "$PY" - "$RESULT" "$@" <<'EOF'
import json, subprocess, sys, time
from pathlib import Path
path, step, status, seconds, *detail = sys.argv[1:]
record = json.loads(Path(path).read_text()) if Path(path).is_file() else {}
if not record:
    import torch
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (dry run)",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "commit": commit or None, "steps": {}}
record["steps"][step] = {"status": status, "seconds": float(seconds), **({"detail": detail[0]} if detail else {})}
Path(path).write_text(json.dumps(record, indent=1) + "\n")
EOF
}

step() {  # step NAME LIMIT_S COMMAND...: run it (or, with --dry-run, check it starts) and note how it ended
  local name=$1 limit=$2; shift 2
  local started=$SECONDS
  echo "gpu proof: $name" >&2
  if [ "$DRY" = "--dry-run" ]; then
    "$@" --help >/dev/null 2>&1 && note "$name" "dry run: starts" 0 || note "$name" "dry run: does not start" 0
    return
  fi
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local code=$?
  note "$name" "$([ $code -eq 0 ] && echo ok || { [ $code -eq 124 ] && echo "cut at ${limit} s" || echo "exit $code"; })" \
    $((SECONDS - started)) "$(tail -c 300 "$OUT/$name.log" | tr '\n' ' ')"
}

step gpu-tests 210 "$PY" -m pytest -m gpu -n 0 -p no:cacheprovider -q --junitxml "$OUT/gpu-tests.xml" \
  tests/e2e/test_gpu.py tests/unit/test_telemetry.py
step bench 330 "$PY" -m train.bench --gpu-only --rounds 2 --gpu-knobs jpeg,ema,mixup --out "$OUT/bench"
# The exact resume: one GPU, the global batch of 4 workers x 16 (--grad-accum 4), deterministic kernels.
EXACT=(--preset debug --device cuda --deterministic --grad-accum 4 --max-steps 24 --save-every 6 --eval-every 12)
exact() {
  rm -rf "$OUT/exact-a" "$OUT/exact-b"
  "$PY" -m train "${EXACT[@]}" --run-dir "$OUT/exact-a" &&
    { "$PY" -m train "${EXACT[@]}" --stop-at 13 --run-dir "$OUT/exact-b"; [ $? -eq 75 ]; } &&
    "$PY" -m train "${EXACT[@]}" --run-dir "$OUT/exact-b" &&
    cmp "$OUT/exact-a/model.pt" "$OUT/exact-b/model.pt" && echo "model.pt bit-identical after a stop and resume"
}
if [ "$DRY" = "--dry-run" ]; then
  "$PY" -m train "${EXACT[@]}" --dry-run >/dev/null 2>&1 && note exact-resume "dry run: plans" 0 ||
    note exact-resume "dry run: refused (needs a GPU)" 0
else
  started=$SECONDS
  exact > "$OUT/exact-resume.log" 2>&1
  note exact-resume "$([ $? -eq 0 ] && echo ok || echo failed)" $((SECONDS - started)) \
    "$(tail -c 300 "$OUT/exact-resume.log" | tr '\n' ' ')"
fi
# --task segmentation on the GPU: torchvision's LRASPP in bf16 on the shapes' masks, evaluated at every 50 steps.
step segmentation 90 "$PY" -m train --task segmentation --device cuda --max-steps 100 --eval-every 50 \
  --run-dir "$OUT/segmentation"
# FSDP2 on NCCL, where 2 GPUs or more are visible (NCCL takes one GPU per rank; with one, noted and not run):
# gpt-small sharded over up to 4 GPUs in bf16, each worker saving its shards, stopped at step 30 and resumed by the
# same command, then 10 steps replicated (DDP) on as many: metrics.jsonl's first_step holds each one's model state
# per worker.
SEEN=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
SPREAD=(--task lm --model gpt-small --device cuda --precision bf16 --spawn $((SEEN > 4 ? 4 : SEEN)) --eval-every 30)
sharded() {
  rm -rf "$OUT/fsdp" "$OUT/ddp"
  local fsdp=("${SPREAD[@]}" --parallel fsdp --checkpoint-format sharded --max-steps 60 --save-every 30)
  { "$PY" -m train "${fsdp[@]}" --stop-at 30 --run-dir "$OUT/fsdp"; [ $? -eq 75 ]; } &&
    "$PY" -m train "${fsdp[@]}" --run-dir "$OUT/fsdp" &&
    "$PY" -m train "${SPREAD[@]}" --max-steps 10 --run-dir "$OUT/ddp" &&
    grep -h first_step "$OUT/fsdp/metrics.jsonl" "$OUT/ddp/metrics.jsonl"
}
if [ "$DRY" = "--dry-run" ]; then
  note fsdp "dry run: not planned (needs 2 GPUs or more)" 0
elif [ "$SEEN" -lt 2 ]; then
  note fsdp "not run: $SEEN GPU visible, FSDP2 on NCCL needs 2 or more" 0
else
  started=$SECONDS
  timeout 240 bash -c "$(declare -p PY OUT SPREAD); $(declare -f sharded); sharded" > "$OUT/fsdp.log" 2>&1
  note fsdp "$([ $? -eq 0 ] && echo ok || echo failed)" $((SECONDS - started)) \
    "$(tail -c 600 "$OUT/fsdp.log" | tr '\n' ' ')"
fi
cat "$RESULT"
