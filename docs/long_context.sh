#!/bin/bash
# The 30-turn context measurement (docs/training.md, "Long episodes"): the first RL step of
# configs/context_textcraft.py:local,long with rollout.context=full and with mask_observations,
# from the same policy, then a table of what each step logged. The policy is the ws60 trial's
# warm start (60 SFT steps; `docs/rl_trials.sh ws60 --config.warm_start.steps=60` makes it), or
# the export given.
#
#   docs/long_context.sh [EXPORT]      # runs/long_context/{full,mask_observations}
#   OUT=docs/long_context docs/long_context.sh     # the table of the recorded runs only
set -euo pipefail
cd "$(dirname "$0")/.."
WARM=${1:-runs/trials/ws60/warm_start/export}
OUT=${OUT:-runs/long_context}
for context in full mask_observations; do
  if [ ! -s $OUT/$context/metrics.jsonl ]; then
    rm -rf $OUT/$context
    python launch/train.py --config=configs/context_textcraft.py:local,long \
      --workdir=$OUT/$context --config.model.name="$WARM" --config.env.options.max_depth=2 \
      --config.rollout.max_context=4096 --config.rollout.context=$context --config.steps=1 \
      --config.rollout.tasks_per_step=2 --config.checkpoint.every=0 \
      --config.checkpoint.export_hf=False
  fi
done
python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
keys = ("success", "turns", "context/peak_tokens", "context/rewrites", "context/tokens_saved",
        "time/rollout", "time/experience", "time/update")
print("| context | learner tokens / episode | " + " | ".join(keys) + " |")
print("|---" * (len(keys) + 2) + "|")
for context in ("full", "mask_observations"):
  metrics = json.loads((out / context / "metrics.jsonl").read_text().splitlines()[0])
  episodes = [json.loads(line) for line in
              (out / context / "trajectories" / "step_000001.jsonl").read_text().splitlines()]
  tokens = sum(sum(e.get("context_lengths", [e["num_tokens"]])) for e in episodes) / len(episodes)
  print(f"| {context} | {tokens:.0f} | " + " | ".join(f"{metrics[k]:.4g}" for k in keys) + " |")
PY
