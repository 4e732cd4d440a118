"""Model-judged rewards (agentgym_jax/judge.py): the replies' parsers, the three modes against a
scripted OpenAI-compatible judge server, the cache, failures recorded as environment failures,
the tiny model as a sampler-run judge, WebArena's and SearchQA's requests, the config's checks
and a training run judged end to end."""

import http.server
import json
import re
import threading

import numpy as np
import pytest

from agentgym_jax import config as config_lib
from agentgym_jax import judge as judge_lib
from agentgym_jax import evaluation, rollout, trainer
from environments.base import DONE, ENV_ERROR, HORIZON
from environments.webarena import evaluators
from rl_helpers import check_config, echo_config


class _Server(http.server.ThreadingHTTPServer):
  request_queue_size = 64  # A step's requests arrive at once.


class ScriptedJudge:
  """An OpenAI-compatible /v1/chat/completions whose replies come from `script(prompt)` (the
  last user message): a string, or an int HTTP status to fail with. Counts the requests and
  the most in flight at once."""

  def __init__(self, script):
    self.script, self.requests, self.bodies = script, 0, []
    self._in_flight, self.most_in_flight = 0, 0
    self._lock = threading.Lock()
    outer = self

    class Handler(http.server.BaseHTTPRequestHandler):

      def log_message(self, *args):
        pass

      def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with outer._lock:
          outer.requests += 1
          outer.bodies.append(body)
          outer._in_flight += 1
          outer.most_in_flight = max(outer.most_in_flight, outer._in_flight)
        try:
          reply = outer.script(body["messages"][-1]["content"])
          if isinstance(reply, int):
            payload, status = {"error": {"message": "scripted failure"}}, reply
          else:
            payload, status = {"choices": [{"message": {"role": "assistant",
                                                        "content": reply}}]}, 200
          data = json.dumps(payload).encode()
          self.send_response(status)
          self.send_header("Content-Type", "application/json")
          self.send_header("Content-Length", str(len(data)))
          self.end_headers()
          self.wfile.write(data)
        finally:
          with outer._lock:
            outer._in_flight -= 1

    self.server = _Server(("127.0.0.1", 0), Handler)
    self.base_url = f"http://127.0.0.1:{self.server.server_port}/v1"
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def close(self):
    self.server.shutdown()
    self.server.server_close()


@pytest.fixture
def scripted():
  servers = []

  def start(script):
    servers.append(ScriptedJudge(script))
    return servers[-1]

  yield start
  for server in servers:
    server.close()


def http_judge(server, mode, rubric="", cache=None, rows=8):
  backend = judge_lib.HTTPBackend(server.base_url, "judge", max_new_tokens=64, timeout_s=10,
                                  concurrency=rows)
  return judge_lib.Judge(backend, mode, rubric=rubric, max_new_tokens=64,
                         cache=judge_lib.ReplyCache(cache))


def episode(group=0, turns=2, rewards=None, request=None, replies=None, termination=DONE):
  """A played episode of `turns` turns: the task, then agent replies and observations."""
  replies = replies or [f"reply {i}" for i in range(turns)]
  messages = [{"role": "user", "content": "Task: craft a stick."}]
  for i, reply in enumerate(replies):
    messages.append({"role": "assistant", "content": reply})
    if i + 1 < turns:
      messages.append({"role": "user", "content": f"observation {i}"})
  info = {} if request is None else {"judge": request}
  return rollout.Trajectory(task_id=7, group=group, messages=messages,
                            turn_rewards=list(rewards
                                              or [0.0] * turns), termination=termination, info=info)


def field(prompt, name):
  return re.search(rf"^{name}: (.*)$", prompt, re.MULTILINE).group(1)


# --- replies -----------------------------------------------------------------------------


def test_the_verdict_is_the_last_verdict_line_and_only_correct_scores():
  assert judge_lib.parse_verdict("It matches.\nVerdict: correct") == 1.0
  assert judge_lib.parse_verdict("Verdict: **Correct**") == 1.0
  assert judge_lib.parse_verdict("Verdict: partially correct") == 0.0
  assert judge_lib.parse_verdict("Verdict: incorrect") == 0.0
  assert judge_lib.parse_verdict("Verdict: correct\nOn second thought:\nVerdict: incorrect") == 0.0
  with pytest.raises(judge_lib.JudgeError, match="no verdict line"):
    judge_lib.parse_verdict("The answer is correct.")


