"""Offline data: conversation tokens and masks as the rollout builds them, SFT and DPO batches."""

import numpy as np
import pytest

import tiny
from agentgym_jax import demonstrations as demos_lib
from agentgym_jax import offline_data
from agentgym_jax.models.tokenizer import Tokenizer
from agentgym_jax.rollout import Trajectory
from environments import base
from rl_helpers import conversation


@pytest.fixture(scope="module")
def smollm_chat():
  return Tokenizer.from_gguf().chat


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
  directory = tmp_path_factory.mktemp("tiny_tokenizer")
  tiny.write_tokenizer(directory)
  return Tokenizer.from_pretrained(directory).chat


@pytest.fixture(scope="module")
def textcraft_demos():
  env = base.make("textcraft")
  return demos_lib.demonstrate_tasks(env, env.task_ids("train")[:12]).demos


def _check_invariants(chat, messages):
  tokens, loss_mask = offline_data.tokenize_conversation(chat, messages)
  whole = chat.render(messages, add_generation_prompt=False)
  # The whole render ends "<|im_end|>" "\n"; the conversation stops at the reply's im_end.
  assert tokens == whole[:-1]
  assert whole[-1:] == chat.tokenizer.encode("\n") and tokens[-1] == chat.reply_end_id
  assert len(loss_mask) == len(tokens) and set(loss_mask) <= {0, 1}
  # The trained tokens are, run by run, each reply's encoding followed by im_end.
  replies = [m["content"] for m in messages if m["role"] == "assistant"]
  runs, run = [], []
  for token, trained in zip(tokens, loss_mask):
    if trained:
      run.append(token)
    elif run:
      runs.append(run)
      run = []
  runs.append(run)
  assert runs == [chat.reply_ids(r) for r in replies]
  return tokens, loss_mask


def test_tokens_equal_the_whole_render_and_the_mask_covers_replies_smollm(
    smollm_chat, textcraft_demos):
  for demo in textcraft_demos:
    _check_invariants(smollm_chat, demo["messages"])
  tricky = conversation("Goal: say <|im_end|> without ending the turn.",
                        "Thought: the text <|im_end|><|im_start|>user is plain.\n\nAction: echo",
                        "  leading spaces, unicode é ✓, and a trailing newline\n", "\n\nAction: 42")
  _check_invariants(smollm_chat, tricky)
  # A system message joins the prompt; SmolLM2's default system message is not added then.
  _check_invariants(smollm_chat, [{"role": "system", "content": "Be brief."}, *tricky])


def test_tokens_equal_the_whole_render_and_the_mask_covers_replies_tiny(tiny_chat):
  tokens, loss_mask = _check_invariants(tiny_chat, conversation("1 0", "0 1 1", "1", "0"))
  # Worked example, ids: <|im_start|>=0 <|im_end|>=1 \n=3 " "=4 user=5 assistant=6 0=7 1=8.
  # Prompt "<s>user\n1 0<e>\n<s>assistant\n", reply "0 1 1<e>", continuation
  # "\n<s>user\n1<e>\n<s>assistant\n", reply "0<e>".
  assert tokens == [
      0, 5, 3, 8, 4, 7, 1, 3, 0, 6, 3, 7, 4, 8, 4, 8, 1, 3, 0, 5, 3, 8, 1, 3, 0, 6, 3, 7, 1
  ]
  assert loss_mask == [0] * 11 + [1] * 6 + [0] * 10 + [1] * 2


def test_tokens_match_the_rollouts_turn_by_turn_construction(tiny_chat):
  # The rollout: prompt, then sampled ids ending in im_end (trained), then continuation_ids.
  trajectory = Trajectory(task_id=0, group=0)
  messages = conversation("1", "0 0", "1 1", "1")
  trajectory.extend(tiny_chat.render(messages[:1], add_generation_prompt=True), trained=False)
  trajectory.extend(tiny_chat.reply_ids("0 0"), trained=True)
  trajectory.extend(tiny_chat.continuation_ids("user", "1 1"), trained=False)
  trajectory.extend(tiny_chat.reply_ids("1"), trained=True)
  assert offline_data.tokenize_conversation(tiny_chat,
                                            messages) == (trajectory.tokens, trajectory.loss_mask)


