"""One side of `benchmarks/rl_step.py --vs=REV`: RL steps of a config variant in a given tree.

  python benchmarks/rl_step_side.py TREE SPEC_JSON OUT_JSON

TREE is a checkout of the project (this one, or a git worktree of an earlier commit); its
`agentgym_jax` and `environments` are imported, not the installed ones. SPEC_JSON names the
config file and variant (`configs/grpo_textcraft.py:local`) and the keys set on top of it
("rollout.tasks_per_step": 4, ...); keys the tree's config does not have are skipped and listed.
OUT_JSON receives the per-step metrics `trainer.train` returned and the config it ran. Only the
API every commit since the first RL step has kept is used: `get_config(variant)` and
`trainer.train(config, workdir) -> list of metric rows`.
"""

import importlib.util
import json
import pathlib
import sys
import tempfile


def main(tree: str, spec_path: str, out_path: str) -> None:
  sys.path.insert(0, tree)
  from agentgym_jax import trainer  # pylint: disable=g-import-not-at-top

  spec = json.loads(pathlib.Path(spec_path).read_text())
  file, _, variant = spec["config"].partition(":")
  module_spec = importlib.util.spec_from_file_location("config_file", pathlib.Path(tree) / file)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  c = module.get_config(variant)
  skipped = []
  for key, value in spec["set"].items():
    *parents, leaf = key.split(".")
    node = c
    for parent in parents:
      node = node.get(parent) if node is not None else None
    if node is None or leaf not in node:
      skipped.append(key)
      continue
    node[leaf] = tuple(value) if isinstance(value, list) else value
  with tempfile.TemporaryDirectory() as workdir:
    history = trainer.train(c, pathlib.Path(workdir) / "run")
  pathlib.Path(out_path).write_text(
      json.dumps({"history": history, "config": c.to_dict(), "skipped": skipped}, default=float))


if __name__ == "__main__":
  main(*sys.argv[1:])
