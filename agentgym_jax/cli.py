"""What the commands share: absl's app.run with bad input reported in one line, --help, quiet
logs, --config by name or path, and the flags of a model to chat with (`define_model_flags`).

A user's mistake (an unknown config key, an invalid value, a config that does not exist, a
workdir or output that cannot be written, a model whose weights are not on disk, an
environment that is not registered) ends the command with `error: ...` on stderr and exit
status 1, never a traceback; a traceback means a defect. Each command checks its inputs and
outputs before it loads a model or plays an episode. Library INFO logs (Orbax's checkpoint
manager, JAX's search for a TPU backend) are hidden unless --verbosity=0 or higher asks for
them.

--config (`define_config`) takes a packaged config's name (agentgym_jax.configs, the
repository's configs/ directory), e.g. `--config=grpo_textcraft:local`, or a config file's
path; --config.KEY=VALUE overrides a key, and the config's env.options take any keyword of the
environment's adapter (checked by settings.EnvSettings). --help exits 0 with the command's
docstring, its flags and the config's groups; --print_config prints the validated config.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import os
import re
import sys
import types
from typing import Any, Callable

import jax.numpy as jnp
import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from agentgym_jax import config as config_lib
from agentgym_jax import settings as settings_lib
from agentgym_jax import hardware, paths
from agentgym_jax.models import load_model, weights
from agentgym_jax.models.decoder import Decoder
from agentgym_jax.models.tokenizer import ChatTemplate, Tokenizer
from environments import base as env_base

_HELP_FLAGS = ("--help", "-help", "--helpshort", "-helpshort", "--helpfull", "-helpfull", "-?")


def config_groups() -> dict[str, str]:
  """The config's top-level keys and groups, as --help lists them: each with its comment in
  `base_config` (docs/config.md lists every key)."""
  return {key: text for key, text in config_lib.key_comments() if "." not in key}


def config_names() -> list[str]:
  """The packaged configs, by the name --config takes."""
  files = importlib.resources.files("agentgym_jax.configs")
  return sorted(file.name[:-3] for file in files.iterdir()
                if file.name.endswith(".py") and not file.name.startswith("_"))


def config_file(value: str) -> str:
  """The file --config names (its value without the variant): the path itself when it is a
  file, else the packaged config of that name ("grpo_textcraft" or "grpo_textcraft.py")."""
  if os.path.isfile(value):
    return value
  name = value.removesuffix(".py")
  packaged = importlib.resources.files("agentgym_jax.configs") / f"{name}.py"
  if "/" not in name and os.sep not in name and packaged.is_file():
    return str(packaged)
  raise ValueError(f"{value!r} is neither a config file nor a packaged config; the packaged "
                   f"configs: {', '.join(config_names())}")


class _ConfigParser(flags.ArgumentParser):
  """Loads --config from `config_file(...)` with ml_collections' own parser (`loader`). The
  config comes back locked but for env.options, whose keys are the adapter's own
  (settings.EnvSettings checks them against its constructor)."""

  def __init__(self, loader: flags.ArgumentParser):
    self._loader = loader

  def parse(self, argument: str) -> Any:
    file, colon, variant = argument.partition(":")
    config = self._loader.parse(config_file(file) + colon + variant)
    if isinstance(config, ml_collections.ConfigDict):
      config.lock()
      options = config.get("env", {}).get("options")
      if isinstance(options, ml_collections.ConfigDict):
        options.unlock()
    return config

  def flag_type(self) -> str:
    return self._loader.flag_type()


def define_config() -> flags.FlagHolder:
  """Defines --config (required: parse_flags refuses a command line without it) and
  --print_config for the calling command."""
  holder = config_flags.DEFINE_config_file(
      "config", None, "The experiment config: a packaged config's name (grpo_textcraft, ...) or "
      "a config file, with its variants after a colon (grpo_textcraft:local); --config.KEY=VALUE "
      "overrides a key.", lock_config=False, accept_new_attributes=True)
  flags.FLAGS["config"].parser = _ConfigParser(flags.FLAGS["config"].parser)
  flags.DEFINE_bool("print_config", False,
                    "Print the config (after overrides, validated), one key a line, and exit.")
  return holder


def format_config(c: ml_collections.ConfigDict, prefix: str = "") -> str:
  """One `key = value` line per key of `c`, nested keys dotted, values as Python literals."""
  lines = []
  for key, value in c.items():
    if isinstance(value, ml_collections.ConfigDict) and value:
      lines.append(format_config(value, f"{prefix}{key}."))
    elif isinstance(value, ml_collections.ConfigDict):
      lines.append(f"{prefix}{key} = {{}}")
    else:
      lines.append(f"{prefix}{key} = {value!r}")
  return "\n".join(lines)


def _help(command: types.ModuleType, full: bool) -> str:
  """--help: the command's docstring, its flags (every flag with --helpfull) and, for a command
  with --config, the config's groups."""
  module = sys.argv[0] if command.__name__ == "__main__" else command.__name__
  has_config = "config" in flags.FLAGS
  if has_config:
    for name in ("config", "print_config"):
      flags.FLAGS.register_key_flag_for_module(module, flags.FLAGS[name])
  parts = [(command.__doc__ or "").strip(), "",
           flags.FLAGS.get_help() if full else flags.FLAGS.module_help(module)]
  if has_config:
    groups = config_groups()
    width = max(map(len, groups))
    parts += [
        "", "The config's groups (--print_config lists every key and its value; "
        "--config.GROUP.KEY=VALUE sets one;", "env.options.KEY takes any keyword argument of "
        "the environment's adapter):"
    ]
    parts += [f"  {group:<{width}}  {text}" for group, text in groups.items()]
  if not full:
    parts += ["", "--helpfull lists every flag, absl's included."]
  return "\n".join(parts)