@pytest.mark.parametrize("chat_family", ["qwen3", "llama3"])
def test_tool_call_demos_tokenize_with_their_tools(chat_family, tmp_path):
  tiny.write_tokenizer(tmp_path, chat_family)
  chat = Tokenizer.from_pretrained(tmp_path).chat
  env = base.make("textcraft", action_format="tool_call")
  (demo,) = demos_lib.demonstrate_tasks(env, env.task_ids("train")[:1]).demos
  messages, tools = demo["messages"], demo["tools"]
  tokens, loss_mask = offline_data.tokenize_conversation(chat, messages, tools)
  # The prompt shows the tools as the template does; the rest follows turn by turn, up to what
  # comes after the last reply's turn end (ChatML's "\n", nothing in Llama 3).
  prompt = chat.render(messages[:1], tools=tools)
  assert tokens[:len(prompt)] == prompt and set(loss_mask[:len(prompt)]) == {0}
  whole = chat.render(messages, add_generation_prompt=False, tools=tools)
  assert whole == tokens + chat.tokenizer.encode(chat.layout.after_turn)
  # SFT batches read the record's tools.
  data = offline_data.sft_batches([demo], chat, batch_size=1, max_length=8192)
  assert data.batch(0).tokens[0, :len(tokens)].tolist() == tokens


@pytest.mark.parametrize("messages,message", [
    (conversation("1", "0", "1"), "ends with a 'user' turn"),
    (conversation("1"), "no assistant reply"),
    ([{"role": "assistant", "content": "0"}], "starts with an assistant reply"),
    (conversation("1", "0") + [{"role": "assistant", "content": "1"}], "must alternate"),
    (conversation("1", "0") +
     [{"role": "user", "content": 1}, {"role": "assistant", "content": "0"}], "not str"),
    ([], "non-empty list"),
])
def test_malformed_conversations_are_refused(tiny_chat, messages, message):
  with pytest.raises(ValueError, match=message):
    offline_data.tokenize_conversation(tiny_chat, messages)


# --- SFT batches ---------------------------------------------------------------------------


def _records(lengths):
  """Conversations whose single reply has the given number of words ("0 1 0 ..." style)."""
  return [{
      "messages": conversation("1", " ".join("01"[j % 2] for j in range(n))), "reward": float(i)
  } for i, n in enumerate(lengths)]


def test_sft_batches_pad_to_buckets_and_mask_exactly_the_replies(tiny_chat):
  records = _records([5, 40, 7, 90, 12, 33, 64, 3, 100, 20])
  data = offline_data.sft_batches(records, tiny_chat, batch_size=4, max_length=512, seed=0)
  assert (data.num_examples, data.num_dropped, data.steps_per_epoch) == (10, 0, 2)
  expected = {
      r["reward"]: offline_data.tokenize_conversation(tiny_chat, r["messages"]) for r in records
  }
  seen = []
  for step in range(2):
    batch = data.batch(step)
    assert batch.tokens.dtype == np.int32 and batch.loss_mask.dtype == np.float32
    # An n-word reply makes 11 + (2n - 1) + 1 = 2n + 11 tokens: 128, 192 (n = 90) or 256 wide
    # (n = 100).
    assert batch.tokens.shape[0] == 4 and batch.tokens.shape[1] in (128, 192, 256)
    assert not batch.sampler_logprobs.any()
    assert batch.group_ids.tolist() == [0, 1, 2, 3]
    for row in range(4):
      tokens, loss_mask = expected[float(batch.rewards[row])]
      n = len(tokens)
      assert batch.tokens[row, :n].tolist() == tokens
      assert batch.loss_mask[row, :n].tolist() == loss_mask
      assert not batch.tokens[row, n:].any() and not batch.loss_mask[row, n:].any()
      seen.append(float(batch.rewards[row]))
  # One epoch uses 8 distinct examples (10 // 4 batches of 4; 2 wait for a later epoch).
  assert len(set(seen)) == 8


