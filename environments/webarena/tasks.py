"""WebArena task configs: loading, site placeholders, and the train/test split.

Tasks are in WebArena's task-config format, read from a directory: from its files named
<number>.json, one task each (what WebArena's scripts/generate_test_data.py writes into
config_files/ next to test.raw.json), or if there are none, from every *.json file, each one
task or a list of tasks (test.raw.json itself):

  {"task_id": 3, "sites": ["reddit"], "start_url": "__REDDIT__/f/books",
   "require_login": true, "storage_state": "./.auth/reddit_state.json",
   "intent": "Reply 'Count me in!' to the post about the meetup",
   "eval": {"eval_types": ["string_match", "url_match", "program_html"],
            "reference_answers": {"exact_match": "...", "must_include": [...],
                                  "fuzzy_match": [...] or "N/A"},
            "reference_url": "__REDDIT__/f/books/12 |OR| ...",
            "program_html": [{"url": "last" | "<url>", "locator": "<js expression>" | "",
                              "required_contents": {"exact_match": "..."} |
                                                   {"must_include": ["a |OR| b", ...]}}]}}

Site placeholders. WebArena's raw configs name their sites as __SHOPPING__, __REDDIT__,
__GITLAB__, ... and its scripts substitute the deployment's addresses. `Task.resolve` does the
same from a mapping such as {"SHOPPING": "http://10.0.0.5:7770"}; a task naming a site without an
address cannot start, and says which address is missing.

Login. A relative storage_state path (WebArena writes "./.auth/<site>_state.json") is resolved
against the parent of the config directory, WebArena's repository layout.

Helper functions. WebArena evaluates a few program_html targets with Python helpers named as
"func:..." strings. `reddit_get_post_url('__last_url__')` (a URL rewrite) and
`gitlab_get_project_memeber_role(__page__, name)` (a page query) are supported; the others call
the shopping site's admin REST API with WebArena's account credentials, so tasks using them are
skipped with a warning (`load_tasks` says which).

Splits. Task ids are the configs' task_id values. The test split is `test_task_ids` if given,
else the `num_test` ids whose sha256 ranks first (stable on every machine and process); the
train split is the rest. Both are sorted by task id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re
from typing import Any, Iterable, Mapping, Sequence

from absl import logging

EVAL_TYPES = ("string_match", "url_match", "program_html")
STRING_MATCH_KINDS = ("exact_match", "must_include", "fuzzy_match")
_PLACEHOLDER = re.compile(r"__([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*)__")
# The "func:" helpers we can evaluate without WebArena's site credentials (evaluators.py).
SUPPORTED_URL_FUNCS = re.compile(r"func:reddit_get_post_url\('__last_url__'\)")
SUPPORTED_LOCATOR_FUNCS = re.compile(r"func:gitlab_get_project_memeber_role\(__page__, '([^']*)'\)")


class TaskConfigError(ValueError):
  """A task config that is malformed or cannot be evaluated."""


class UnsupportedTask(TaskConfigError):
  """A well-formed task whose evaluation needs a helper we do not implement."""


@dataclasses.dataclass(frozen=True)
class Task:
  """One WebArena task, as read from its config (placeholders unresolved).

  Attributes:
    task_id: the config's task_id.
    config: the whole config, as parsed.
    source: the file it came from, for error messages.
  """

  task_id: int
  config: Mapping[str, Any]
  source: str

  @property
  def intent(self) -> str:
    return self.config["intent"]

  @property
  def sites(self) -> tuple[str, ...]:
    return tuple(self.config.get("sites") or ())

  @property
  def eval_types(self) -> tuple[str, ...]:
    return tuple(self.config["eval"]["eval_types"])

  def placeholders(self) -> set[str]:
    """The site names the task's strings refer to as __NAME__."""
    return set(_PLACEHOLDER.findall(json.dumps(self.config)))

  def resolve(self, site_urls: Mapping[str, str]) -> dict[str, Any]:
    """The config with every __SITE__ replaced by site_urls[SITE] (trailing "/" dropped)."""
    missing = sorted(self.placeholders() - set(site_urls))
    if missing:
      raise TaskConfigError(
          f"task {self.task_id} ({self.source}) needs the address of site(s) "
          f"{', '.join(missing)}; pass site_urls={{{', '.join(repr(m) for m in missing)}: "
          "'http://host:port', ...}")
    return _substitute(self.config, {name: url.rstrip("/") for name, url in site_urls.items()})

  def info(self) -> dict[str, Any]:
    """Metadata for `Env.task_info`; the category is the sites joined by "+"."""
    return {
        "category": "+".join(self.sites) or "webarena", "sites": list(self.sites),
        "intent": self.intent, "eval_types": list(self.eval_types),
        "start_url": self.config.get("start_url", "")
    }


