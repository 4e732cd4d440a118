"""The AgentGym HTTP server and client, over real loopback HTTP."""

import http.client
import http.server
import json
import socket
import struct
import threading

import psutil
import pytest

import environments
from environments import EnvError
from environments.http import AgentGymClient, AgentGymServer, extract_action
from environments.http.endpoint import Endpoint
from environments.http.served import free_port, serve_in_subprocess
from environments.pool import EnvPool
from environments.textcraft import TextCraftEnv, solve
from http_helpers import play, wait_until
import toy_env

toy_env.register()


@pytest.fixture
def server():
  with AgentGymServer("toy") as server:
    yield server


def _request(port, method, path, body=None, headers=None):
  """One request on a fresh connection: (status, decoded JSON)."""
  if isinstance(body, (dict, list)):
    body = json.dumps(body).encode()
  connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
  try:
    connection.request(method, path, body=body, headers=headers or {})
    response = connection.getresponse()
    return response.status, json.loads(response.read())
  finally:
    connection.close()


# Task t hides (7t + 3) mod 10: task 3 -> 4 (solved on the 4th guess), task 5 -> 8 (not solved).
_EPISODES = {
    3: [
        "Thought: low.\n\nAction: guess 1", "Action: guess 9", "Action: jump", "Action: guess 5",
        "Action: guess 4"
    ],
    5: [f"Action: guess {n}" for n in range(5)],
}


@pytest.mark.parametrize("style", ["textcraft", "babyai", "sciworld"])
def test_a_remote_episode_matches_the_in_process_adapter(style):
  local = toy_env.ToyEnv()
  with AgentGymServer("toy", style=style) as server:
    remote = environments.make("http", base_url=server.url, env="toy", style=style)
    for task_id, replies in _EPISODES.items():
      expected = play(local, task_id, replies)
      got = play(remote, task_id, replies)
      assert [r if isinstance(r, str) else (r.observation, r.reward, r.done) for r in got] == [
          r if isinstance(r, str) else (r.observation, r.reward, r.done) for r in expected
      ]
      assert got[-1].info["success"] == (task_id == 3)
      if style == "sciworld":  # Scores are in points: the solved episode ends at 100.
        assert got[-1].info["score"] == (100.0 if task_id == 3 else 0.0)
    assert remote.instruction == local.instruction
    assert tuple(remote.task_ids("train")) == toy_env.TRAIN_IDS
    assert remote.task_info(5) == local.task_info(5)
    remote.close()
    assert server.num_envs() == 0


def test_payloads_follow_the_environment_style():
  with AgentGymServer("toy", style="textcraft") as server:
    status, created = _request(server.port, "POST", "/create", {})
    assert status == 200 and set(created) == {"id", "observation", "done", "reward"}
    # /create starts task number (id mod 30) of the 30 sorted ids 0..19, 100..109.
    task_ids = toy_env.TRAIN_IDS + toy_env.TEST_IDS
    task_id = task_ids[created["id"] % 30]
    assert created["observation"].startswith(f"Task {task_id}:")
    hidden = toy_env.secret(task_id)
    status, stepped = _request(server.port, "POST", "/step",
                               {"id": created["id"], "action": f"Action: guess {hidden}"})
    assert stepped["reward"] == 1.0 and stepped["done"] and "score" not in stepped
    assert _request(server.port, "GET",
                    f"/observation?id={created['id']}") == (200, f"Guess 1: {hidden} is correct.")
  with AgentGymServer("toy", style="sciworld") as server:
    status, created = _request(server.port, "POST", "/create")
    assert status == 200 and set(created) == {"id"}
    status, reset = _request(server.port, "POST", "/reset", {"id": created["id"], "data_idx": 0})
    assert reset["score"] == 0.0 and reset["task_description"] == ""
    status, stepped = _request(server.port, "POST", "/step",
                               {"id": created["id"], "action": "Action: guess 3"})
    # A normalised reward of 1 is 100 points.
    assert (stepped["reward"], stepped["score"], stepped["success"]) == (100.0, 100.0, True)


@pytest.fixture(scope="module")
def shared_server():
  with AgentGymServer("toy", style="babyai", max_body_bytes=1024) as server:
    _, created = _request(server.port, "POST", "/create")
    server.fresh_id = created["id"]  # Created, never reset.
    yield server


