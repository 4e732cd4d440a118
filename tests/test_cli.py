"""The launch scripts answer a user's mistake with one line on stderr and a failing exit status."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import tiny

REPO = pathlib.Path(__file__).resolve().parents[1]
LOCAL = f"--config={REPO / 'configs' / 'grpo_textcraft.py'}:local"


def _launch(script, *flags, **kwargs):
  """launch/<script> with `flags`, its output captured as text."""
  return subprocess.run([sys.executable, str(REPO / "launch" / script), *flags],
                        capture_output=True, text=True, timeout=300, **kwargs)


# (script, flags, what the one line says)
MISTAKES = {
    "unknown key": ("train.py", [LOCAL, "--config.rollout.temprature=0.5"],
                    "error: invalid config: unknown key temprature"),
    "unknown key, evaluate":
        ("evaluate.py", [LOCAL, "--config.eval.max_task=3"], 'Did you mean "max_tasks"'),
    "invalid value": ("train.py", [LOCAL, "--config.eval.horizon=-1"],
                      "error: invalid config: eval.horizon=-1 must be >= 0"),
    "invalid value, evaluate": ("evaluate.py", [LOCAL, "--config.eval.horizon=-1"],
                                "error: invalid config: eval.horizon=-1 must be >= 0"),
    "value of the wrong type":
        ("train.py", [LOCAL, "--config.eval.horizon=abc"], "invalid literal for int()"),
    "unknown variant":
        ("train.py", [f"--config={REPO / 'configs' / 'grpo_textcraft.py'}:lokal"],
         "error: unknown config variant 'lokal'; expected some of ['agentgym', 'local'"),
    "unknown variant, evaluate":
        ("evaluate.py", [f"--config={REPO / 'configs' / 'grpo_textcraft.py'}:lokal"],
         "error: unknown config variant 'lokal'"),
    "missing config file": ("train.py", ["--config=configs/no_such_config.py:local"],
                            "No such file or directory: 'configs/no_such_config.py'"),
    "no config": ("train.py", [], "--config must have a value"),
    "bad flag value, generate":
        ("generate.py", ["--stream_tokens=0"], "error: --stream_tokens=0 must be > 0"),
    "tools of an env without tools":
        ("train.py", [LOCAL, "--config.env.name=echo", "--config.env.action_format=tool_call"],
         "error: invalid config: env.action_format='tool_call': env 'echo' publishes no tools"),
    "registry model without weights":
        ("train.py", [LOCAL, "--config.model.name=qwen2.5-0.5b-instruct"],
         "hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir {models}"
         "/qwen2.5-0.5b-instruct"),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_mistake_is_one_line(mistake, tmp_path):
  script, flags, message = MISTAKES[mistake]
  models = tmp_path / "models"
  if script == "train.py":
    flags = [*flags, f"--workdir={tmp_path / 'run'}"]
  result = _launch(script, *flags, cwd=REPO, env={**os.environ, "AGENTGYM_MODELS": str(models)})
  assert result.returncode != 0
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
  assert message.format(models=models) in lines[0]


@pytest.mark.parametrize("script", ["train.py", "generate.py"])
def test_thinking_off_without_a_thinking_switch_is_one_line(script, tmp_path):
  checkpoint = tiny.make_checkpoint(tmp_path / "tiny")  # Plain ChatML: no enable_thinking.
  flags = ([
      LOCAL, f"--config.model.name={checkpoint}", "--config.model.thinking=off",
      f"--workdir={tmp_path / 'run'}"
  ] if script == "train.py" else [f"--model={checkpoint}", "--nothinking", "--prompt=hi"])
  result = _launch(script, *flags)
  assert result.returncode != 0
  (line,) = result.stderr.strip().splitlines()
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
  assert [line.split("  ")[0] for line in lines[1:4]
         ] == ["episode 4/12", "episode 8/12", "episode 12/12"]
  assert lines[4].startswith("k = 2 samples per task: avg@2 is the mean success")
  assert lines[5].split() == ["category", "tasks", "avg@2", "pass@2", "turns"]