def load_tasks(config_dir: str | pathlib.Path) -> dict[int, Task]:
  """Every supported task of `config_dir` (module docstring), by task id (ascending)."""
  directory = pathlib.Path(config_dir).expanduser()
  if not directory.is_dir():
    raise TaskConfigError(
        f"WebArena config directory {str(directory)!r} does not exist; point config_dir (or "
        "$WEBARENA_CONFIG_DIR) at a directory of WebArena task-config JSON files")
  tasks: dict[int, Task] = {}
  skipped: list[str] = []
  paths = sorted(directory.glob("*.json"))
  per_task = [path for path in paths if path.stem.isdigit()]
  for path in per_task or paths:
    try:
      loaded = json.loads(path.read_text())
    except (OSError, ValueError) as e:
      raise TaskConfigError(f"cannot read task config {path}: {e}") from None
    for config in loaded if isinstance(loaded, list) else [loaded]:
      try:
        task = validate(config, str(path))
      except UnsupportedTask as e:
        skipped.append(str(e))
        continue
      if task.task_id in tasks:
        raise TaskConfigError(f"task_id {task.task_id} is in both {tasks[task.task_id].source} "
                              f"and {path}")
      tasks[task.task_id] = task
  if skipped:
    logging.warning("WebArena: skipped %d task(s) of %s:\n%s", len(skipped), directory,
                    "\n".join(skipped))
  if not tasks:
    raise TaskConfigError(f"no WebArena task configs in {directory}")
  return dict(sorted(tasks.items()))


def validate(config: Any, source: str) -> Task:
  """Checks one config; raises TaskConfigError naming the task and the problem."""
  if not isinstance(config, dict):
    raise TaskConfigError(f"{source}: a task config must be a JSON object, got "
                          f"{type(config).__name__}")
  task_id = config.get("task_id")
  where = f"task {task_id!r} ({source})"
  if not isinstance(task_id, int) or isinstance(task_id, bool) or task_id < 0:
    raise TaskConfigError(f"{where}: task_id must be a non-negative integer")
  for key in ("intent", "start_url"):
    if not isinstance(config.get(key), str) or not config[key].strip():
      raise TaskConfigError(f"{where}: {key!r} must be a non-empty string")
  evaluation = config.get("eval")
  if not isinstance(evaluation, dict):
    raise TaskConfigError(f"{where}: 'eval' must be an object")
  eval_types = evaluation.get("eval_types")
  if not isinstance(eval_types, list) or not eval_types:
    raise TaskConfigError(f"{where}: eval.eval_types must be a non-empty list")
  for eval_type in eval_types:
    if eval_type not in EVAL_TYPES:
      raise TaskConfigError(f"{where}: unknown eval type {eval_type!r}; expected {EVAL_TYPES}")
  if "string_match" in eval_types:
    _check_reference_answers(evaluation.get("reference_answers"), where)
  if "url_match" in eval_types:
    reference = evaluation.get("reference_url")
    if not isinstance(reference, str) or not reference.strip():
      raise TaskConfigError(f"{where}: url_match needs a non-empty eval.reference_url")
    if evaluation.get("url_note", "GOLD in PRED") != "GOLD in PRED":
      raise TaskConfigError(f"{where}: unknown url_note {evaluation['url_note']!r}")
  if "program_html" in eval_types:
    _check_program_html(evaluation.get("program_html"), where)
  return Task(task_id, config, source)