def test_scores_are_tenths_and_a_group_needs_every_attempt():
  assert judge_lib.parse_score("Good.\nScore: 7") == pytest.approx(0.7)
  assert judge_lib.parse_score("Score: 3\nScore: 10") == 1.0
  with pytest.raises(judge_lib.JudgeError, match="no 'Score: N' line"):
    judge_lib.parse_score("seven out of ten")
  with pytest.raises(judge_lib.JudgeError, match="not in 0..10"):
    judge_lib.parse_score("Score: 11")
  assert judge_lib.parse_group_scores("Attempt 2: 4\nAttempt 1: 9\nAttempt 3: 0",
                                      3) == pytest.approx([0.9, 0.4, 0.0])
  with pytest.raises(judge_lib.JudgeError, match="no attempt 2 of 2"):
    judge_lib.parse_group_scores("Attempt 1: 9", 2)


def test_group_scores_are_min_max_normalised_and_a_tie_kept():
  assert judge_lib.normalise([0.2, 0.8, 0.5]) == pytest.approx([0.0, 1.0, 0.5])
  assert judge_lib.normalise([0.6, 0.6]) == [0.6, 0.6]


def test_a_long_episode_keeps_its_task_and_last_turns_within_the_budget():
  messages = [{"role": "user", "content": "TASK " + "t" * 50}]
  for i in range(40):
    messages += [{"role": "assistant", "content": f"act {i:02d} " + "a" * 40},
                 {"role": "user", "content": f"obs {i:02d} " + "o" * 40}]
  text = judge_lib.episode_text(messages, 1000)
  assert len(text) <= 1000
  assert text.startswith("[environment]\nTASK")
  assert "obs 39" in text and "act 39" in text and "act 00" not in text
  left_out = int(re.search(r"\[\.\.\. (\d+) messages left out \.\.\.\]", text).group(1))
  assert left_out + text.count("[agent]") + text.count("[environment]") - 1 == 80
  assert judge_lib.episode_text(messages[:3], 10_000).count("[agent]") == 1


# --- the modes, on a scripted judge server ----------------------------------------------


def means_the_reference(prompt):
  """A judge that calls an answer correct when it contains the reference, case aside."""
  answer, reference = field(prompt, "Answer to grade"), field(prompt, "Reference answer")
  return "Verdict: " + ("correct" if reference.lower() in answer.lower() else "incorrect")


def test_reference_mode_scores_the_requests_by_all_or_any_reference_and_the_scale(scripted):
  server = scripted(means_the_reference)
  request = lambda answer, references, match="all", scale=1.0: {
      "question": "Which items?", "references": references, "answer": answer, "match": match,
      "scale": scale
  }
  episodes = [
      episode(request=request("Oak and birch", ["oak", "birch"])),  # all match
      episode(request=request("Only oak", ["oak", "birch"])),  # one of two
      episode(request=request("Only oak", ["oak", "birch"], match="any")),
      episode(request=request("oak and birch", ["oak"], scale=0.0)),  # another check failed
      episode(rewards=[0.0, 1.0]),  # no request: the environment's reward stands
  ]
  seconds = http_judge(server, "reference")(episodes)
  assert server.requests == 2 + 2 + 2 + 1
  assert [e.turn_rewards[-1] for e in episodes] == [1.0, 0.0, 1.0, 0.0, 1.0]
  assert [e.success for e in episodes[:4]] == [True, False, True, False]
  assert "judged" not in episodes[4].info
  assert episodes[0].info["judged"]["replies"] == ["Verdict: correct"] * 2
  prompt = server.bodies[0]["messages"][-1]["content"]
  assert field(prompt, "Question") == "Which items?"
  assert server.bodies[0]["temperature"] == 0.0 and server.bodies[0]["max_tokens"] == 64
  metrics = judge_lib.metrics(episodes, seconds)
  assert metrics["judge/episodes"] == 4 and metrics["judge/score"] == 0.5
  assert metrics["judge/failures"] == 0 and metrics["time/judge"] == seconds


