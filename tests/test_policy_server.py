"""The OpenAI-compatible policy server (agentgym_jax/serving.py), driven by the openai client: its
replies are the sampler's, streamed or not; tool calls both ways; concurrent requests decoded in
one batch; a client that leaves frees its row; OpenAI's error body for every bad request; and a
TextCraft evaluation written as an outside harness would write it scores what the project's own
evaluation scores."""

import http.client
import json
import socket
import threading
import time

import jax
import jax.numpy as jnp
import openai
import pytest
import requests

import tiny
from agentgym_jax import evaluation, judge, load_model, rollout
from agentgym_jax.sampling import Sampler, SamplingParams
from agentgym_jax.serving import (PolicyServer, Reply, ToolCall, parse_tool_calls,
                                  template_messages, tool_call_block)
from environments import base as env_base
from environments.http import AgentGymServer
from environments.pool import EnvPool
from http_helpers import wait_until

MODEL = "tiny-policy"
ROWS, CONTEXT, CHUNK = 16, 512, 8
# Prompts whose greedy replies (seed-3 tiny model) differ: on the CPU these tests were written on,
# whitespace and words ending on the turn end after 5 and 21 tokens, and special tokens and
# digits that run to the budget.
PROMPTS = ("1 0 1", "1 1 1 1", "0")
GET_TOOL = {
    "type": "function", "function": {
        "name": "get", "description": "Get an item.", "parameters": {
            "type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]
        }
    }
}


def user(content):
  return {"role": "user", "content": content}


def assistant_call(arguments, content=None, call_id="c"):
  """An assistant message calling "get" with `arguments` (JSON text)."""
  call = {"id": call_id, "type": "function", "function": {"name": "get", "arguments": arguments}}
  return {"role": "assistant", "content": content, "tool_calls": [call]}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
  directory = tiny.make_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)
  return load_model(str(directory), dtype=jnp.float32, param_dtype=jnp.float32)


@pytest.fixture(scope="module")
def server(policy):
  model, tokenizer = policy
  with PolicyServer(model, tokenizer, model_name=MODEL, max_batch=ROWS, max_context=CONTEXT,
                    chunk_tokens=CHUNK) as server:
    yield server


@pytest.fixture
def client(server):
  return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def record_generate(server, monkeypatch, delay_s=0.0):
  """The rows of each of the server's decode calls, from now on (each call delayed by delay_s)."""
  calls, generate = [], server.sampler.generate

  def recorded(state, key, **kwargs):
    calls.append(list(kwargs["rows"]))
    time.sleep(delay_s)
    return generate(state, key, **kwargs)

  monkeypatch.setattr(server.sampler, "generate", recorded)
  return calls


def sampler_replies(policy, prompts, max_tokens):
  """The sampler's own greedy replies to one user message each, on a sampler like the server's
  (one prompt at a time, as the server got them): [(ids, text)]."""
  model, tokenizer = policy
  chat = tokenizer.chat
  sampler = Sampler(model, cache_slots=CONTEXT, max_batch=ROWS)
  replies = []
  for prompt in prompts:
    state = sampler.start([chat.render([user(prompt)])])
    _, out = sampler.generate(state, jax.random.key(0), max_new_tokens=max_tokens,
                              stop_ids=chat.turn_end_ids, sampling=SamplingParams(0.0))
    ids = out.token_lists()[0]
    text = tokenizer.decode([t for t in ids if t not in chat.turn_end_ids],
                            skip_special_tokens=True)
    replies.append((ids, text))
  return replies


def test_models_lists_the_served_model(client):
  assert [model.id for model in client.models.list().data] == [MODEL]
  assert client.models.retrieve(MODEL).owned_by == "agentgym-jax"
  with pytest.raises(openai.NotFoundError):
    client.models.retrieve("gpt-4o")


def test_a_greedy_completion_is_the_samplers_reply(client, policy):
  chat = policy[1].chat
  for prompt, (ids, text) in zip(PROMPTS, sampler_replies(policy, PROMPTS, 40)):
    completion = client.chat.completions.create(model=MODEL, messages=[user(prompt)], temperature=0,
                                                max_tokens=40)
    (choice,) = completion.choices
    assert choice.message.content == text and choice.message.role == "assistant"
    assert completion.usage.completion_tokens == len(ids)
    assert completion.usage.prompt_tokens == len(chat.render([user(prompt)]))
    assert completion.usage.total_tokens == len(ids) + completion.usage.prompt_tokens
    assert choice.finish_reason == ("stop" if ids[-1] in chat.turn_end_ids else "length")
    assert completion.model == MODEL and completion.object == "chat.completion"