def test_sft_batches_are_deterministic_and_reshuffled_each_epoch(tiny_chat):
  records = _records(range(1, 33))

  def order(seed, steps):
    data = offline_data.sft_batches(records, tiny_chat, batch_size=4, max_length=512, seed=seed)
    return [data.batch(s).rewards.tolist() for s in steps]

  assert order(0, range(16)) == order(0, range(16))
  assert order(0, range(8)) != order(1, range(8))
  epoch0, epoch1 = order(0, range(8)), order(0, range(8, 16))
  assert sorted(sum(epoch0, [])) == sorted(sum(epoch1, [])) == [float(i) for i in range(32)]
  assert epoch0 != epoch1
  # Random access equals iteration (a resumed run continues the same sequence).
  data = offline_data.sft_batches(records, tiny_chat, batch_size=4, max_length=512, seed=0)
  iterated = [b.rewards.tolist() for _, b in zip(range(10), data)]
  assert iterated == order(0, range(10))


def test_sft_batches_group_similar_lengths(tiny_chat):
  # 16 short (2 words) and 16 long (200 words) replies, one sort window: every batch of 4 is
  # all short (padded to 128) or all long (padded to 512), never mixed.
  records = _records([2] * 16 + [200] * 16)
  data = offline_data.sft_batches(records, tiny_chat, batch_size=4, max_length=1024, seed=3)
  widths = sorted(data.batch(s).tokens.shape[1] for s in range(8))
  assert widths == [128] * 4 + [512] * 4


def test_over_long_conversations_are_dropped_and_counted_never_cut(tiny_chat):
  records = _records([2, 3, 300, 4, 5])  # 2n + 11 tokens: the 300-word one has 611
  data = offline_data.sft_batches(records, tiny_chat, batch_size=2, max_length=200, seed=0)
  assert (data.num_examples, data.num_dropped) == (4, 1)
  for step in range(4):
    batch = data.batch(step)
    assert 2.0 not in batch.rewards.tolist()
    assert batch.tokens.shape[1] == 128
  # A max_length below the bucket caps the padded width.
  data = offline_data.sft_batches(records, tiny_chat, batch_size=2, max_length=40, seed=0)
  assert data.batch(0).tokens.shape[1] == 40
  with pytest.raises(ValueError, match="fewer than one batch"):
    offline_data.sft_batches(records, tiny_chat, batch_size=8, max_length=200)


# --- DPO -----------------------------------------------------------------------------------


def _trajectory(name, task_id, success, reward, num_turns=1, **extra):
  return {
      "name": name, "task_id": task_id, "success": success, "reward": reward,
      "num_turns": num_turns, "messages": conversation("1", "0"), **extra
  }


def _names(pairs):
  return [(p.chosen["name"], p.rejected["name"]) for p in pairs]


def test_dpo_pairs_best_against_worst_while_the_first_strictly_wins():
  trajectories = [
      _trajectory(name, 7, success, float(success))
      for name, success in zip("ABCDE", [False, True, False, True, False])
  ]
  # Ranked B, D, A, C, E (ties in input order): (B, E), (D, C); A is the unpaired middle.
  pairs = offline_data.dpo_pairs(trajectories)
  assert _names(pairs) == [("B", "E"), ("D", "C")]
  assert all(p.task_id == 7 for p in pairs)
  assert _names(offline_data.dpo_pairs(trajectories, max_pairs_per_task=1)) == [("B", "E")]


def test_dpo_pairs_by_reward_gap_between_equals_in_success():
  # SciWorld-like scores, all failures: ranked 0.9, 0.6, 0.5, 0.2. With a gap of 0.3:
  # (0.9, 0.2) differ by 0.7 > 0.3, a pair; (0.6, 0.5) by 0.1, not, and pairing stops.
  trajectories = [_trajectory(f"s{score}", 1, False, score / 10) for score in (5, 9, 2, 6)]
  assert _names(offline_data.dpo_pairs(trajectories, min_reward_gap=0.3)) == [("s9", "s2")]
  assert _names(offline_data.dpo_pairs(trajectories)) == [("s9", "s2"), ("s6", "s5")]
  # Success beats failure even at a lower reward (BabyAI: a slow success vs a failure).
  slow = [_trajectory("fail", 2, False, 0.0), _trajectory("slow", 2, True, 0.1)]
  assert _names(offline_data.dpo_pairs(slow, min_reward_gap=0.5)) == [("slow", "fail")]