_UNKNOWN = 987654321987


@pytest.mark.parametrize(
    "method, path, body, headers, status, message",
    [
        ("POST", "/step", b"{bad", None, 400, "malformed JSON"),
        ("POST", "/step", b"\xff\xfe", None, 400, "malformed JSON"),
        ("POST", "/step", b"[1, 2]", None, 400, "must be an object, got list"),
        ("POST", "/step", b"", None, 400, "missing JSON body"),
        ("POST", "/step", {"id": 1}, None, 400, "missing field 'action'"),
        ("POST", "/step", {"action": "x"}, None, 400, "missing field 'id'"),
        ("POST", "/step", {"id": "1", "action": "x"}, None, 400, "'id' must be an integer"),
        ("POST", "/step", {"id": True, "action": "x"}, None, 400, "'id' must be an integer"),
        ("POST", "/step", {"id": 1.0, "action": "x"}, None, 400, "'id' must be an integer"),
        ("POST", "/step", {"id": 1, "action": 5}, None, 400, "'action' must be a string"),
        ("POST", "/reset", {"id": -1, "data_idx": 0}, None, 400, "'id' must be >= 0"),
        ("POST", "/reset", {"id": "FRESH", "data_idx": 55
                           }, None, 200, "data_idx 55 is not a task id"),
        ("POST", "/reset", {"id": "FRESH"}, None, 400, "missing field 'data_idx'"),
        ("POST", "/step", {"id": _UNKNOWN, "action": "x"}, None, 200, "unknown env id"),
        ("POST", "/reset", {"id": _UNKNOWN, "data_idx": 0}, None, 200, "unknown env id"),
        ("GET", f"/observation?id={_UNKNOWN}", None, None, 200, "unknown env id"),
        ("GET", "/observation", None, None, 400, "missing query parameter 'id'"),
        ("GET", "/observation?id=abc", None, None, 400, "must be a non-negative integer"),
        ("GET", "/task_ids?split=dev", None, None, 400, "'split' must be one of"),
        ("GET", "/task_info?data_idx=55", None, None, 200, "data_idx 55 is not a task id"),
        ("POST", "/step", {"id": "FRESH", "action": "x"
                          }, None, 200, "has finished (or failed, or was never reset)"),
        ("POST", "/steps", {}, None, 404, "unknown route POST /steps"),
        ("GET", "/step", None, None, 405, "/step takes POST, not GET"),
        ("DELETE", "/create", None, None, 405, "/create takes POST"),
        ("POST", "/step", "2000 BYTES", None, 413, "2000 bytes is over the limit of 1024"),
        # Larger than the socket buffers: the client is still sending when the server answers.
        ("POST", "/step", "8 MIB", None, 413, "8388608 bytes is over the limit of 1024"),
        ("POST", "/step", b"5\r\nhello\r\n0\r\n\r\n", {"Transfer-Encoding": "chunked"
                                                      }, 411, "chunked"),
        ("POST", "/step", b"{}", {"Content-Length": "-3"}, 400, "bad Content-Length"),
    ])
def test_bad_requests_get_json_4xx_answers(shared_server, method, path, body, headers, status,
                                           message):
  if isinstance(body, dict) and body.get("id") == "FRESH":
    body = {**body, "id": shared_server.fresh_id}
  elif body == "2000 BYTES":
    body = b"x" * 2000
  elif body == "8 MIB":
    body = b"x" * (8 << 20)
  got_status, payload = _request(shared_server.port, method, path, body, headers)
  assert got_status == status, payload
  assert message in payload["error"], payload
  # The server keeps serving.
  assert _request(shared_server.port, "GET", "/")[0] == 200


def test_a_failing_adapter_gets_500_for_its_env_only(server):
  broken, healthy = (AgentGymClient(server.url, "toy", retries=0) for _ in range(2))
  broken.reset(0)
  healthy.reset(1)
  created = toy_env.ToyEnv.created
  with pytest.raises(EnvError, match=r"\(500\).*RuntimeError: the toy env crashed on purpose"):
    broken.step("Action: crash")
  assert healthy.step("Action: guess 0").reward == 1.0
  # The broken env's next reset builds a fresh adapter under the same id.
  assert broken.reset(2).startswith("Task 2:")
  assert toy_env.ToyEnv.created == created + 1
  assert broken.step("Action: guess 7").reward == 1.0
  broken.close()
  healthy.close()


