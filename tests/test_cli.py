"""The commands: a user's mistake is one line on stderr and a failing exit status, checked before
any work; --config by name or path, --print_config, --help, and env.options from the command
line. Each test runs the real command in a subprocess (launch/*.py, the checkout's wrappers of
agentgym_jax/commands/)."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

import tiny
from agentgym_jax import cli
from agentgym_jax import settings as settings_lib
from agentgym_jax import config as config_lib
import environments
from environments import base as env_base

REPO = pathlib.Path(__file__).resolve().parents[1]
LOCAL = f"--config={REPO / 'configs' / 'grpo_textcraft.py'}:local"


def _launch(script, *flags, **kwargs):
  """launch/<script> with `flags`, its output captured as text."""
  return subprocess.run([sys.executable, str(REPO / "launch" / script), *flags],
                        capture_output=True, text=True, timeout=300, **kwargs)


def _one_error_line(result) -> str:
  """The single `error: ...` line of a command that failed without a traceback."""
  assert result.returncode != 0
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
  return lines[0]


# (script, flags, what the one line says); {tmp} is the test's tmp_path, where `a_file` is a
# file and `empty_run` an empty directory, {models} its AGENTGYM_MODELS.
MISTAKES = {
    # Config keys and values.
    "unknown key": ("train.py", [LOCAL, "--config.rollout.tasks_per_stp=3"],
                    'error: invalid config: unknown key rollout.tasks_per_stp; did you mean '
                    '"rollout.tasks_per_step"?'),
    "unknown group": ("train.py", [LOCAL, "--config.rolout.temperature=0.5"],
                      'error: invalid config: unknown key rolout; did you mean "rollout"?'),
    "invalid value": ("train.py", [LOCAL, "--config.eval.horizon=-1"],
                      "error: invalid config: eval.horizon=-1 must be >= 0"),
    "invalid value, evaluate": ("evaluate.py", [LOCAL, "--config.eval.horizon=-1"],
                                "error: invalid config: eval.horizon=-1 must be >= 0"),
    "value of the wrong type": ("train.py", [LOCAL, "--config.eval.horizon=abc"],
                                "error: --config.eval.horizon=abc: invalid literal for int()"),
    "invalid value, --print_config":
        ("train.py", [LOCAL, "--config.rollout.top_p=2", "--print_config"],
         "error: invalid config: rollout.top_p=2.0 must be in (0, 1]"),
    "tools of an env without tools":
        ("train.py", [LOCAL, "--config.env.name=echo", "--config.env.action_format=tool_call"],
         "error: invalid config: env.action_format='tool_call': env 'echo' publishes no tools"),
    "unknown env option":
        ("train.py", [LOCAL, "--config.env.options.bogus=1"],
         "error: invalid config: env.options.bogus: environment 'textcraft' takes no option "
         "'bogus'; its options: max_depth, goals"),
    "required env option missing":
        ("train.py", [LOCAL, "--config.env.name=webarena_remote", "--config.env.options={{}}"],
         "error: invalid config: env.options.base_url is required by environment "
         "'webarena_remote'; its options: base_url, config_dir,"),
    # The config itself.
    "unknown variant":
        ("train.py", [f"--config={REPO / 'configs' / 'grpo_textcraft.py'}:lokal"],
         "error: unknown config variant 'lokal'; expected some of ['agentgym', 'local'"),
    "missing config file":
        ("train.py", ["--config=configs/no_such_config.py:local"],
         "error: --config=configs/no_such_config.py:local: 'configs/no_such_config.py' is "
         "neither a config file nor a packaged config; the packaged configs: ablation_echo, "),
    "unknown config name":
        ("evaluate.py", ["--config=grpo_textcrft:local"],
         "error: --config=grpo_textcrft:local: 'grpo_textcrft' is neither a config file nor a "
         "packaged config; the packaged configs: ablation_echo, "),
    "positional argument": ("train.py", [LOCAL, "stray"], "error: unexpected arguments: ['stray']"),
    "positional argument, view": ("view.py", ["--workdir={tmp}/empty_run",
                                              "stray"], "error: unexpected arguments: ['stray']"),
    "no config": ("train.py", [], "error: --config is required: a packaged config's name, e.g. "
                  "--config=grpo_textcraft:local (the packaged configs: ablation_echo, "),
    # train.py's other flags.
    "workdir under a file": ("train.py", [LOCAL, "--workdir={tmp}/a_file/run"],
                             "error: --workdir={tmp}/a_file/run: {tmp}/a_file is a file, not a "
                             "directory"),
    "processes without a coordinator":
        ("train.py", [LOCAL, "--num_processes=2", "--process_id=0"],
         "error: --num_processes and --process_id need --coordinator=host:port"),
    "process id out of range":
        ("train.py", [LOCAL, "--coordinator=localhost:1234", "--num_processes=2",
                      "--process_id=2"], "error: --process_id=2 must be in [0, --num_processes=2)"),
    "registry model without weights":
        ("train.py", [LOCAL, "--config.model.name=qwen2.5-0.5b-instruct"],
         "hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir {models}"
         "/qwen2.5-0.5b-instruct"),
    # evaluate.py: its flags and outputs, before the model loads.
    "no rows": ("evaluate.py", [LOCAL, "--rows=0"], "error: --rows=0 must be > 0"),
    "summary under a file": ("evaluate.py", [LOCAL, "--out={tmp}/a_file/eval.json"],
                             "error: --out={tmp}/a_file/eval.json: {tmp}/a_file is a file, not a "
                             "directory"),
    "trajectories into a file": ("evaluate.py", [LOCAL, "--trajectories={tmp}/a_file"],
                                 "error: --trajectories={tmp}/a_file is a file, not a directory"),
    # generate.py: sampling flags, before the model loads.
    "bad flag value, generate":
        ("generate.py", ["--stream_tokens=0"], "error: --stream_tokens=0 must be > 0"),
    "negative temperature":
        ("generate.py", ["--temperature=-1"], "error: --temperature=-1.0 must be >= 0 (0: greedy)"),
    "top_p above 1": ("generate.py", ["--top_p=2"], "error: --top_p=2.0 must be in (0, 1]"),
    # serve_env.py.
    "unknown env, serve_env": ("serve_env.py", ["--env=nope"],
                               "error: --env=nope is not a registered environment; registered: "
                               "babyai, echo, http,"),
    "unknown option, serve_env":
        ("serve_env.py", ["--env=textcraft", "--option=bogus=1"],
         "error: --option=bogus: environment 'textcraft' takes no option 'bogus'; its options: "
         "max_depth, action_format, goals"),
    "option value the adapter refuses, serve_env":
        ("serve_env.py", ["--env=textcraft", "--option=max_depth=abc", "--port=0"],
         "cannot be built: ValueError: max_depth must be an int >= 1 or None, got 'abc'"),
    # view.py and plot.py.
    "missing run, view":
        ("view.py", ["--workdir={tmp}/nope"], "error: --workdir={tmp}/nope: no such directory"),
    "directory without a run, view":
        ("view.py", ["--workdir={tmp}/empty_run"],
         "error: --workdir={tmp}/empty_run: '{tmp}/empty_run' has neither metrics.jsonl nor "
         "trajectory files"),
    "page under a file": ("view.py", ["--workdir={tmp}/empty_run", "--out={tmp}/a_file/v.html"],
                          "error: --out={tmp}/a_file/v.html: {tmp}/a_file is a file"),
    "missing run, plot":
        ("plot.py", ["--workdir={tmp}/nope"], "error: --workdir={tmp}/nope: no such directory"),
    "directory without metrics, plot": ("plot.py", ["--workdir={tmp}/empty_run"],
                                        "error: --workdir={tmp}/empty_run: No metrics to plot"),
    # make_demos.py.
    "unknown env, make_demos":
        ("make_demos.py", ["--env=nope", "--out={tmp}/demos.jsonl"],
         "error: --env=nope is not a registered environment; registered: babyai, echo, http,"),
    "env without an expert":
        ("make_demos.py", ["--env=echo", "--out={tmp}/demos.jsonl"],
         "error: --env=echo: no expert for environment 'echo'; experts exist for"),
    "demonstrations under a file": ("make_demos.py", ["--env=textcraft", "--out={tmp}/a_file/d"],
                                    "error: --out={tmp}/a_file/d: {tmp}/a_file is a file"),
    "missing rollouts":
        ("make_demos.py",
         ["--env=textcraft", "--from_rollouts={tmp}/nope",
          "--out={tmp}/demos.jsonl"], "error: --from_rollouts={tmp}/nope: no such directory"),
    "unknown model, plan":
        ("plan.py", ["--model=nope"], "error: --model=nope: 'nope' is neither a planned model"),
    "malformed mesh, plan": ("plan.py", ["--mesh=1,8"],
                             "error: --mesh=1,8: wants three positive sizes data,fsdp,tensor"),
    "mesh larger than the devices, plan":
        ("plan.py", ["--devices=8", "--mesh=1,16,1"], "error: mesh (1, 16, 1) needs 16 devices"),
}


@pytest.mark.slow
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_mistake_is_one_line(mistake, tmp_path):
  script, flags, message = MISTAKES[mistake]
  models = tmp_path / "models"
  (tmp_path / "a_file").write_text("not a directory")
  (tmp_path / "empty_run").mkdir()
  flags = [flag.format(tmp=tmp_path) for flag in flags]
  if script == "train.py" and not any(flag.startswith("--workdir") for flag in flags):
    flags.append(f"--workdir={tmp_path / 'run'}")
  result = _launch(script, *flags, cwd=REPO, env={**os.environ, "AGENTGYM_MODELS": str(models)})
  assert message.format(tmp=tmp_path, models=models) in _one_error_line(result)
  assert not result.stdout  # Nothing was played, loaded or written before the check.


def test_an_address_in_use_is_one_line():
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    result = _launch("serve_env.py", "--env=textcraft", f"--port={port}")
  assert _one_error_line(result) == f"error: --host=127.0.0.1 --port={port}: Address already in use"


@pytest.mark.parametrize("script", ["train.py", "generate.py", "serve_policy.py"])
def test_thinking_off_without_a_thinking_switch_is_one_line(script, tmp_path):
  checkpoint = tiny.make_checkpoint(tmp_path / "tiny")  # Plain ChatML: no enable_thinking.
  flags = {
      "train.py": [
          LOCAL, f"--config.model.name={checkpoint}", "--config.model.thinking=off",
          f"--workdir={tmp_path / 'run'}"
      ],
      "generate.py": [f"--model={checkpoint}", "--nothinking", "--prompt=hi"],
      "serve_policy.py": [f"--model={checkpoint}", "--nothinking", "--port=0"],
  }[script]
  line = _one_error_line(_launch(script, *flags))
  name = (f"invalid config: model.name='{checkpoint}', model.thinking='off'"
          if script == "train.py" else f"--model={checkpoint}")
  assert line.startswith(f"error: {name}: thinking off needs a chat template with a thinking "
                         "switch"), line


def test_a_workdir_that_is_a_file_is_one_line(tmp_path):
  workdir = tmp_path / "run"
  workdir.write_text("not a directory")
  result = _launch("train.py", LOCAL, f"--workdir={workdir}")
  assert result.returncode != 0
  assert result.stderr.strip() == f"error: --workdir={workdir} is a file, not a directory"
  assert workdir.read_text() == "not a directory"


def test_a_config_by_name_is_the_packaged_file_from_any_directory(tmp_path):
  """grpo_textcraft (or grpo_textcraft.py) and the file's path load the same config, from a
  directory without configs/."""
  printed = []
  for config in ("grpo_textcraft:local", f"{REPO / 'configs' / 'grpo_textcraft.py'}:local"):
    result = _launch("train.py", f"--config={config}", "--print_config", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    printed.append(result.stdout)
  assert printed[0] == printed[1]
  lines = printed[0].splitlines()
  # The local variant's values, one `key = value` line each, every key of the config.
  assert "model.name = 'smollm2-135m-instruct'" in lines
  assert "horizon.caps = (3, 5, 8)" in lines and "env.options.max_depth = 2" in lines
  assert len(lines) == len(cli.format_config(config_lib.base_config()).splitlines())
  for name in ("grpo_textcraft", "grpo_textcraft.py"):
    assert cli.config_file(name) == str(REPO / "configs" / "grpo_textcraft.py")
  assert "grpo_textcraft" in cli.config_names() and "__init__" not in cli.config_names()


def test_print_config_shows_overrides_and_env_options_of_the_adapter():
  """Overrides land in the printed config, env.options.* keys of the adapter's constructor
  included, with the types ml_collections parses them to; the command exits before work."""
  result = _launch("evaluate.py", "--config=grpo_sciworld", "--config.optim.learning_rate=2e-5",
                   "--config.env.options.jvm_heap_mb=512", "--print_config")
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.splitlines()
  assert "optim.learning_rate = 2e-05" in lines and "env.options.jvm_heap_mb = 512" in lines
  result = _launch("train.py", "--config=grpo_textcraft", "--config.env.name=http",
                   "--config.env.options.env=textcraft",
                   "--config.env.options.base_urls=['http://cpu-0:36001', 'http://cpu-1:36001']",
                   "--print_config")
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.splitlines()
  assert "env.options.env = 'textcraft'" in lines
  assert "env.options.base_urls = ['http://cpu-0:36001', 'http://cpu-1:36001']" in lines


def test_env_options_goals_from_the_command_line_plays_the_544_agentgym_goals(tmp_path):
  """--config.env.options.goals=agentgym reaches the run's env pool: the original AgentGym
  TextCraft's 544 goals (444 train, 100 test) instead of the default set's 551."""
  script = ("import sys\n"
            "from absl import flags\n"
            "from agentgym_jax import cli, settings as settings_lib\n"
            "from agentgym_jax.commands import train\n"
            "cli.parse_flags(sys.argv, train)\n"
            "with settings_lib.Settings.from_config(flags.FLAGS.config).env.pool(1) as pool:\n"
            "  print(len(pool.task_ids('train')), len(pool.task_ids('test')))\n")

  result = subprocess.run([
      sys.executable, "-c", script, "--config=grpo_textcraft", "--config.env.options.goals=agentgym"
  ], capture_output=True, text=True, timeout=300, cwd=tmp_path)
  assert result.returncode == 0, result.stderr[-2000:]
  assert [int(size) for size in result.stdout.split()] == [444, 100]
  default = environments.make("textcraft")
  assert [len(default.task_ids(split)) for split in ("train", "test")] == [451, 100]


@pytest.mark.slow
@pytest.mark.parametrize("command", [
    "train.py", "evaluate.py", "generate.py", "serve_env.py", "serve_policy.py", "make_demos.py",
    "view.py", "plot.py", "plan.py"
])
def test_help_exits_0_with_the_flags_and_the_config_groups(command):
  result = _launch(command, "--help")
  assert result.returncode == 0 and not result.stderr, result.stderr[-2000:]
  name = command.removesuffix(".py")
  assert result.stdout.startswith("agentgym-")
  assert f"agentgym_jax.commands.{name}:" in result.stdout  # Its flags, listed by absl.
  groups = [
      line.split()[0] for line in result.stdout.splitlines()
      if line.startswith("  ") and line.split()[0] in cli.config_groups()
  ]
  if command in ("train.py", "evaluate.py"):
    assert "--config:" in result.stdout and "--[no]print_config:" in result.stdout
    assert groups == list(cli.config_groups())
  else:
    assert not groups and "--config:" not in result.stdout


def test_the_help_describes_every_group_of_the_config():
  groups = cli.config_groups()
  assert set(groups) == set(config_lib.base_config())
  assert all(groups.values())
  assert groups["horizon"] == "ScalingInter-RL: the turn cap as a function of the step."


def test_env_options_are_checked_against_the_adapters_constructor(monkeypatch):
  check = settings_lib.env_options_problem
  assert check("textcraft", {"goals": "agentgym", "max_depth": 2}, "env.options.") is None
  assert check("sciworld", {"jvm_heap_mb": 512}, "env.options.") is None
  assert check("http", {"base_url": "http://h:1", "env": "textcraft"}, "env.options.") is None
  assert check("textcraft", {"goal": "agentgym"}, "env.options.", hidden=("action_format",)) == (
      "env.options.goal: environment 'textcraft' takes no option 'goal'; its options: "
      "max_depth, goals")
  assert check(
      "webarena_remote", {},
      "--option=").startswith("--option=base_url is required by environment 'webarena_remote'")

  def any_options(**options):
    return options

  monkeypatch.setitem(env_base._REGISTRY, "any_options", any_options)
  assert check("any_options", {"whatever": 1}, "env.options.") is None


def test_generate_streams_the_reply_it_would_print_at_once(tmp_path):
  checkpoint = tiny.make_checkpoint(tmp_path / "tiny")

  def reply(stream_tokens):
    result = _launch("generate.py", f"--model={checkpoint}", "--prompt=hello", "--temperature=0",
                     "--max_new_tokens=12", "--param_dtype=float32",
                     f"--stream_tokens={stream_tokens}")
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout

  # Greedy: printed 3 tokens at a time, on the live cache, the reply is the one-shot reply.
  streamed, at_once = reply(3), reply(12)
  assert streamed == at_once and streamed.strip()


def test_evaluate_shows_its_progress_and_says_what_k_is(tmp_path):
  checkpoint = tiny.make_checkpoint(tmp_path / "tiny")
  result = _launch("evaluate.py", f"--config={REPO / 'configs' / 'ablation_echo.py'}:long",
                   f"--config.model.name={checkpoint}", "--config.eval.max_tasks=6",
                   "--config.eval.samples_per_task=2", "--config.rollout.max_new_tokens=4",
                   "--config.rollout.max_context=128", "--config.mesh.fsdp=1", "--rows=4",
                   f"--out={tmp_path / 'new' / 'eval.json'}",
                   env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert lines[0] == "6 echo tasks of the test split, k = 2 sample(s) each, up to 4 turns"
  summary = json.loads((tmp_path / "new" / "eval.json").read_text())
  assert (summary["k"], summary["num_tasks"]) == (2, 6)
  # The bar moves as episodes end (rows are refilled one by one), up to all 12.
  table = next(i for i, line in enumerate(lines) if line.startswith("k = 2 samples per task"))
  done = [int(line.split("  ")[0].split()[1].split("/")[0]) for line in lines[1:table]]
  assert done == sorted(done) and done[-1] == 12 and len(done) > 1
  assert all(line.startswith("episode ") and "/12" in line for line in lines[1:table])
  assert lines[table].startswith("k = 2 samples per task: avg@2 is the mean success")
  assert lines[table + 1].split() == ["category", "tasks", "avg@2", "pass@2", "turns"]


def test_plan_prints_a_table_per_mesh():
  result = _launch("plan.py", "--model=qwen2.5-7b-instruct", "--mesh=1,8,1", "--mesh=1,4,2",
                   "--no_compile")
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.splitlines()
  assert lines[0] == "qwen2.5-7b-instruct: 7.62B parameters; GiB per device"
  # 3808974848 B = 3.55 GiB of parameters, 2x that of moments. The reference keeps the 152064 x
  # 3584 embedding (2.03 GiB / 8 a device) in f32, the matrices in bf16 (norms and biases, 0.3M
  # parameters, aside): 3.55 / 2 + 0.25 / 2 = 1.90 GiB.
  assert lines[3].split() == ["1,8,1", "8", "x", "4096", "3.55", "7.09", "-", "-", "1.90", "-", "-"]
  assert lines[4].split()[:5] == ["1,4,2", "8", "x", "4096", "3.55"]


def test_plan_plans_a_sampler_on_the_requested_devices():
  result = _launch("plan.py", "--sampler_mesh=1,4,1", "--rows=64", "--cache_slots=10240",
                   "--no_compile")
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.splitlines()
  assert lines[0] == "qwen2.5-7b-instruct sampler: GiB per device"
  # 28 layers x 64 rows x 4 kv heads x 10240 slots x 128 x 2 B x 2 (k, v) / 4 = 8.75 GiB.
  assert lines[3].split()[:6] == ["1,4,1", "64", "x", "10240", "7.09", "8.75"]