def test_rubric_mode_puts_each_score_on_the_last_turn(scripted):
  # Scores the episode by how many of the agent's replies are "stick".
  server = scripted(lambda prompt: f"Score: {prompt.count('[agent]' + chr(10) + 'stick')}")
  episodes = [
      episode(turns=3, rewards=[0.5, 0.0, 1.0], replies=["a", "stick", "stick"]),
      episode(turns=1, replies=["nothing"])
  ]
  http_judge(server, "rubric", rubric="Uses sticks.")(episodes)
  assert episodes[0].turn_rewards == [0.0, 0.0, pytest.approx(0.2)]
  assert episodes[1].turn_rewards == [0.0]
  assert "Uses sticks." in server.bodies[0]["messages"][-1]["content"]
  assert not episodes[0].success  # The environment's outcome stays.


def test_group_mode_ranks_each_group_in_one_prompt(scripted):

  def rank(prompt):  # An attempt's score: the number in its reply.
    attempts = re.findall(r"Attempt (\d+):\n.*?\[agent\]\nvalue (\d+)", prompt, re.DOTALL)
    return "\n".join(f"Attempt {i}: {v}" for i, v in attempts)

  server = scripted(rank)
  episodes = [
      episode(group=g, turns=1, replies=[f"value {v}"])
      for g, v in ((0, 2), (0, 8), (0, 5), (1, 4), (1, 4))
  ]
  failed = episode(group=0, turns=1, replies=["value 9"], termination=ENV_ERROR)
  http_judge(server, "group", rubric="Higher values are better.")([*episodes, failed])
  assert server.requests == 2
  assert [e.reward for e in episodes] == pytest.approx([0.0, 1.0, 0.5, 0.4, 0.4])
  assert "value 9" not in server.bodies[0]["messages"][-1]["content"]
  assert "judged" not in failed.info


def test_judging_is_batched_over_the_step_and_cached(scripted, tmp_path):
  server = scripted(lambda prompt: "Score: 5")
  episodes = [episode(turns=1, replies=[f"reply {i}"]) for i in range(12)]
  http_judge(server, "rubric", rubric="r", cache=tmp_path / "cache.jsonl", rows=4)(episodes)
  assert server.requests == 12 and server.most_in_flight > 1
  # The same episodes again, in a fresh judge reading the same cache file: nothing is asked.
  again = [episode(turns=1, replies=[f"reply {i}"]) for i in range(12)]
  http_judge(server, "rubric", rubric="r", cache=tmp_path / "cache.jsonl")(again)
  assert server.requests == 12
  assert all(e.info["judged"]["cached"] and e.reward == 0.5 for e in again)
  # Another rubric is another prompt.
  http_judge(server, "rubric", rubric="other", cache=tmp_path / "cache.jsonl")(episodes[:1])
  assert server.requests == 13
  # A run killed mid-append leaves a cut last line: read without it, that reply asked again.
  cache = tmp_path / "cache.jsonl"
  cache.write_text(cache.read_text()[:-10])
  http_judge(server, "rubric", rubric="other", cache=cache)(episodes[:1])
  assert server.requests == 14


def test_a_failing_judge_fails_its_episodes_as_an_env_error_and_is_not_cached(scripted, tmp_path):
  replies = {"ok": "Score: 10", "down": 500, "rambles": "I cannot decide."}
  server = scripted(lambda prompt: replies[re.search(r"\[agent\]\n(\w+)", prompt).group(1)])
  episodes = [episode(turns=1, replies=[name]) for name in replies]
  cache = tmp_path / "cache.jsonl"
  http_judge(server, "rubric", rubric="r", cache=cache)(episodes)
  ok, down, rambles = episodes
  assert ok.reward == 1.0 and ok.termination == DONE
  assert down.termination == rambles.termination == ENV_ERROR
  assert down.error.startswith("judge: ") and "HTTP 500" in down.error
  assert "no 'Score: N' line" in rambles.error
  assert rambles.info["judged"]["replies"] == ["I cannot decide."]
  scoring = rollout.EpisodeScoring()
  assert [scoring.excluded(e) for e in episodes] == [False, True, True]
  assert judge_lib.metrics(episodes, 0.0)["judge/failures"] == pytest.approx(2 / 3)
  assert len(cache.read_text().splitlines()) == 2  # The replies, not the HTTP failure.
  unreachable = judge_lib.Judge(
      judge_lib.HTTPBackend("http://127.0.0.1:9/v1", "judge", max_new_tokens=8, timeout_s=5,
                            concurrency=2), "rubric", rubric="r", max_new_tokens=8)
  lost = episode(turns=1)
  unreachable([lost])
  assert lost.termination == ENV_ERROR and "cannot reach" in lost.error