def test_concurrent_clients_never_mix_up_states(server):
  num_clients, num_steps = 16, 50
  failures = []

  def play_client(client_index):
    remote = AgentGymClient(server.url, "toy")
    local = toy_env.ToyEnv()
    task_id = client_index
    try:
      assert remote.reset(task_id) == local.reset(task_id)
      for step in range(num_steps):
        reply = f"Action: guess {(3 * client_index + step) % 10}"
        got, expected = remote.step(reply), local.step(reply)
        assert (got.observation, got.reward, got.done) == (expected.observation, expected.reward,
                                                           expected.done), (client_index, step)
        if got.done:
          task_id = (task_id + 1) % len(toy_env.TRAIN_IDS)
          assert remote.reset(task_id) == local.reset(task_id)
    except Exception as e:  # Reported below; an assert in a thread would be lost.
      failures.append(e)
    finally:
      remote.close()

  threads = [threading.Thread(target=play_client, args=(i,)) for i in range(num_clients)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(timeout=60)
  assert not any(thread.is_alive() for thread in threads)
  assert not failures, failures[:3]
  assert server.num_envs() == 0


# Many clients at once against launch/serve_env.py serving TextCraft.

_LOAD_REPLY = "Thought: the plan says so.\n\nAction: {}"
# What the junk client sends while the players play, and the answer each must get; the server
# is started with a body limit of _LOAD_BODY_LIMIT bytes.
_LOAD_BODY_LIMIT = 4096
_JUNK_REQUESTS = (
    ("POST", "/step", b'{"id": 1, "action": ', 400, "malformed JSON"),
    ("POST", "/step", b'{"id": "1", "action": "inventory"}', 400, "'id' must be an integer"),
    ("POST", "/reset", b'{"id": 1, "data_idx": [3]}', 400, "'data_idx' must be an integer"),
    ("POST", "/step", b'{"id": 987654321987, "action": "inventory"}', 200, "unknown env id"),
    ("POST", "/step", b"x" * (2 * _LOAD_BODY_LIMIT), 413, "over the limit"),
)


def _play_oracle_episodes(url, client_index, num_clients, num_steps, task_ids):
  """One client's `num_steps` steps of TextCraft episodes played by the oracle's plan.

  Client i plays tasks i, i + num_clients, ... so that no two clients play the same task at
  once; every answer must equal what an in-process TextCraftEnv answers to the same replies,
  and every episode played to the end of its plan must be solved. Returns the episodes solved.
  """
  remote = AgentGymClient(url, "textcraft", timeout_s=60.0)
  local = TextCraftEnv()
  steps = solved = episode = 0
  try:
    while steps < num_steps:
      task_id = task_ids[(client_index + num_clients * episode) % len(task_ids)]
      episode += 1
      first = remote.reset(task_id)
      assert first == local.reset(task_id), (client_index, task_id)
      for action in solve(first):
        if steps == num_steps:  # The budget ends this episode early.
          return solved
        reply = _LOAD_REPLY.format(action)
        got, expected = remote.step(reply), local.step(reply)
        steps += 1
        assert (got.observation, got.reward, got.done) == (expected.observation, expected.reward,
                                                           expected.done), (client_index, task_id,
                                                                            action)
      assert got.done and got.reward == 1.0 and got.info["success"], (client_index, task_id)
      solved += 1
    return solved
  finally:
    remote.close()


def _send_junk_until(port, stop, answers):
  """Sends _JUNK_REQUESTS round after round until `stop`, on one keep-alive connection (opened
  again after the server closes it); records (request index, status, error) of every answer."""
  connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
  try:
    while not stop.is_set():
      for index, (method, path, body, _, _) in enumerate(_JUNK_REQUESTS):
        connection.request(method, path, body=body)
        response = connection.getresponse()
        answers.append((index, response.status, json.loads(response.read()).get("error", "")))
        if response.getheader("Connection", "").lower() == "close":
          connection.close()  # The next request connects again.
  finally:
    connection.close()


def _load_round(served, num_clients, num_steps, task_ids):
  """Runs the clients (and the junk client) once; returns the server's peak threads and fds."""
  server = psutil.Process(served.pid)
  outcomes, failures, junk_answers, peaks = {}, [], [], {"threads": 0, "fds": 0}
  stop = threading.Event()

  def run(name, function, *args):
    try:
      outcomes[name] = function(*args)
    except Exception as e:  # Reported below; an assert in a thread would be lost.
      failures.append((name, e))

  def watch():
    while not stop.wait(0.05):
      peaks["threads"] = max(peaks["threads"], server.num_threads())
      peaks["fds"] = max(peaks["fds"], server.num_fds())

  players = [
      threading.Thread(
          target=run,
          args=(i, _play_oracle_episodes, served.url, i, num_clients, num_steps, task_ids))
      for i in range(num_clients)
  ]
  helpers = [
      threading.Thread(target=watch),
      threading.Thread(target=run, args=("junk", _send_junk_until, served.port, stop, junk_answers))
  ]
  for thread in players + helpers:
    thread.start()
  for thread in players:
    thread.join(timeout=120)
  stop.set()
  for thread in helpers:
    thread.join(timeout=30)
  assert not any(thread.is_alive() for thread in players + helpers)
  assert not failures, failures[:3]
  solved = [outcomes[i] for i in range(num_clients)]
  assert min(solved) >= 1, solved
  # Every junk request got its own answer, never another's: a 4xx, or the 200 {error} of an
  # unknown env id, as the original servers answer it; never a 5xx.
  assert {index for index, _, _ in junk_answers} == set(range(len(_JUNK_REQUESTS)))
  for index, status, error in junk_answers:
    _, _, _, expected_status, expected_message = _JUNK_REQUESTS[index]
    assert status == expected_status and expected_message in error, (index, status, error)
  return peaks


def _server_resources(served):
  server = psutil.Process(served.pid)
  return {
      "threads": server.num_threads(), "fds": server.num_fds(),
      "rss_mb": server.memory_info().rss / 2**20
  }


def _check_load(num_clients, num_steps, rounds):
  """`rounds` rounds of num_clients x num_steps against launch/serve_env.py: every answer
  right, and the server's threads and fds back to idle after each round. Returns the server's
  resident memory (MB) after each round."""
  task_ids = TextCraftEnv().task_ids("train")
  with serve_in_subprocess("textcraft", max_body_bytes=_LOAD_BODY_LIMIT) as served:
    assert _request(served.port, "GET", "/")[1]["envs"] == 0
    idle = _server_resources(served)
    rss_after_rounds = []
    for _ in range(rounds):
      peaks = _load_round(served, num_clients, num_steps, task_ids)
      # One handler thread and one socket per connection: one per player, the junk client's
      # (two while a refused one closes), and a few spare for connections still closing.
      for resource in ("threads", "fds"):
        assert peaks[resource] <= idle[resource] + num_clients + 6, (peaks, idle)
      # Every client closed its env and its connection: the server is back to idle.
      assert _request(served.port, "GET", "/")[1]["envs"] == 0
      for resource in ("threads", "fds"):
        assert wait_until(lambda: _server_resources(served)[resource] <= idle[resource]), (
            _server_resources(served), idle)
      rss_after_rounds.append(_server_resources(served)["rss_mb"])
  return rss_after_rounds


@pytest.mark.parametrize("num_steps", [60, pytest.param(200, marks=pytest.mark.slow)])
def test_32_clients_at_once_get_their_own_answers_and_leave_nothing_behind(num_steps):
  """32 clients x num_steps steps, twice (~8 s for 60 steps, ~17 s for 200 on 2 cores)."""
  rss_after_rounds = _check_load(num_clients=32, num_steps=num_steps, rounds=2)
  # The second round plays the same episodes as the first: it must not need more memory.
  assert rss_after_rounds[1] - rss_after_rounds[0] < 8.0, rss_after_rounds


def test_idle_envs_are_closed_and_a_reset_recreates_them():
  with AgentGymServer("toy", idle_timeout_s=0.3) as server:
    client = AgentGymClient(server.url, "toy")
    client.reset(0)
    closed = toy_env.ToyEnv.closed
    assert wait_until(lambda: server.num_envs() == 0, timeout_s=5)
    assert toy_env.ToyEnv.closed == closed + 1
    with pytest.raises(EnvError, match="lost env mid-episode"):
      client.step("Action: guess 3")
    assert client.reset(1).startswith("Task 1:")  # Transparently a new env.
    assert client.step("Action: guess 0").reward == 1.0
    client.close()


def test_the_server_holds_at_most_max_envs():
  with AgentGymServer("toy", max_envs=2) as server:
    first, second, third = (
        AgentGymClient(server.url, "toy", retries=1, backoff_s=0.01) for _ in range(3))
    first.reset(0)
    second.reset(0)
    with pytest.raises(EnvError, match=r"\(503\).*maximum of 2 envs"):
      third.reset(0)
    first.close()
    assert third.reset(0).startswith("Task 0:")
    second.close()
    third.close()


def test_the_client_rides_out_a_server_restart():
  port = free_port()
  client = AgentGymClient(f"http://127.0.0.1:{port}", "toy", retries=8, backoff_s=0.05)
  servers = []

  def restart(delay_s):
    starter = threading.Timer(delay_s,
                              lambda: servers.append(AgentGymServer("toy", port=port).start()))
    starter.start()
    return starter

  try:
    servers.append(AgentGymServer("toy", port=port).start())
    client.reset(3)
    assert client.step("Action: guess 1").observation == "Guess 1: 1 is too low."

    # Down while the client resets: it retries until the new server answers, finds its env
    # gone (the new server never issued that id) and creates another.
    servers[-1].shutdown()
    starter = restart(0.3)
    assert client.reset(3).startswith("Task 3:")
    starter.join()
    assert client.step("Action: guess 4").reward == 1.0

    # Down mid-episode: the step reaches the new server, which cannot know the episode.
    client.reset(5)
    servers[-1].shutdown()
    starter = restart(0.3)
    with pytest.raises(EnvError, match="lost env mid-episode"):
      client.step("Action: guess 8")
    starter.join()
    assert client.reset(5).startswith("Task 5:")
    assert client.step("Action: guess 8").reward == 1.0
  finally:
    client.close()
    for server in servers:
      server.shutdown()


def test_an_unreachable_server_is_a_clear_error():
  url = f"http://127.0.0.1:{free_port()}"
  client = AgentGymClient(url, "toy", retries=2, backoff_s=0.01)
  with pytest.raises(EnvError, match=rf"{url} POST /create failed after 3 attempts.*connect"):
    client.reset(0)
  with pytest.raises(ValueError, match="base_url"):
    AgentGymClient("127.0.0.1:80", "toy")


def test_retries_back_off_doubling_up_to_the_cap():
  endpoint = Endpoint("http://127.0.0.1:1/api/", timeout_s=1.0, retries=4, backoff_s=0.1,
                      max_backoff_s=0.3)
  assert endpoint.base_url == "http://127.0.0.1:1/api" and endpoint.url.path == "/api"
  # No wait before the first attempt; then 0.1, 0.2, and 0.4 capped to 0.3, twice.
  assert list(endpoint.delays()) == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.3])
  assert list(endpoint.delays(retries=1)) == pytest.approx([0.0, 0.1])
  for bad in ({"retries": -1}, {"backoff_s": -0.1}, {"timeout_s": 0.0}):
    with pytest.raises(ValueError):
      Endpoint(
          **{
              "base_url": "http://h:1", "timeout_s": 1.0, "retries": 1, "backoff_s": 0.1,
              "max_backoff_s": 1.0, **bad
          })


