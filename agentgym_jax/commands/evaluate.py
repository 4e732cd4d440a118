r"""agentgym-eval: evaluates a policy on an environment split: success per category, Avg@k and
Pass@k.

  agentgym-eval --config=grpo_textcraft:local --model=runs/local/export \
      --config.eval.samples_per_task=4 --out=runs/local/eval.json

(From a checkout, `python launch/evaluate.py` with the same flags.) --model is a registry name
or a Hugging Face directory (e.g. a run's export/); by default the config's model. Sampling
follows the config's eval.* keys (greedy by default) and the turn cap is eval.horizon, or the
largest cap of the config's horizon schedule. --out and --trajectories are checked before the
evaluation is played.
"""

from absl import app, flags

from agentgym_jax import cli, evaluation, metrics, paths, recipe
from agentgym_jax import settings as settings_lib

_CONFIG = cli.define_config()
_MODEL = flags.DEFINE_string("model", None, "Registry name or HF directory; default: config's.")
_OUT = flags.DEFINE_string("out", None, "Write the summary as JSON here (local or gs://).")
_TRAJECTORIES = flags.DEFINE_string("trajectories", None,
                                    "Write the evaluation trajectories under this workdir.")
_ROWS = flags.DEFINE_integer("rows", 32, "Episodes played at once.")


def _evaluate() -> None:
  if _ROWS.value < 1:
    raise app.UsageError(f"--rows={_ROWS.value} must be > 0")
  settings = settings_lib.Settings.from_config(_CONFIG.value)
  if _OUT.value:
    cli.check_output_file(_OUT.value, f"--out={_OUT.value}")
  if _TRAJECTORIES.value:
    cli.directory_flag(_TRAJECTORIES.value, f"--trajectories={_TRAJECTORIES.value}")
  plan, bars = settings.evaluation, []

  def start(tasks: int):
    print(
        f"{tasks} {settings.env.name} tasks of the {plan.split} split, "
        f"k = {plan.samples_per_task} sample(s) each, up to {plan.horizon} turns", flush=True)
    bars.append(metrics.ProgressBar(tasks * plan.samples_per_task, unit="episode"))
    return lambda done, _: bars[0].update(done)

  summary, trajectories = recipe.evaluate_policy(settings, _MODEL.value, _ROWS.value, start)
  for bar in bars:
    bar.close()
  print(evaluation.format_table(summary))
  if _OUT.value:
    paths.replace_file(_OUT.value, evaluation.to_json(summary))
  if _TRAJECTORIES.value:
    metrics.TrajectoryWriter(_TRAJECTORIES.value).write(0, [t.to_json() for t in trajectories])


def main() -> None:
  """agentgym-eval."""
  cli.run(_evaluate)