def test_a_busy_judge_server_is_asked_again(scripted):
  answered = []

  def busy_once(prompt):
    answered.append(prompt)
    return 503 if len(answered) == 1 else "Score: 6"

  server = scripted(busy_once)
  e = episode(turns=1)
  http_judge(server, "rubric", rubric="r")([e])
  assert server.requests == 2 and e.reward == pytest.approx(0.6)


def test_a_malformed_request_fails_only_its_episode(scripted):
  server = scripted(means_the_reference)
  bad = episode(request={"question": "q", "answer": "a"})
  good = episode(request={"question": "q", "references": ["a"], "answer": "a"})
  http_judge(server, "reference")([bad, good])
  assert bad.termination == ENV_ERROR and "malformed" in bad.error
  assert good.success and good.reward == 1.0


def test_episodes_of_failed_environments_or_without_turns_are_not_judged(scripted):
  server = scripted(lambda prompt: "Score: 10")
  failed = episode(turns=1, termination=ENV_ERROR)
  empty = episode(turns=0, rewards=[], termination=ENV_ERROR)
  truncated = episode(turns=2, termination=HORIZON)
  http_judge(server, "rubric", rubric="r")([failed, empty, truncated])
  assert server.requests == 1 and truncated.reward == 1.0


# --- the tiny model, run by the sampler ---------------------------------------------------


def test_the_sampler_judges_a_step_in_one_decode_batch(checkpoint_dir):
  backend = judge_lib.SamplerBackend.load(checkpoint_dir, dtype="float32", rows=8, max_context=256,
                                          max_new_tokens=8)
  assert backend.identity == evaluation.model_fingerprint(checkpoint_dir)
  starts = []
  start = backend.sampler.start
  backend.sampler.start = lambda prompts, *a: starts.append(len(prompts)) or start(prompts, *a)
  judge = judge_lib.Judge(backend, "rubric", rubric="r", max_new_tokens=8, episode_chars=200)
  episodes = [episode(turns=1, replies=[f"0 1 {i}"]) for i in range(5)]
  too_long = episode(turns=1, replies=["1 " * 400])
  judge([*episodes, too_long])
  assert starts == [5]
  # The random model writes no "Score: N": each episode fails as an env error, with its reply.
  for e in episodes:
    assert e.termination == ENV_ERROR and "no 'Score: N' line" in e.error
    assert isinstance(e.info["judged"]["replies"][0], str)
  assert "reward.judge.max_context=256" in too_long.error
  replies = backend.complete([judge_lib.chat("a"), judge_lib.chat("a")])
  assert replies[0] == replies[1]  # Greedy.


# --- environments that ask for a judge ----------------------------------------------------


def webarena_config(reference_answers, eval_types=("string_match",)):
  return {
      "intent": "What is the top seller?", "eval": {
          "eval_types": list(eval_types), "reference_answers": reference_answers,
          "reference_url": "http://shop/a", "program_html": []
      }
  }


class FixedPage:
  url = "http://shop/b"


def test_webarena_fuzzy_match_asks_the_judge_and_keeps_must_include_without_one(scripted):
  config = webarena_config({"fuzzy_match": ["Blue Mug"], "must_include": ["mug"]})
  evaluation = evaluators.evaluate(config, "The blue mug, by far", FixedPage())
  assert evaluation.score == 1.0  # must_include stands in without a judge.
  assert evaluation.judge == {
      "question": "What is the top seller?", "references": ["Blue Mug"],
      "answer": "The blue mug, by far", "match": "all", "scale": 1.0
  }
  # Another check failing scales the judged outcome to 0.
  failing = evaluators.evaluate(
      webarena_config({"fuzzy_match": ["Blue Mug"]}, ("string_match", "url_match")), "Blue Mug",
      FixedPage())
  assert failing.judge["scale"] == 0.0
  unachievable = evaluators.evaluate(webarena_config({"fuzzy_match": "N/A"}), "N/A", FixedPage())
  assert unachievable.judge is None and unachievable.score == 1.0
  # The judge decides: "Azure cup" includes no reference phrase, yet this judge accepts it.
  server = scripted(lambda prompt: "Verdict: correct")
  rejected = evaluators.evaluate(webarena_config({"fuzzy_match": ["Blue Mug"]}), "Azure cup",
                                 FixedPage())
  assert rejected.score == 0.0
  e = episode(rewards=[0.0, rejected.score], request=rejected.judge)
  http_judge(server, "reference")([e])
  assert e.reward == 1.0 and e.success