def test_streamed_deltas_add_up_to_the_unstreamed_reply(client):
  for prompt in PROMPTS:
    whole = client.chat.completions.create(model=MODEL, messages=[user(prompt)], temperature=0,
                                           max_tokens=40)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=[user(prompt)], temperature=0,
                                       max_tokens=40, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content for c in chunks if c.choices]
    assert "".join(filter(None, deltas)) == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_the_tool_call_parser_on_worked_examples():
  names = frozenset({"get", "craft"})
  call = ('I need planks.\n\n<tool_call>\n{"name": "get", "arguments": {"item": "oak"}}\n'
          '</tool_call>')
  assert parse_tool_calls(call, names) == ("I need planks.", [ToolCall("get", '{"item": "oak"}')])
  # Two calls, no text before them; "parameters" is read as the arguments too.
  two = ('<tool_call>{"name": "get", "arguments": {}}</tool_call>\n'
         '<tool_call>{"name": "craft", "parameters": {"count": 2}}</tool_call>')
  assert parse_tool_calls(two,
                          names) == (None,
                                     [ToolCall("get", "{}"),
                                      ToolCall("craft", '{"count": 2}')])
  # Llama 3.1's bare JSON call, when it names a tool.
  bare = '{"name": "craft", "parameters": {"target": "stick"}}'
  assert parse_tool_calls(bare, names) == (None, [ToolCall("craft", '{"target": "stick"}')])
  assert parse_tool_calls('{"name": "fly", "parameters": {}}', names)[1] == []
  # What is no call stays text, whole: malformed JSON, a block left open, arguments that are no
  # object, a call without a name.
  for text in ('Try <tool_call>{"name": get}</tool_call>', 'Try <tool_call>{"name": "get"',
               call + '\n<tool_call>{"name": "get"',
               '<tool_call>{"name": "get", "arguments": [1]}</tool_call>',
               '<tool_call>{"arguments": {}}</tool_call>', "Just text."):
    assert parse_tool_calls(text, names) == (text, [])
  # A call written back into a conversation is the reply the tool_call action format samples.
  assert "I need planks.\n\n" + tool_call_block("get", {"item": "oak"}) == (
      env_base.tool_call_reply("I need planks.", "get", {"item": "oak"}))