def _unknown_key(error: BaseException, argv: list[str]) -> str:
  """The one line for a --config.KEY override the locked config does not have, naming the
  whole key as given and ml_collections' suggestion, e.g.
  `unknown key rollout.tasks_per_stp; did you mean "rollout.tasks_per_step"?`."""
  text = " ".join(str(arg) for arg in error.args).replace("\\'", "'")
  suggestion = re.search(r'Did you mean "(\w+)" instead of "(\w+)"', text)
  named = re.search(r"""Key "(\w+)"|'(\w+)'""", text)
  key = suggestion.group(2) if suggestion else (named.group(1) or named.group(2)) if named else "?"
  guess = suggestion.group(1) if suggestion else ""
  overrides = (re.match(r"-{1,2}(?:no)?config\.([\w.]+)", arg) for arg in argv)
  for parts in (match.group(1).split(".") for match in overrides if match):
    if key in parts:  # The group the key was given in: rollout.tasks_per_stp.
      group = "".join(f"{part}." for part in parts[:parts.index(key)])
      key, guess = group + key, group + guess
      break
  return f"unknown key {key}" + (f'; did you mean "{guess}"?' if suggestion else "")


def _last_line(error: BaseException) -> str:
  """The message of a flag error, whose text may hold a whole traceback: its last line, with
  the exception class name and absl's "flag " prefix dropped."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  last = lines[-1] if lines else type(error).__name__
  name, separator, message = last.partition(": ")
  last = message if separator and name.replace(".", "").isidentifier() else last
  return last.removeprefix("flag ")


def parse_flags(argv: list[str], command: types.ModuleType) -> list[str]:
  """absl's flag parsing for `command` (the module of the command's flags), --help answered
  from it (exit 0); a flag value, or a config that cannot be loaded or overridden, is reported
  in one line."""
  if any(arg in _HELP_FLAGS for arg in argv[1:]):
    print(_help(command, full=any(arg.endswith("-helpfull") for arg in argv[1:])))
    sys.exit(0)
  try:
    argv = flags.FLAGS(argv)
  except (AttributeError, KeyError) as error:  # ml_collections: a key the locked config lacks.
    sys.exit(f"error: invalid config: {_unknown_key(error, argv)}")
  except flags.Error as error:
    required = re.search(r"Flag (--\w+) must have a value other than None", str(error))
    sys.exit(f"error: {required.group(1) + ' is required' if required else _last_line(error)}")
  if "config" in flags.FLAGS and flags.FLAGS.config is None:
    sys.exit("error: --config is required: a packaged config's name, e.g. "
             f"--config=grpo_textcraft:local (the packaged configs: {', '.join(config_names())}), "
             "or a config file")
  for name in list(flags.FLAGS):
    flag = flags.FLAGS[name]
    if flag.flag_type() == "config object" and flag.value is not None:
      try:
        flag.value.keys()  # A config file that failed to load raises here, not while parsing.
      except OSError as error:
        sys.exit(f"error: --{name}={flag.serialize().partition('=')[2]}: {_last_line(error)}")
  return argv


def check_workdir(workdir: str) -> paths.Path:
  """The run's directory, local or gs://: it may exist (a resumed run) but must be a directory,
  and a bucket must be reachable and writable."""
  return directory_flag(workdir, f"--workdir={workdir}")


def directory_flag(value: str, what: str) -> paths.Path:
  """`value` as a directory to write in, named `what` in the error (e.g. "--trajectories=x"):
  it may exist but must be a directory, made later under a directory this process may write
  in; in a bucket, the bucket reachable and writable."""
  try:
    directory = paths.check_directory(value, what)
  except paths.UnreachablePathError as error:
    raise app.UsageError(str(error)) from None
  if not paths.is_remote(value):
    _check_writable(directory, what)
  return directory


def check_output_file(value: str, what: str) -> None:
  """`value` as a file to be written once the work is done, checked before the work: not a
  directory, made later under a directory this process may write in; in a bucket, the bucket
  reachable and writable."""
  target = paths.path(value)
  if paths.is_remote(value):
    directory_flag(str(target.parent), what)
    return
  if target.is_dir():
    raise app.UsageError(f"{what} is a directory, not a file")
  _check_writable(target.parent, what)


def _check_writable(directory: paths.Path, what: str) -> None:
  """Local `directory`, or its nearest existing ancestor when it is missing (the missing ones
  are made when the output is written), is a directory this process may write in."""
  existing = directory
  while not existing.exists():
    existing = existing.parent
  if not existing.is_dir():
    raise app.UsageError(f"{what}: {existing} is a file, not a directory")
  if not os.access(existing, os.W_OK):
    raise app.UsageError(f"{what}: {existing} is not writable")


def check_env_name(name: str) -> None:
  """--env=`name` is a registered environment (environments.registered())."""
  if name not in env_base.registered():
    raise app.UsageError(f"--env={name} is not a registered environment; registered: "
                         f"{', '.join(env_base.registered())}")


@dataclasses.dataclass(frozen=True)
class ModelFlags:
  """--model, --dtype, --param_dtype and --thinking, the flags of a command that chats with a
  model (`define_model_flags`)."""

  model: flags.FlagHolder
  dtype: flags.FlagHolder
  param_dtype: flags.FlagHolder
  thinking: flags.FlagHolder

  @property
  def cache_dtype(self) -> Any:
    """The KV cache's dtype: the weights' storage dtype."""
    return getattr(jnp, self.param_dtype.value)

  def load(self) -> tuple[Decoder, Tokenizer, ChatTemplate]:
    """The model, its tokenizer and its chat template; a model without a chat template, or
    without a thinking switch under --nothinking, is a usage error."""
    dtype = hardware.matmul_dtype(self.dtype.value)
    model, tokenizer = load_model(self.model.value, dtype=getattr(jnp, dtype),
                                  param_dtype=self.cache_dtype)
    try:
      chat = tokenizer.chat_template(thinking=self.thinking.value)
    except ValueError as error:
      raise app.UsageError(f"--model={self.model.value}: {error}") from None
    return model, tokenizer, chat


def define_model_flags(module: str) -> ModelFlags:
  """Defines the `ModelFlags` for the command of module `module` (its __name__), whose --help
  lists them."""
  dtypes = ["float32", "bfloat16"]
  return ModelFlags(
      model=flags.DEFINE_string("model", "smollm2-135m-instruct", "Registry name or HF directory.",
                                module_name=module),
      dtype=flags.DEFINE_enum(
          "dtype", "auto", ["auto", *dtypes], "Matmul input dtype; auto: what model.dtype=auto "
          "picks on this hardware (bfloat16 where the CPU or accelerator has fast bf16 dots).",
          module_name=module), param_dtype=flags.DEFINE_enum("param_dtype", "bfloat16", dtypes,
                                                             "Weight and KV cache storage dtype.",
                                                             module_name=module),
      thinking=flags.DEFINE_bool(
          "thinking", True, "Qwen3: --nothinking pre-fills an empty think block in every "
          "generation prompt (enable_thinking=False).", module_name=module))


def check_run_directory(value: str, what: str) -> None:
  """`value` as an existing directory to read from (a run's workdir)."""
  if not os.path.exists(value):
    raise app.UsageError(f"{what}: no such directory")
  if not os.path.isdir(value):
    raise app.UsageError(f"{what} is a file, not a directory")


def run(main: Callable[[], None]) -> None:
  """app.run for the command whose module defines `main` (which reads its flags; a command takes
  no positional arguments): --help from that module, --print_config answered without running
  `main`, one-line errors for bad input, library INFO logs hidden."""
  command = sys.modules[main.__module__]

  def guarded(argv: list[str]) -> None:
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)
    try:
      if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
      if "print_config" in flags.FLAGS and flags.FLAGS.print_config:
        settings_lib.Settings.from_config(flags.FLAGS.config)
        print(format_config(flags.FLAGS.config))
        return
      main()
    except (config_lib.ConfigError, weights.WeightsNotFoundError, env_base.AdapterImportError,
            app.UsageError) as error:
      sys.exit(f"error: {error}")

  app.run(guarded, flags_parser=functools.partial(parse_flags, command=command))