def test_searchqa_asks_the_judge_for_any_gold_answer_when_told():
  pytest.importorskip("bm25s")
  from environments.searchqa import SearchQAEnv  # pylint: disable=import-outside-toplevel
  env = SearchQAEnv(judge_answers=True)
  task = env.task_ids("test")[0]
  env.reset(task)
  result = env.step("<answer> something else </answer>")
  request = judge_lib.Request.from_info(result.info["judge"])
  assert request.match == "any" and request.answer == "something else"
  assert request.question and request.references and request.scale == 1.0
  assert result.reward == 0.0
  plain = SearchQAEnv()
  plain.reset(task)
  assert "judge" not in plain.step("<answer> x </answer>").info


# --- configuration and training -----------------------------------------------------------


@pytest.mark.parametrize("keys, error", [
    ({"mode": "pairwise"}, "reward.judge.mode='pairwise' is not"),
    ({"mode": "reference"}, "exactly one of model"),
    ({"mode": "reference", "model": "m", "base_url": "http://x"}, "exactly one of model"),
    ({"mode": "reference", "base_url": "ftp://x", "served_model": "m"}, "must start with http"),
    ({"mode": "reference", "base_url": "http://x"}, "needs reward.judge.served_model"),
    ({"mode": "group", "model": "m"}, "needs reward.judge.rubric"),
    ({"mode": "rubric", "model": "m", "rubric": "r", "max_new_tokens": 9000}, "max_new_tokens"),
])
def test_the_judge_config_is_checked(keys, error):
  c = config_lib.base_config()
  for key, value in keys.items():
    c.reward.judge[key] = value
  check_config(c, error)


def test_no_judge_by_default():
  assert check_config(config_lib.base_config()).make_judge() is None


def test_the_configured_judge_is_built_from_its_keys(checkpoint_dir, tmp_path):
  c = config_lib.base_config()
  c.reward.judge.update(mode="group", rubric="r", model=checkpoint_dir, rows=3, max_context=300,
                        max_new_tokens=20, episode_chars=500)
  built = check_config(c).make_judge(tmp_path / "cache.jsonl")
  assert (built.mode, built.rubric, built.max_new_tokens, built.episode_chars) == ("group", "r", 20,
                                                                                   500)
  assert isinstance(built.backend, judge_lib.SamplerBackend)
  assert (built.backend.rows, built.backend.max_context) == (3, 300)
  assert built.cache.path == tmp_path / "cache.jsonl"
  c.reward.judge.update(model="", base_url="http://judge:8000/v1/", served_model="big")
  served = check_config(c).make_judge().backend
  assert served.url == "http://judge:8000/v1/chat/completions" and served.model == "big"


def test_a_judged_run_trains_on_the_judges_scores(checkpoint_dir, scripted, tmp_path,
                                                  single_device):
  # The judge gives an episode 10 points if the agent's first reply has a "1", else 0.
  server = scripted(lambda prompt: "Score: " +
                    ("10" if "1" in prompt.split("[agent]\n")[1].split("\n")[0] else "0"))
  c = echo_config(checkpoint_dir, steps=2)
  c.reward.judge.mode = "rubric"
  c.reward.judge.rubric = "Say 1."
  c.reward.judge.base_url = server.base_url
  c.reward.judge.served_model = "judge"
  c.log.trajectories = True
  history = trainer.train(c, tmp_path)
  records = [
      json.loads(line) for path in sorted((tmp_path / "trajectories").glob("*.jsonl"))
      for line in path.read_text().splitlines()
  ]
  rows = c.rollout.tasks_per_step * c.rollout.samples_per_task
  assert len(records) == 2 * rows
  for record in records:
    said = record["messages"][1]["content"].split("\n")[0]
    assert record["reward"] == (1.0 if "1" in said else 0.0)
    assert record["info"]["judged"]["score"] == record["reward"]
  assert [m["judge/episodes"] for m in history] == [rows, rows]
  assert history[0]["reward"] == pytest.approx(np.mean([r["reward"] for r in records[:rows]]))
  assert 0 < history[0]["reward"] < 1
  assert (tmp_path / trainer.JUDGE_CACHE).exists()
  assert history[0]["time/judge"] > 0