def test_openai_messages_become_the_templates_turns():
  messages = [
      {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
      {
          "role": "user", "content": [{"type": "text", "text": "Get oak"},
                                      {"type": "text", "text": "now."}]
      },
      {
          "role":
              "assistant", "content":
                  "On it.", "tool_calls": [
                      {
                          "id": "call_1", "type": "function",
                          "function": {"name": "get", "arguments": '{"item": "oak"}'}
                      },
                      {
                          "id": "call_2", "type": "function",
                          "function": {"name": "inventory", "arguments": "{}"}
                      },
                  ]
      },
      {"role": "tool", "tool_call_id": "call_1", "content": "Got 1 oak."},
      {"role": "tool", "tool_call_id": "call_2", "content": "Inventory: oak"},
      {
          "role":
              "assistant", "content":
                  None, "tool_calls": [{
                      "id": "call_3", "type": "function",
                      "function": {"name": "get", "arguments": "{}"}
                  }]
      },
      {"role": "tool", "tool_call_id": "call_3", "content": "Nothing."},
      {"role": "assistant", "content": "Done.", "name": "agent"},
  ]
  get_oak = '<tool_call>\n{"name": "get", "arguments": {"item": "oak"}}\n</tool_call>'
  inventory = '<tool_call>\n{"name": "inventory", "arguments": {}}\n</tool_call>'
  get = '<tool_call>\n{"name": "get", "arguments": {}}\n</tool_call>'
  assert template_messages(messages, "ChatML") == [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Get oak\nnow."},
      {"role": "assistant", "content": f"On it.\n\n{get_oak}\n{inventory}"},
      # ChatML: a run of results is one user turn, each result in <tool_response> tags.
      {
          "role": "user", "content": "<tool_response>\nGot 1 oak.\n</tool_response>\n"
                                     "<tool_response>\nInventory: oak\n</tool_response>"
      },
      {"role": "assistant", "content": get},
      {"role": "user", "content": "<tool_response>\nNothing.\n</tool_response>"},
      {"role": "assistant", "content": "Done."},
  ]
  llama = template_messages(messages, "Llama 3")  # Llama 3: an ipython turn per result.
  assert [turn["role"] for turn in llama] == [
      "system", "user", "assistant", "ipython", "ipython", "assistant", "ipython", "assistant"
  ]
  assert llama[3]["content"] == "Got 1 oak."


def test_a_reply_streams_only_what_no_later_token_takes_back():
  # One character per token: the decode of ids is the script's first len(ids) characters.
  script = 'Thinking STO now.\n<tool_call>\n{"name": "get", "arguments": {}}\n</tool_call>'

  def reply(**options):
    return Reply(lambda ids: script[:len(ids)], end_ids=[99], max_tokens=200, **options)

  stopped = reply(stop=["STOP", "now"])
  assert stopped.extend(range(11)) == "Thinking "  # "ST" may begin "STOP": held back.
  assert stopped.extend(range(3)) == "STO "  # It did not; "n" may begin "now".
  assert stopped.extend(range(3)) == "" and stopped.finish_reason == "stop"
  assert stopped.content == "Thinking STO " and len(stopped.ids) == 16  # Through "now"'s "w".

  tools = reply(tool_names=frozenset({"get"}))
  streamed = tools.extend(range(20)) + tools.extend(range(5))
  assert streamed == "Thinking STO now."  # Held from the first "<" on.
  assert tools.extend(range(len(script) - 25)) == "" and not tools.finished
  assert tools.extend([99]) == "" and tools.finish_reason == "tool_calls"
  assert tools.content == "Thinking STO now." and tools.tool_calls == [ToolCall("get", "{}")]

  # Cut by its budget, the same reply is text: its streamed deltas add up to all of it.
  cut = Reply(lambda ids: script[:len(ids)], end_ids=[99], max_tokens=30,
              tool_names=frozenset({"get"}))
  streamed = cut.extend(range(20)) + cut.extend(range(20))
  assert cut.finish_reason == "length" and streamed == cut.content == script[:30]


def test_a_reply_that_calls_a_tool_comes_back_as_tool_calls(server, client, policy, monkeypatch):
  tokenizer = policy[1]
  script = ('Checking the chest.\n\n<tool_call>\n{"name": "get", "arguments": {"item": "oak"}}\n'
            '</tool_call>\nEND of the turn')
  # The tiny model writes no JSON: each of its tokens decodes to 4 characters of the script,
  # and the stop string "END" ends the turn after the call.
  monkeypatch.setattr(tokenizer, "decode",
                      lambda ids, skip_special_tokens=False: script[:4 * len(ids)])
  prompts, append = [], server.sampler.append
  monkeypatch.setattr(
      server.sampler, "append",
      lambda state, rows, *a: prompts.extend(rows.values()) or append(state, rows, *a))
  messages = [{"role": "system", "content": "You craft."},
              user("Get oak."),
              assistant_call('{"item": "log"}', "Looking.", "call_0"),
              {"role": "tool", "tool_call_id": "call_0", "content": "No log here."}]
  request = dict(model=MODEL, messages=messages, tools=[GET_TOOL], temperature=0, max_tokens=60,
                 stop="END")
  completion = client.chat.completions.create(**request)
  (choice,) = completion.choices
  assert choice.finish_reason == "tool_calls"
  assert choice.message.content == "Checking the chest."
  (call,) = choice.message.tool_calls
  assert call.type == "function" and call.id.startswith("call_")
  assert call.function.name == "get" and json.loads(call.function.arguments) == {"item": "oak"}
  # The prompt: the model's template with the tools shown, the earlier call and its result in
  # the layout the server writes them.
  looking = "Looking.\n\n" + tool_call_block("get", {"item": "log"})
  turns = [{"role": "system", "content": "You craft."},
           user("Get oak."), {"role": "assistant", "content": looking},
           user("<tool_response>\nNo log here.\n</tool_response>")]
  chat = tokenizer.chat
  assert prompts == [chat.render(turns, tools=[GET_TOOL])]
  assert '"name": "get"' in chat.render_text(turns, tools=[GET_TOOL])
  assert prompts[0] != chat.render(turns)

  # The call and its result sent back as the openai client's objects.
  result = {"role": "tool", "tool_call_id": call.id, "content": "Got 1 oak."}
  client.chat.completions.create(**{**request, "messages": [*messages, choice.message, result]})
  checking = "Checking the chest.\n\n" + tool_call_block("get", {"item": "oak"})
  assert prompts[-1] == chat.render([
      *turns, {"role": "assistant", "content": checking},
      user("<tool_response>\nGot 1 oak.\n</tool_response>")
  ], tools=[GET_TOOL])

  chunks = list(client.chat.completions.create(**request, stream=True))
  text = "".join(c.choices[0].delta.content or "" for c in chunks)
  (streamed_call,) = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
  assert text == "Checking the chest." and chunks[-1].choices[0].finish_reason == "tool_calls"
  assert streamed_call.index == 0 and streamed_call.function.name == "get"
  assert streamed_call.function.arguments == call.function.arguments
  # With tool_choice "none" the tools are not shown and the reply is text.
  plain = client.chat.completions.create(**request, tool_choice="none")
  assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.tool_calls is None
  assert plain.choices[0].message.content == script[:script.index("END")]
  assert prompts[-1] == chat.render(turns)


def test_concurrent_requests_are_decoded_in_one_batch(server, client, monkeypatch):
  # 20 clients at once: the first 16 start together (the batch window ends once the rows are
  # full), the other 4 wait in the queue for rows to free.
  monkeypatch.setattr(server.scheduler, "batch_window_s", 30.0)
  calls = record_generate(server, monkeypatch)
  prompts = [" ".join(["1", "0"][i % 2] * (1 + i // 2)) for i in range(20)]
  replies = [None] * 20

  def ask(index):
    replies[index] = client.chat.completions.create(model=MODEL, messages=[user(prompts[index])],
                                                    temperature=0, max_tokens=3 * CHUNK)

  threads = [threading.Thread(target=ask, args=(i,)) for i in range(20)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert len(calls[0]) == ROWS and max(map(len, calls)) == ROWS
  assert sum(map(len, calls)) >= 20  # Every request was decoded.
  monkeypatch.setattr(server.scheduler, "batch_window_s", 0.0)
  # Each reply is the one the same request gets alone: rows do not mix.
  for prompt, reply in zip(prompts[::5], replies[::5]):
    alone = client.chat.completions.create(model=MODEL, messages=[user(prompt)], temperature=0,
                                           max_tokens=3 * CHUNK)
    assert reply.choices[0].message.content == alone.choices[0].message.content
    assert reply.usage == alone.usage


def test_the_policy_server_serves_as_a_judge_with_the_samplers_replies(server, policy, monkeypatch):
  # The judge's HTTP backend speaks to this server as to any OpenAI-compatible one: a step's
  # prompts arrive together and are decoded in one batch, and each reply is the one the
  # sampler-run judge of the same model writes.
  monkeypatch.setattr(server.scheduler, "batch_window_s", 30.0)
  calls = record_generate(server, monkeypatch)
  chats = [judge.chat(f"grade {' '.join('10'[i % 2] * (i + 1))}") for i in range(ROWS)]
  served = judge.HTTPBackend(f"{server.url}/v1", MODEL, max_new_tokens=CHUNK, timeout_s=60,
                             concurrency=ROWS).complete(chats)
  assert len(calls[0]) == ROWS
  model, tokenizer = policy
  local = judge.SamplerBackend(model, tokenizer.chat_template(), identity="tiny", rows=ROWS,
                               max_context=CONTEXT, max_new_tokens=CHUNK).complete(chats)
  assert all(isinstance(reply, str) for reply in served)
  assert served == local and len(set(served)) > 1  # Distinct replies: rows do not mix.


def test_n_choices_and_seeded_sampling(client):
  request = dict(model=MODEL, messages=[user("1 0")], temperature=1.0, top_p=0.9, max_tokens=16,
                 seed=1234)
  two = client.chat.completions.create(**request, n=2)
  assert [choice.index for choice in two.choices] == [0, 1]
  one = client.chat.completions.create(**request)
  again = client.chat.completions.create(**request)
  # Choice 0 of a seeded request is the same whatever n is, and whenever it is asked.
  assert one.choices[0].message.content == again.choices[0].message.content
  assert one.choices[0].message.content == two.choices[0].message.content
  assert two.usage.prompt_tokens == one.usage.prompt_tokens
  # Streamed, the two choices interleave, each under its index.
  chunks = list(
      client.chat.completions.create(**request, n=2, stream=True,
                                     stream_options={"include_usage": True}))
  texts = ["", ""]
  for chunk in chunks[:-1]:
    (choice,) = chunk.choices
    texts[choice.index] += choice.delta.content or ""
  assert texts == [choice.message.content for choice in two.choices]
  assert chunks[-1].usage == two.usage


def test_a_client_that_leaves_frees_its_row(server, client, monkeypatch):
  # A request whose greedy reply runs to its budget of 50 decode calls (of a few candidates).
  for prompt in ("0", "user 0", "0 0", "1"):
    request = dict(model=MODEL, messages=[user(prompt)], temperature=0, max_tokens=400)
    if client.chat.completions.create(**request).choices[0].finish_reason == "length":
      break
  else:
    pytest.fail("no candidate prompt's greedy reply runs to its budget")
  calls = record_generate(server, monkeypatch, delay_s=0.05)
  stream = client.chat.completions.create(**request, stream=True)
  assert next(iter(stream)).choices[0].delta.role == "assistant"
  assert wait_until(lambda: server.load()["live"] == 1, timeout_s=10)
  stream.close()  # While its row decodes.
  assert wait_until(lambda: server.load()["live"] == 0, timeout_s=10)
  assert len(calls) < 20
  # Unstreamed: the client sends its request and hangs up.
  body = json.dumps(request).encode()
  with socket.create_connection(("127.0.0.1", server.port)) as sock:
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert wait_until(lambda: server.load()["live"] == 1, timeout_s=10)
  before = len(calls)
  assert wait_until(lambda: server.load()["live"] == 0, timeout_s=10)
  assert len(calls) - before < 20 and server.load() == {"rows": ROWS, "live": 0, "queued": 0}


MESSAGES = [user("1 0")]


def body(**fields):
  """A request body: a valid one, with `fields` changed (None: left out)."""
  payload = {"model": MODEL, "messages": MESSAGES, **fields}
  return {key: value for key, value in payload.items() if value is not None}


def bad_tool(**function):
  return [{"type": "function", "function": {"name": "get", **function}}]


# The last case: the template shows tools with the first user message, which that conversation
# lacks.
@pytest.mark.parametrize("payload, status, param, code", [
    (body(model=None), 400, "model", "missing_required_parameter"),
    (body(model="gpt-4o"), 404, "model", "model_not_found"),
    (body(messages=None), 400, "messages", "missing_required_parameter"),
    (body(messages=[]), 400, "messages", None),
    (body(messages="1 0"), 400, "messages", None),
    (body(messages=[{"role": "robot", "content": "1"}]), 400, "messages[0].role", None),
    (body(messages=[{"role": ["user"], "content": "1"}]), 400, "messages[0].role", None),
    (body(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", None),
    (body(messages=[{"role": "user", "content": None}]), 400, "messages[0].content", None),
    (body(messages=[{"role": "user", "content": "1", "mood": "calm"}]), 400, "messages[0].mood",
     None),
    (body(messages=[{"role": "user", "content": "1", "name": 7}]), 400, "messages[0].name", None),
    (body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages[0].content[0].type", None),
    (body(messages=[user("1"), {"role": "tool", "content": "x"}]), 400, "messages[1].tool_call_id",
     None),
    (body(messages=[user("1"), assistant_call("{oops")]), 400,
     "messages[1].tool_calls[0].function.arguments", None),
    (body(temperature="hot"), 400, "temperature", None),
    (body(temperature=2.5), 400, "temperature", None),
    (body(top_p=0), 400, "top_p", None),
    (body(max_tokens=0), 400, "max_tokens", None),
    (body(max_tokens=True), 400, "max_tokens", None),
    (body(max_completion_tokens=CONTEXT), 400, "max_completion_tokens", "context_length_exceeded"),
    (body(messages=[user("1 " * CONTEXT)]), 400, "messages", "context_length_exceeded"),
    (body(n=0), 400, "n", None),
    (body(stop=[""]), 400, "stop", None),
    (body(seed=1.5), 400, "seed", None),
    (body(stream="yes"), 400, "stream", None),
    (body(stream_options={"include_usage": True}), 400, "stream_options", None),
    (body(best_of=2), 400, "best_of", "unknown_parameter"),
    (body(logprobs=True), 400, "logprobs", "unsupported_value"),
    (body(presence_penalty=0.5), 400, "presence_penalty", "unsupported_value"),
    (body(tools=[]), 400, "tools", None),
    (body(tools=bad_tool(name="bad name!")), 400, "tools[0].function.name", None),
    (body(tools=bad_tool(parameters={"type": "string"})), 400, "tools[0].function.parameters",
     None),
    (body(tools=bad_tool(parameters={"type": "object", "required": ["item"]})), 400,
     "tools[0].function.parameters.required", None),
    (body(tools=[GET_TOOL, GET_TOOL]), 400, "tools", None),
    (body(tools=[GET_TOOL], tool_choice="required"), 400, "tool_choice", "unsupported_value"),
    (body(messages=[assistant_call("{}")], tools=[GET_TOOL]), 400, "messages", None),
])
def test_a_bad_request_gets_openais_error_body(server, payload, status, param, code):
  response = requests.post(f"{server.url}/v1/chat/completions", json=payload, timeout=30)
  assert response.status_code == status, response.text
  error = response.json()["error"]
  assert set(error) == {"message", "type", "param", "code"} and error["message"]
  assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)


def test_malformed_http_gets_openais_error_body(server, client):
  url = f"{server.url}/v1/chat/completions"
  post = lambda data, **kwargs: requests.post(url, data=data, timeout=30, **kwargs)
  lone_surrogate = b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % (
      MODEL.encode())
  for body in (b"{", b"[1, 2]", b"", b'{"model": NaN}', b"\xff\xfe", b"[" * 100_000,
               lone_surrogate):
    response = post(body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"], body[:10]
  connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
  connection.putrequest("POST", "/v1/chat/completions")
  connection.putheader("Content-Length", str(server.max_body_bytes + 1))
  connection.endheaders(b"{}")  # Refused before the body is read.
  too_large = connection.getresponse()
  assert too_large.status == 413 and json.loads(too_large.read())["error"]["code"] == "too_large"
  connection.close()
  assert requests.get(url, timeout=30).status_code == 405
  assert requests.post(f"{server.url}/v1/completions", json={}, timeout=30).status_code == 404
  assert requests.get(f"{server.url}/health", timeout=30).json()["model"] == MODEL
  with pytest.raises(openai.BadRequestError) as raised:
    client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)
  assert raised.value.body["param"] == "temperature"
  with pytest.raises(openai.NotFoundError):
    client.chat.completions.create(model="gpt-4o", messages=MESSAGES)


def test_api_key_full_queue_and_shutdown(policy):
  model, tokenizer = policy
  server = PolicyServer(model, tokenizer, model_name=MODEL, max_batch=2, max_context=64,
                        max_queue=1, batch_window_s=60.0, api_key="sesame").start()
  try:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sesame", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
      openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert client.models.list().data[0].id == MODEL
    # The idle server waits (batch window) with one request queued: the next one is refused.
    errors = []
    waiting = threading.Thread(target=lambda: errors.append(
        pytest.raises(openai.InternalServerError, client.chat.completions.create, model=MODEL,
                      messages=MESSAGES).value))
    waiting.start()
    assert wait_until(lambda: server.load()["queued"] == 1)
    with pytest.raises(openai.RateLimitError):
      client.chat.completions.create(model=MODEL, messages=MESSAGES)
  finally:
    server.shutdown()
  waiting.join()
  assert errors[0].status_code == 503  # The queued request, at shutdown.


# An outside harness's TextCraft evaluation: its first test tasks, replies of up to 16 tokens, a
# cap of 3 turns, on a server whose rows hold TextCraft's first prompt (some 1,000 tokens).
HARNESS_TASKS, HARNESS_TOKENS, HARNESS_TURNS, HARNESS_CONTEXT = 3, 16, 3, 1536


def harness_episode(client, env_url, instruction, task_id):
  """One TextCraft episode played as a harness outside this project plays it: the env server's
  AgentGym routes over plain HTTP (/create, /reset, the first observation from /observation as
  AgentGym's clients read it, /step with the whole reply, /close) and one greedy chat completion
  a turn. The conversation is the one the project's rollout holds: no system turn, the
  instruction and the first observation in the first user turn (a blank line between), each
  later observation a user turn of its own. Returns the episode's summary record (as
  evaluation.task_record writes it), its messages, and the (prompt, completion) tokens of each
  turn."""
  post = lambda route, body: requests.post(f"{env_url}/{route}", json=body, timeout=30).json()
  env_id = post("create", {})["id"]
  post("reset", {"id": env_id, "data_idx": task_id})
  observation = requests.get(f"{env_url}/observation", params={"id": env_id}, timeout=30).json()
  messages, reward, usage = [user(f"{instruction}\n\n{observation}")], 0.0, []
  while True:
    completion = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                max_tokens=HARNESS_TOKENS)
    reply = completion.choices[0].message.content
    messages.append({"role": "assistant", "content": reply})
    usage.append((completion.usage.prompt_tokens, completion.usage.completion_tokens))
    stepped = post("step", {"id": env_id, "action": reply})
    reward += stepped["reward"]
    if stepped["done"] or len(usage) == HARNESS_TURNS:
      break
    messages.append(user(stepped["observation"]))
  assert post("close", {"id": env_id}) is True
  category = requests.get(f"{env_url}/task_info", params={"data_idx": task_id},
                          timeout=30).json()["category"]
  record = {
      "task_id": task_id, "category": category, "success": [float(stepped["success"])],
      "reward": [reward], "turns": [len(usage)]
  }
  return record, messages, usage


def test_an_outside_harness_scores_textcraft_as_the_evaluation_does(policy):
  """Issue #40: a TextCraft evaluation written as an outside harness writes it (the openai
  client on the policy server, plain HTTP on the AgentGym env server) plays and scores the
  episodes that the project's greedy evaluation (evaluation.evaluate, as launch/evaluate.py
  plays it) plays on the same tasks with the same settings, reply for reply."""
  model, tokenizer = policy
  with AgentGymServer("textcraft") as env_server, PolicyServer(model, tokenizer, model_name=MODEL,
                                                               max_batch=ROWS,
                                                               max_context=HARNESS_CONTEXT,
                                                               chunk_tokens=CHUNK) as policy_server:
    client = openai.OpenAI(base_url=f"{policy_server.url}/v1", api_key="unused", max_retries=0)
    get = lambda route, **query: requests.get(f"{env_server.url}/{route}", params=query, timeout=30
                                             ).json()
    task_ids = get("task_ids", split="test")["task_ids"][:HARNESS_TASKS]
    instruction = get("instruction")["instruction"]
    played = [harness_episode(client, env_server.url, instruction, t) for t in task_ids]

  # The project's evaluation, on a sampler of the policy server's shape.
  sampler = Sampler(model, cache_slots=HARNESS_CONTEXT, max_batch=ROWS)
  with EnvPool("textcraft", HARNESS_TASKS) as pool:
    player = rollout.Player(sampler, sampler.params, pool, tokenizer.chat,
                            rollout.TurnSampling(HARNESS_TOKENS, temperature=0.0),
                            max_context=HARNESS_CONTEXT)
    summary, trajectories = evaluation.evaluate(player, task_ids, samples_per_task=1,
                                                horizon=HARNESS_TURNS, key=jax.random.key(0),
                                                rows_per_batch=HARNESS_TASKS)
  assert [record for record, _, _ in played] == summary["tasks"]
  for (_, messages, usage), trajectory in zip(played, trajectories):
    # The same conversation, reply for reply (the actions), and the same tokens each turn: the
    # prompt the evaluation's sampler held before each reply, and the reply's own.
    assert messages == trajectory.messages
    assert usage == [
        (end, length)
        for (_, end), length in zip(trajectory.observation_spans, trajectory.reply_lengths())
    ]