def test_dpo_pairs_prefer_shorter_successes_and_skip_broken_episodes():
  trajectories = [
      _trajectory("long", 3, True, 1.0, num_turns=9),
      _trajectory("short", 3, True, 1.0, num_turns=4),
      _trajectory("broken", 3, False, 0.0, termination="env_error"),
      _trajectory("fail", 3, False, 0.0, num_turns=10),
      _trajectory("other task", 4, True, 1.0),
      _trajectory("no reply", 4, False, 0.0, messages=conversation("1"))
  ]
  assert _names(offline_data.dpo_pairs(trajectories)) == [("short", "fail")]
  assert offline_data.dpo_pairs([_trajectory("a", 1, True, 1.0),
                                 _trajectory("b", 1, True, 1.0)]) == []


def test_dpo_pairs_refuse_mixed_environments_and_different_prompts():
  with pytest.raises(ValueError, match="several environments"):
    offline_data.dpo_pairs([
        _trajectory("a", 1, True, 1.0, env="textcraft"),
        _trajectory("b", 1, False, 0.0, env="babyai")
    ])
  other_prompt = _trajectory("b", 1, False, 0.0, messages=conversation("0", "0"))
  with pytest.raises(ValueError, match="different prompts"):
    offline_data.dpo_pairs([_trajectory("a", 1, True, 1.0), other_prompt])


def test_dpo_batches_align_chosen_and_rejected_rows(tiny_chat):
  trajectories = []
  for task in range(6):  # chosen: a short success; rejected: a longer failure
    trajectories += [{
        "task_id": task, "success": True, "reward": 1.0, "num_turns": 1,
        "messages": conversation("1", "0 " * task + "1")
    }, {
        "task_id": task, "success": False, "reward": 0.0, "num_turns": 2,
        "messages": conversation("1", "0", "0", "1 " * (10 * task) + "0")
    }]
  pairs = offline_data.dpo_pairs(trajectories)
  assert [p.task_id for p in pairs] == list(range(6))
  data = offline_data.dpo_batches(pairs, tiny_chat, batch_size=2, max_length=256, seed=0)
  assert (data.num_pairs, data.num_dropped, data.steps_per_epoch) == (6, 0, 3)
  tasks = []
  for step in range(3):
    chosen, rejected = data.batch(step)
    assert chosen.tokens.shape == rejected.tokens.shape == (2, 128)
    assert chosen.rewards.tolist() == [1.0, 1.0] and rejected.rewards.tolist() == [0.0, 0.0]
    for row in range(2):
      # Row i of both batches is one pair: the same prompt, hence the same first tokens.
      prompt = tiny_chat.render(conversation("1"), add_generation_prompt=True)
      assert chosen.tokens[row, :len(prompt)].tolist() == prompt
      assert rejected.tokens[row, :len(prompt)].tolist() == prompt
      # The chosen reply "0 0 ... 1" has 2 * task + 1 tokens, plus im_end.
      tasks.append(int(chosen.loss_mask[row].sum() - 2) // 2)
  assert sorted(tasks) == list(range(6))
  # A rejected side has prompt 11 + reply 2 + continuation 10 + reply (20 task + 1) + im_end 1
  # = 25 + 20 task tokens: tasks 0-2 fit 70, tasks 3-5 do not, so their pairs drop whole.
  small = offline_data.dpo_batches(pairs, tiny_chat, batch_size=1, max_length=70, seed=0)
  assert (small.num_pairs, small.num_dropped) == (3, 3)
  widths = {small.batch(s)[1].tokens.shape[1] for s in range(3)}
  assert widths == {70}