class _OriginalScoreServer(http.server.BaseHTTPRequestHandler):
  """Answers like AgentGym's BabyAI or SciWorld server (the `style` attribute): bare actions,
  a running "score", HTTP 200 even for errors, none of our extra routes.

  Scores: BabyAI style pays 0.5 for a success (minigrid pays less for late successes); SciWorld
  style gives 10 points per guess, 100 for the right one and -100 when out of guesses.
  """

  protocol_version = "HTTP/1.1"
  style = "babyai"
  envs: dict = {}
  actions: list = []

  def do_POST(self):
    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
    if self.path == "/create":
      env_id = len(self.envs)
      self.envs[env_id] = {"env": toy_env.ToyEnv(), "score": 0.0, "guesses": 0}
      payload = {"id": env_id}
    elif body.get("id") not in self.envs:
      payload = {"error": f"The id {body.get('id')} is not valid."}
    elif self.path == "/reset":
      state = self.envs[body["id"]]
      state.update(score=0.0, guesses=0)
      payload = {
          "observation": state["env"].reset(body["data_idx"]), "reward": 0, "score": 0,
          "done": False
      }
      if self.style == "sciworld":
        payload["task_description"] = "Your task is to find the digit."
    else:
      self.actions.append(body["action"])
      state = self.envs[body["id"]]
      result = state["env"].step(f"Action: {body['action']}")
      state["guesses"] += 1
      if self.style == "babyai":
        state["score"] += 0.5 * result.reward
      elif result.reward:
        state["score"] = 100.0
      else:
        state["score"] = -100.0 if result.done else 10.0 * state["guesses"]
      payload = {
          "observation": result.observation, "reward": 0, "score": state["score"],
          "done": result.done
      }
    self._send(payload)

  def do_GET(self):  # The routes only our server has: FastAPI's 404.
    self._send({"detail": "Not Found"}, status=404)

  def _send(self, payload, status=200):
    data = json.dumps(payload).encode()
    self.send_response(status)
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def log_message(self, *args):
    pass


