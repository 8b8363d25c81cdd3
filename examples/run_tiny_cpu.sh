#!/usr/bin/env bash
# Plan and run the tiny model on 4 CPU processes (pp2 x dp2, ZeRO-3; the planner picks the schedule and
# micro-batching), write metrics, survive a killed rank. Usage: examples/run_tiny_cpu.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/meshplan-tiny}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1

# The planner's plan for 4 CPU processes, pinned to pipeline x data parallelism with ZeRO-3. The first run
# measures tiny on this host's cores (a progress bar, tens of seconds; cached in $MESHPLAN_CACHE or
# ~/.cache/meshplan), so the prediction is this host's, not the CPU preset's.
plan tiny --cluster 4xcpu --pp 2 --dp 2 --zero 3 --seq-len 32 --global-batch-size 8 -o "$OUT/plan.json"

# 20 steps, a checkpoint every 5; rank 1 is killed at step 12 (fault injection for the demo) and
# torchrun restarts the job, which resumes from the step-10 checkpoint with the same losses.
MESHPLAN_FAIL_AT_STEP=12:1 torchrun --nproc-per-node 4 --max-restarts 1 -m meshplan.executor "$OUT/plan.json" \
  --steps 20 --metrics "$OUT/metrics.jsonl" --checkpoint-dir "$OUT/ckpt" --checkpoint-interval 5 --resume
tail -n 2 "$OUT/metrics.jsonl"
