#!/usr/bin/env bash
# Plan Llama-3 70B for 8 nodes of 8 H100s from any machine (no GPU needed: preset profile), look at the
# plan, and export it for Megatron-LM. Usage: examples/plan_70b_64gpus.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/meshplan-70b}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

plan llama3-70b --cluster 8x8xh100-80gb --global-batch-size 512 --seq-len 8192 -o "$OUT/plan.json" \
  --pareto "$OUT/pareto.png"
plan show "$OUT/plan.json" --timeline "$OUT/timeline.png"
plan export "$OUT/plan.json" --format megatron
# On the cluster, each node then runs:
#   torchrun --nnodes 8 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 \
#     -m meshplan.executor plan.json --steps 1000 --checkpoint-dir /shared/ckpt --resume