@pytest.fixture
def original_server():
  """Starts an original-style server; the test sets its style."""
  _OriginalScoreServer.envs, _OriginalScoreServer.actions = {}, []
  original = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OriginalScoreServer)
  thread = threading.Thread(target=original.serve_forever, kwargs={"poll_interval": 0.05})
  thread.start()
  yield f"http://127.0.0.1:{original.server_port}"
  original.shutdown()
  original.server_close()
  thread.join()


def test_the_client_speaks_to_original_babyai_servers(original_server):
  _OriginalScoreServer.style = "babyai"
  client = AgentGymClient(original_server, "babyai", extract_action=True,
                          instruction="Find the digit.", task_ids={"train": [0, 1],
                                                                   "test": [100]}, retries=0)
  assert client.instruction == "Find the digit." and client.task_ids("test") == (100,)
  assert client.reset(0).startswith("Task 0:")
  first = client.step("Thought: try 1.\n\nAction: guess 1\n")
  solved = client.step("Thought: higher.\n\nAction: guess 3")
  assert _OriginalScoreServer.actions == ["guess 1", "guess 3"]
  assert (first.reward, first.done, first.info["success"]) == (0.0, False, False)
  # Score went 0 -> 0.5: the normalised reward is the increment, and a score > 0 succeeds.
  assert (solved.reward, solved.done, solved.info["success"]) == (0.5, True, True)
  # The server forgot every env (a restart): the next reset creates a new one.
  _OriginalScoreServer.envs.clear()
  assert client.reset(1).startswith("Task 1:")
  with pytest.raises(EnvError, match="does not serve GET /task_info"):
    client.task_info(0)
  client.close()