def split(task_ids: Iterable[int], num_test: int,
          test_task_ids: Sequence[int] | None = None) -> dict[str, tuple[int, ...]]:
  """Train and test ids (module docstring), each ascending."""
  ids = sorted(task_ids)
  if test_task_ids is not None:
    unknown = sorted(set(test_task_ids) - set(ids))
    if unknown:
      raise ValueError(f"test_task_ids {unknown} are not among the loaded tasks")
    test = set(test_task_ids)
  else:
    if num_test < 0:
      raise ValueError(f"num_test must be >= 0, got {num_test}")
    ranked = sorted(ids, key=lambda i: hashlib.sha256(f"webarena test {i}".encode()).hexdigest())
    test = set(ranked[:num_test])
  return {
      "test": tuple(i for i in ids if i in test), "train": tuple(i for i in ids if i not in test)
  }


def _check_reference_answers(answers: Any, where: str) -> None:
  if not isinstance(answers, dict) or not answers:
    raise TaskConfigError(f"{where}: string_match needs eval.reference_answers as an object "
                          f"with some of {STRING_MATCH_KINDS}")
  for kind, value in answers.items():
    if kind not in STRING_MATCH_KINDS:
      raise TaskConfigError(f"{where}: unknown reference answer kind {kind!r}")
    valid = (isinstance(value, str) if kind == "exact_match" else _is_str_list(value)
             if kind == "must_include" else value == "N/A" or _is_str_list(value))
    if not valid:
      raise TaskConfigError(f"{where}: malformed reference_answers.{kind}: {value!r}")


def _check_program_html(targets: Any, where: str) -> None:
  if not isinstance(targets, list) or not targets:
    raise TaskConfigError(f"{where}: program_html needs a non-empty eval.program_html list")
  for target in targets:
    if not isinstance(target, dict) or not isinstance(target.get("url"), str):
      raise TaskConfigError(f"{where}: each program_html target needs a 'url' string")
    url, locator = target["url"], target.get("locator", "")
    if url.startswith("func:") and not SUPPORTED_URL_FUNCS.fullmatch(url):
      raise UnsupportedTask(f"{where}: program_html url {url!r} needs a WebArena helper")
    if not isinstance(locator, str):
      raise TaskConfigError(f"{where}: program_html locator must be a string")
    if locator.startswith("func:"):
      if not SUPPORTED_LOCATOR_FUNCS.fullmatch(locator):
        raise UnsupportedTask(f"{where}: program_html locator {locator!r} needs a WebArena "
                              "helper")
    elif locator.strip() and not locator.startswith(("document.", "[...document.")):
      raise TaskConfigError(f"{where}: unknown program_html locator {locator!r}")
    required = target.get("required_contents")
    valid = isinstance(required, dict) and len(required) == 1 and (isinstance(
        required.get("exact_match"), str) or _is_str_list(required.get("must_include")))
    if not valid:
      raise TaskConfigError(f"{where}: required_contents must be {{'exact_match': str}} or "
                            f"{{'must_include': [str, ...]}}, got {required!r}")
    prep = target.get("prep_actions", [])
    if not _is_str_list(prep, allow_empty=True):
      raise TaskConfigError(f"{where}: prep_actions must be a list of JS strings")


def _is_str_list(value: Any, allow_empty: bool = False) -> bool:
  return (isinstance(value, list) and (allow_empty or bool(value))
          and all(isinstance(v, str) for v in value))


def _substitute(value: Any, site_urls: Mapping[str, str]) -> Any:
  if isinstance(value, str):
    return _PLACEHOLDER.sub(lambda m: site_urls.get(m.group(1), m.group(0)), value)
  if isinstance(value, list):
    return [_substitute(v, site_urls) for v in value]
  if isinstance(value, dict):
    return {k: _substitute(v, site_urls) for k, v in value.items()}
  return value
