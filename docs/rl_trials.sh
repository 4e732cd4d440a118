#!/bin/bash
# Recipe trials for the first command's RL stage (docs/rl_trials.md): every trial runs the RL
# stage of `configs/grpo_textcraft.py:local` from one shared warm start, with its own config
# overrides, and its policy is evaluated on the 72 held-out goals like the first command's.
#
#   docs/rl_trials.sh base                        # the first command itself, in runs/trials/base
#   docs/rl_trials.sh seq_mean --config.algorithm.aggregation=seq-mean-token-mean
#   docs/rl_trials.sh                             # only print the table of the trials so far
#
# The warm start is base's (the first command's own SFT); a trial copies its export, so the
# initial and warm-start evaluations come from the evaluation cache (eval.cache_dir) and only
# the RL policy is played. Each trial writes runs/trials/NAME/{args.txt,seconds,train.log}.
set -euo pipefail
cd "$(dirname "$0")/.."
T=runs/trials
CONFIG=configs/grpo_textcraft.py:local
if [ $# -gt 0 ]; then
  name=$1
  shift
  if [ "$name" != base ] && [ ! -f $T/base/warm_start/export/config.json ]; then
    echo "docs/rl_trials.sh: run 'docs/rl_trials.sh base' first: the trials share its warm start" >&2
    exit 2
  fi
  mkdir -p $T/$name
  if [ "$name" != base ] && [ ! -d $T/$name/warm_start/export ]; then
    mkdir -p $T/$name/warm_start
    cp -r $T/base/warm_start/export $T/$name/warm_start/export
  fi
  printf '%s\n' "$@" > $T/$name/args.txt
  start=$(date +%s)
  python launch/train.py --config=$CONFIG --workdir=$T/$name "$@" 2>&1 | tee $T/$name/train.log
  echo $(( $(date +%s) - start )) > $T/$name/seconds
fi
python docs/rl_trials.py $T
