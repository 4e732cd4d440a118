"""docs/config.md, the generated config reference, is current and covers every key."""

import importlib.util
import pathlib

from agentgym_jax import config

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def _reference():
  spec = importlib.util.spec_from_file_location("config_reference", DOCS / "config_reference.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _leaves(c, prefix=""):
  for key, value in c.items():
    if hasattr(value, "keys"):
      yield from _leaves(value, f"{prefix}{key}.")
    else:
      yield prefix + key


def test_the_page_is_current(monkeypatch):
  monkeypatch.undo()  # conftest's evaluation cache in tmp_path: the page has the real default.
  reference = _reference()
  assert reference.PAGE.read_text() == reference.render(), (
      "docs/config.md is stale: run `python docs/config_reference.py`")


def test_every_key_is_on_the_page_once_with_its_comment():
  reference = _reference()
  documented = dict(config.key_comments())
  leaves = list(_leaves(config.base_config()))
  assert set(leaves) <= set(documented)
  assert documented["model.remat"].startswith("What the backward pass recomputes")
  assert documented["rollout.max_new_tokens"] == "Per assistant turn."  # A trailing comment.
  page = reference.render()
  for key in leaves:
    group, _, name = key.rpartition(".")
    section = page.split(f"\n## {group or 'top level'}\n", 1)[1].split("\n## ", 1)[0]
    assert section.count(f"| `{name}` |") == 1, key
