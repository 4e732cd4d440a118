#!/bin/bash
# The CPU learning result of the README: the embedded SmolLM2-135M-Instruct on TextCraft goals of
# crafting depth 1-2, evaluated greedily on the 72 held-out test goals after each stage
# (base -> SFT on oracle demonstrations of train goals -> GRPO on the depth-1 train goals with
# the staged horizon: turn caps 3, 5 and 8 for 4, 4 and 2 steps).
# Writes everything under runs/cpu/ and each stage's wall time to runs/cpu/times.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
R=runs/cpu
mkdir -p "$R" data
stage() {  # stage NAME COMMAND...: runs a stage, logs to $R/NAME.log, records its wall time.
  local name=$1 start
  shift
  start=$(date +%s)
  "$@" > "$R/$name.log" 2>&1
  echo "$name $(( $(date +%s) - start )) s" | tee -a "$R/times.txt"
}
EVAL=(python launch/evaluate.py --config=configs/grpo_textcraft.py:shallow,local
      --config.rollout.cache_dtype=bfloat16 --rows=72)

stage demos python launch/make_demos.py --env=textcraft --split=train --max_depth=2 \
    --out=data/textcraft_train_demos.jsonl
stage base_eval "${EVAL[@]}" --out=$R/base_eval.json --trajectories=$R/base_eval
stage sft python launch/train.py --config=configs/sft_textcraft.py:local --workdir=$R/sft \
    --config.steps=30 --config.optim.learning_rate=1e-4 --config.optim.warmup_steps=3 \
    --config.checkpoint.every=10
stage sft_eval "${EVAL[@]}" --model=$R/sft/export --out=$R/sft_eval.json \
    --trajectories=$R/sft_eval
stage grpo python launch/train.py --config=configs/grpo_textcraft.py:shallow,local \
    --workdir=$R/grpo --config.model.name=$R/sft/export --config.rollout.cache_dtype=bfloat16 \
    --config.env.options.max_depth=1 --config.algorithm.kl_coef=0 \
    --config.optim.learning_rate=2e-5 --config.steps=10 --config.rollout.tasks_per_step=2 \
    --config.horizon.every=4 --config.checkpoint.every=2
stage grpo_eval "${EVAL[@]}" --model=$R/grpo/export --out=$R/grpo_eval.json \
    --trajectories=$R/grpo_eval
python launch/plot.py --workdir=$R/sft --out_dir=$R/sft/plots
python launch/plot.py --workdir=$R/grpo --out_dir=$R/grpo/plots