def test_the_client_speaks_to_original_sciworld_servers(original_server):
  _OriginalScoreServer.style = "sciworld"
  client = AgentGymClient(original_server, "sciworld", extract_action=True, retries=0)
  # The task description comes first, as the original client renders it.
  assert client.reset(3) == (
      "Your task is to find the digit.\nTask 3: guess the secret digit in at most 5 guesses.")
  solved = [client.step(f"Action: guess {n}") for n in (1, 2, 3, 4)]  # secret(3) = 4
  # Scores 10, 20, 30, 100 points: rewards 0.1, 0.1, 0.1, 0.7, summing to 100 / 100.
  assert [r.reward for r in solved] == pytest.approx([0.1, 0.1, 0.1, 0.7])
  assert solved[-1].done and solved[-1].info == {"score": 100.0, "success": True}
  client.reset(5)  # secret(5) = 8: five wrong guesses.
  failed = [client.step(f"Action: guess {n}") for n in range(5)]
  # Scores 10, 20, 30, 40, then -100: a failure takes back the 40 points of progress, so the
  # rewards sum to max(-100, 0) / 100 = 0, as our SciWorld adapter's do.
  assert [r.reward for r in failed] == pytest.approx([0.1, 0.1, 0.1, 0.1, -0.4])
  assert failed[-1].done and failed[-1].info == {"score": -100.0, "success": False}
  with pytest.raises(EnvError, match="does not serve GET /instruction.*pass instruction="):
    client.instruction
  client.close()


