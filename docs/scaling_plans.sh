#!/bin/bash
# Regenerates the tables of docs/scaling.md: Qwen2.5-7B-Instruct's update step and sampler
# compiled on abstract arrays over virtual CPU devices (python launch/plan.py).
# Per-device figures depend on the mesh, not on the chip, so the 16-device tables serve both
# v4-32 and v5e-16, and the 4-device sampler tables both v5p-8 (all 256 rows on its one host)
# and one 4-chip host of a pod (its 64 rows).
set -e
plan() {
  local devices=$1
  shift
  echo "\$ XLA_FLAGS=--xla_force_host_platform_device_count=$devices python launch/plan.py $*"
  XLA_FLAGS=--xla_force_host_platform_device_count=$devices \
      python launch/plan.py "$@" 2>/dev/null
  echo
}
cd "$(dirname "$0")/.."
# Update step: one optimizer step on 10,240-token rows (4,096 in the last two), flash attention,
# full remat; --micro_batch_rows: rows per forward/backward pass, gradients accumulated. The
# reference column is the KL's frozen reference (matmul weights in bf16).
plan 4 --mesh=1,4,1 --mesh=1,2,2 --mesh=1,1,4 --batch=4 --seq=10240
plan 4 --mesh=1,4,1 --batch=8 --seq=10240 --micro_batch_rows=4
plan 16 --mesh=1,16,1 --batch=16 --seq=10240
plan 16 --mesh=1,4,4 --batch=16 --seq=10240 --micro_batch_rows=4
plan 16 --mesh=1,4,4 --batch=16 --seq=4096 --micro_batch_rows=4
plan 16 --mesh=1,16,1 --batch=16 --seq=4096
# The fixed part of the update: one row per device at 128 and 1,024 tokens.
plan 16 --mesh=1,16,1 --batch=16 --seq=128
plan 16 --mesh=1,16,1 --batch=16 --seq=1024
# Sampler: an observation append (64 tokens against the whole cache), the first prompt (1024
# tokens against its own 1024 slots) and decode (512 tokens against the whole cache).
plan 4 --sampler_mesh=1,4,1 --sampler_mesh=1,1,4 --rows=256 --cache_slots=10240 --prefill=64
plan 4 --sampler_mesh=1,4,1 --rows=256 --cache_slots=10240 --prefill=1024 --prefill_window=1024
plan 4 --sampler_mesh=1,4,1 --sampler_mesh=1,1,4 --rows=64 --cache_slots=10240 --prefill=64
plan 4 --sampler_mesh=1,1,4 --rows=64 --cache_slots=10240 --prefill=1024 --prefill_window=1024
# In waves (rollout.wave_rows): v5p-8's one host in waves of 128 rows, reading the training
# parameters; a pod host's copy (--sampler_copy: matmul weights in bf16) in waves of 32 rows
# (v4-32) and 16 rows (v5e-16).
plan 4 --sampler_mesh=1,4,1 --rows=128 --cache_slots=10240 --prefill=64
plan 4 --sampler_mesh=1,4,1 --rows=128 --cache_slots=10240 --prefill=1024 --prefill_window=1024
plan 4 --sampler_mesh=1,1,4 --rows=64 --cache_slots=10240 --prefill=64 --sampler_copy
plan 4 --sampler_mesh=1,1,4 --rows=32 --cache_slots=10240 --prefill=64 --sampler_copy
plan 4 --sampler_mesh=1,1,4 --rows=32 --cache_slots=10240 --prefill=1024 --prefill_window=1024 \
    --sampler_copy
plan 4 --sampler_mesh=1,1,4 --rows=16 --cache_slots=10240 --prefill=64 --sampler_copy
plan 4 --sampler_mesh=1,1,4 --rows=16 --cache_slots=10240 --prefill=1024 --prefill_window=1024 \
    --sampler_copy
# LoRA on v5e-8 (one host, 8 chips of 16 GiB): rank-64 adapters on every projection, against
# full fine-tuning at the same size.
plan 8 --mesh=1,8,1 --mesh=1,4,2 --batch=8 --seq=4096 --lora_rank=64
plan 8 --mesh=1,8,1 --mesh=1,4,2 --batch=8 --seq=4096
# A split mesh: v5p-8 as 2 learner + 2 sampler chips, v5e-16 as 8 + 8 (full and LoRA).
plan 2 --mesh=1,2,1 --batch=4 --seq=10240 --micro_batch_rows=2
plan 2 --sampler_mesh=1,2,1 --rows=128 --cache_slots=10240 --prefill=64 --sampler_copy
plan 2 --sampler_mesh=1,2,1 --rows=64 --cache_slots=10240 --prefill=64 --sampler_copy
plan 8 --mesh=1,2,4 --batch=8 --seq=10240 --micro_batch_rows=4
plan 8 --mesh=1,2,4 --batch=8 --seq=4096 --micro_batch_rows=4 --lora_rank=64
plan 8 --sampler_mesh=1,2,4 --rows=64 --cache_slots=10240 --prefill=64 --sampler_copy
plan 8 --sampler_mesh=1,2,4 --rows=32 --cache_slots=10240 --prefill=64 --sampler_copy