def test_extract_action_takes_the_line_after_the_last_marker():
  assert extract_action("Thought: a.\n\nAction: get 1 oak log\n") == "get 1 oak log"
  assert extract_action("Action: inventory\nAction:\n  craft 1 stick\nextra") == "craft 1 stick"
  assert extract_action("  look  ") == "look"


def test_a_pool_of_remote_envs_plays_like_local_ones(server):
  tasks = [3, 5, 7]
  with EnvPool("http", num_slots=3, options={"base_url": server.url, "env": "toy"}) as pool:
    first = pool.reset(list(enumerate(tasks)))
    assert [result.observation for result in first
           ] == [toy_env.ToyEnv().reset(task) for task in tasks]
    results = pool.step([(slot, "Action: guess 4") for slot in range(3)])
    # Secrets: task 3 -> 4, task 5 -> 8, task 7 -> 2.
    assert [(r.reward, r.done) for r in results] == [(1.0, True), (0.0, False), (0.0, False)]
  assert server.num_envs() == 0  # Closing the pool closed the remote envs.


def test_shutdown_leaves_no_threads_behind():
  threads = set(threading.enumerate())
  with AgentGymServer("toy") as server:
    clients = [AgentGymClient(server.url, "toy") for _ in range(4)]
    for client in clients:
      client.reset(0)  # Keep-alive connections stay open until shutdown drops them.
  assert wait_until(lambda: set(threading.enumerate()) == threads), threading.enumerate()
  for client in clients:
    client.close()


@pytest.mark.parametrize(
    "method, path, body, message",
    [
        ("POST", "/step", b"[" * 100_000, "nested too deeply"),
        ("POST", "/create", b'{"a": ' * 50_000, "nested too deeply"),
        ("POST", "/step", b'{"id": ' + b"9" * 5000 + b', "action": "x"}', "malformed JSON"),
        ("GET", "/observation?id=%C2%B2", None, "must be a non-negative integer"),  # '²'
        ("GET", "/task_info?data_idx=%C2%B2", None, "must be a non-negative integer"),
        ("GET", "/observation?id=" + "9" * 5000, None, "of at most 18 digits"),
    ])
def test_hostile_inputs_get_400_not_500(server, method, path, body, message):
  status, payload = _request(server.port, method, path, body)
  assert status == 400 and message in payload["error"], payload
  assert _request(server.port, "GET", "/")[0] == 200


@pytest.mark.parametrize("line",
                         [b"GET / extra HTTP/1.1", b"GARBAGE", b"GET", b"\x16\x03\x01\x02\x00"])
def test_an_unparseable_request_line_is_answered_under_a_status_line(server, line):
  with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
    raw.sendall(line + b"\r\n\r\n")
    answer = raw.makefile("rb").read()  # The server closes the connection after answering.
  head, _, body = answer.partition(b"\r\n\r\n")
  assert head.split(b"\r\n")[0] == b"HTTP/1.1 400 Bad Request", answer[:200]
  assert json.loads(body)["code"] == "bad_request"
  assert "Bad request syntax" in json.loads(body)["error"]
  assert _request(server.port, "GET", "/")[0] == 200  # The server keeps serving.


def test_a_client_gone_mid_request_is_one_log_line_not_a_traceback(server, capfd):
  # The client sends a request and resets the connection at once (SO_LINGER 0), so the
  # server's answer meets a reset socket.
  for _ in range(20):
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    raw.sendall(b"POST /create HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    raw.close()
  wait_until(lambda: _request(server.port, "GET", "/")[0] == 200)
  assert "Traceback" not in capfd.readouterr().err
