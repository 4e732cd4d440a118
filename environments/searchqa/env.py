"""SearchQAEnv: answer a question by searching a corpus (AgentGym's SearchQA, Deep Search).

Episode. The first observation is "Question: <question>". Each reply holds one action in the
Search-R1 format (reply.py):
  <search> query </search>  -> "<information>Doc 1(Title: t) text\\nDoc 2(...) ...</information>",
                               the top `top_k` documents (3, as AgentGym; none when BM25
                               finds no shared word), reward 0
  <answer> text </answer>   -> ends the episode; reward 1 and success when the answer matches a
                               gold answer by normalised exact match (reply.exact_match), else 0.
                               "Congratulations! You have answered the question correctly." or
                               "Sorry, your answer is incorrect."
  anything else             -> reply.INVALID_OBSERVATION, reward 0, the episode goes on.
With `judge_answers=True` the answer's info also asks the run's judge (agentgym_jax/judge.py,
reward.judge mode "reference") whether it means any gold answer: the judge's verdict then
replaces exact match as the reward and success (the observation still reports exact match).
In the tool_call format (environments/base.py) the actions are the tools search(query) and
answer(answer) (TOOLS), and a call that cannot be carried out gets "Invalid tool call: <why>.
...", reward 0, the episode goes on. The number of searches is not capped here: the trainer's
horizon caps the turns of an episode (the paper's ScalingInter schedule raises it over training,
5 -> 8 -> 10 for SearchQA). Unlike
AgentGym's server, where a wrong answer says "Please try again." and the episode goes on until
the horizon, any answer ends the episode: the outcome is the first answer.

Data. With no `data_dir`, the questions and the corpus are generated from Minecraft's game data
(minecraft.py): 256 test and 11,142 train questions of 2-3 hops over 1,040 pages, in a few
seconds, no download. With `data_dir`, the paper's data in FlashRAG format (qa_data.py):
  <data_dir>/<source>/{test,dev,train}.{jsonl,parquet}  questions per source (nq, triviaqa,
                                                         popqa, hotpotqa, 2wikimultihopqa,
                                                         musique, bamboogle)
  <data_dir>/corpus.jsonl (or `corpus_path`)            the corpus, e.g. wiki-18.jsonl
with AgentGym's task ids and the paper's categories (NQ, ..., Bamboogle).

Retrieval. `retriever="bm25"` (default): BM25 over the corpus; for a file corpus the index can
be kept in `bm25_index_dir` and reused. `retriever="dense"`: inner product search over the
corpus embeddings in `embeddings_path` (.npy or a FAISS index) with the query encoder `embed_fn`
(a callable or "module:attribute", list[str] -> [Q, D] array). Any object with
`search(query, k)` is accepted too. On the generated corpus a query that names a page brings
that page first (retrievers.TitleFirst). Indexes and question sets are built once per process
and shared by all adapters.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, Callable, Sequence

from environments import base
from environments.base import EnvError, StepResult, check_split
from environments.searchqa import minecraft, qa_data
from environments.searchqa.qa_data import Question
from environments.searchqa.reply import INVALID_OBSERVATION, exact_match, parse_reply
from environments.searchqa.retrievers import (BM25Retriever, DenseRetriever, Doc, JsonlCorpus,
                                              Retriever, TitleFirst, load_embeddings,
                                              resolve_callable)

RETRIEVERS = ("bm25", "dense")
CORRECT_OBSERVATION = "Congratulations! You have answered the question correctly."
WRONG_OBSERVATION = "Sorry, your answer is incorrect."

_INSTRUCTION = """\
Answer the question at the end of this message. You cannot know everything, but you can use a \
search engine.

In every reply, first think inside <think> and </think>, then take exactly one action:
- To search, write a query between <search> and </search>. The top results come back between \
<information> and </information>. You may search as many times as you need, one query per \
reply.
- To answer, write the answer between <answer> and </answer>, as a short phrase without \
explanation, for example <answer> Beijing </answer>. Answering ends the episode. The answer \
counts only if it matches the correct answer word for word (case, punctuation and "a", "an", \
"the" aside), so give just the name or number asked for.
Base your answer on what the searches return, not on guesses."""
_TOOL_CALL_INSTRUCTION = f"""\
Answer the question at the end of this message. You cannot know everything, but you can use a \
search engine.

Each turn, take exactly one action with a tool:
- search: look something up. The top results come back between <information> and \
</information>. You may search as many times as you need, one query per turn.
- answer: give the answer as a short phrase without explanation, for example "Beijing". \
Answering ends the episode. The answer counts only if it matches the correct answer word for \
word (case, punctuation and "a", "an", "the" aside), so give just the name or number asked for.
Base your answer on what the searches return, not on guesses.

{base.TOOL_CALL_INSTRUCTION}"""

TOOLS = (base.Tool("search", "Search the corpus; returns the top documents.",
                   "<search> {query} </search>",
                   (base.Parameter("query", "string", "What to look up."),)),
         base.Tool("answer", "Give the final answer; it ends the episode.",
                   "<answer> {answer} </answer>",
                   (base.Parameter("answer", "string", "A short phrase, e.g. \"Beijing\"."),)))


def react_reply(thought: str, action: str) -> str:
  """A Search-R1 reply: the thought in <think>, then the action's tags."""
  return f"<think>{thought}</think>\n{action}"


def format_information(docs: Sequence[Doc]) -> str:
  """The observation of a search: AgentGym's "Doc i(Title: t) text" lines in <information>."""
  lines = "".join(f"Doc {i}(Title: {doc.title}) {doc.text}\n" for i, doc in enumerate(docs, 1))
  return f"<information>{lines.strip()}</information>"


class SearchQAEnv:
  """Search a corpus and answer (module docstring)."""

  name = "searchqa"

  def __init__(self, data_dir: str | None = None, retriever: str | Retriever = "bm25",
               top_k: int = 3, corpus_path: str | None = None, bm25_index_dir: str | None = None,
               embeddings_path: str | None = None, embed_fn: str | Callable | None = None,
               test_sources: Sequence[str] | None = None,
               train_sources: Sequence[str] | None = None, action_format: str = "react",
               judge_answers: bool = False):
    if not isinstance(top_k, int) or top_k < 1:
      raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    self.top_k, self.judge_answers = top_k, bool(judge_answers)
    self.action_format = base.ActionFormat(action_format, TOOLS, react_reply)
    if data_dir is None:
      given = {
          "corpus_path": corpus_path, "bm25_index_dir": bm25_index_dir,
          "test_sources": test_sources, "train_sources": train_sources
      }
      misplaced = sorted(key for key, value in given.items() if value is not None)
      if misplaced:
        raise ValueError(f"{', '.join(misplaced)} need data_dir (the FlashRAG data); without "
                         "it the generated Minecraft set is used")
      splits = _generated_splits()
      corpus_key = None
    else:
      if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"data_dir {data_dir!r} is not a directory")
      splits = _flashrag_splits(
          os.path.abspath(data_dir),
          tuple(qa_data.TEST_SOURCES if test_sources is None else test_sources),
          tuple(qa_data.TRAIN_SOURCES if train_sources is None else train_sources))
      corpus_key = os.path.abspath(corpus_path or os.path.join(data_dir, "corpus.jsonl"))
      if not os.path.exists(corpus_key):
        raise FileNotFoundError(f"no corpus at {corpus_key}; put the corpus JSONL (e.g. "
                                "wiki-18.jsonl) there or pass corpus_path")
    self._retriever = _make_retriever(retriever, corpus_key, bm25_index_dir, embeddings_path,
                                      embed_fn)
    self._questions = splits["test"] + splits["train"]
    num_test = len(splits["test"])
    self._splits = {"test": range(num_test), "train": range(num_test, len(self._questions))}
    self._question: Question | None = None
    self._searches = 0

  @property
  def instruction(self) -> str:
    return _TOOL_CALL_INSTRUCTION if self.action_format.kind == "tool_call" else _INSTRUCTION

  def task_ids(self, split: str) -> Sequence[int]:
    return self._splits[check_split(split)]

  def _lookup(self, task_id: int) -> Question:
    if not isinstance(task_id, int) or not 0 <= task_id < len(self._questions):
      raise ValueError(f"task id {task_id!r} out of range [0, {len(self._questions)})")
    return self._questions[task_id]

  def task_info(self, task_id: int) -> dict[str, Any]:
    question = self._lookup(task_id)
    info = {
        "category": question.category, "id": question.id, "question": question.question,
        "golden_answers": list(question.golden_answers),
        "split": "test" if task_id in self._splits["test"] else "train"
    }
    metadata = dict(question.metadata)
    if "hops" in metadata:  # generated questions: the pages that hold the facts, in order
      info["hops"] = [{"title": hop.title, "evidence": hop.evidence, "names": list(hop.names)}
                      for hop in metadata.pop("hops")]
    if metadata:
      info["metadata"] = metadata
    return info

  def reset(self, task_id: int) -> str:
    self._question = self._lookup(task_id)
    self._searches = 0
    return f"Question: {self._question.question}"

  def step(self, action_text: str) -> StepResult:
    if self._question is None:
      raise RuntimeError("step() called outside an episode; call reset() first")
    info: dict[str, Any] = {"success": False, "searches": self._searches}
    try:
      action = parse_reply(self.action_format.react_reply(action_text))
    except base.ToolCallError as error:
      return StepResult(str(error), 0.0, False, {**info, "action": "invalid"})
    if action is None:
      return StepResult(INVALID_OBSERVATION, 0.0, False, {**info, "action": "invalid"})
    if action.kind == "search":
      try:
        docs = self._retriever.search(action.text, self.top_k)
      except Exception as error:  # a user's retriever or encoder: an env fault, not the agent's
        raise EnvError(f"retriever failed on query {action.text!r}: {error!r}") from error
      self._searches += 1
      return StepResult(format_information(docs), 0.0, False,
                        {**info, "action": "search", "searches": self._searches})
    question, self._question = self._question, None
    correct = exact_match(action.text, question.golden_answers)
    info.update(action="answer", success=correct, answer=action.text)
    if self.judge_answers:
      info["judge"] = {
          "question": question.question, "references": list(question.golden_answers),
          "answer": action.text, "match": "any", "scale": 1.0
      }
    return StepResult(CORRECT_OBSERVATION if correct else WRONG_OBSERVATION, float(correct), True,
                      info)

  def close(self) -> None:
    self._question = None


_BUILD_LOCK = threading.RLock()


def _shared(build: Callable) -> Callable:
  """functools.cache that builds once even when many adapter threads ask at the same time
  (an EnvPool or the HTTP server creates its adapters concurrently)."""
  cached = functools.cache(build)

  @functools.wraps(build)
  def get(*args):
    with _BUILD_LOCK:
      return cached(*args)

  return get


@_shared
def _generated_splits() -> dict[str, tuple[Question, ...]]:
  data = minecraft.dataset()
  return {"test": data.test, "train": data.train}


@_shared
def _flashrag_splits(data_dir: str, test_sources: tuple[str, ...],
                     train_sources: tuple[str, ...]) -> dict[str, tuple[Question, ...]]:
  splits = qa_data.load_flashrag(data_dir, test_sources, train_sources)
  return {split: tuple(questions) for split, questions in splits.items()}


@_shared
def _corpus(corpus_key: str | None) -> Sequence[Doc]:
  return minecraft.dataset().pages if corpus_key is None else JsonlCorpus(corpus_key)


@_shared
def _bm25(corpus_key: str | None, index_dir: str | None) -> Retriever:
  docs = _corpus(corpus_key)
  bm25 = BM25Retriever(docs, index_dir)
  return TitleFirst(bm25, docs) if corpus_key is None else bm25


@_shared
def _dense(corpus_key: str | None, embeddings_path: str, embed_fn: Callable) -> Retriever:
  docs = _corpus(corpus_key)
  dense = DenseRetriever(docs, load_embeddings(embeddings_path), embed_fn)
  return TitleFirst(dense, docs) if corpus_key is None else dense


def _make_retriever(retriever: str | Retriever, corpus_key: str | None, bm25_index_dir: str | None,
                    embeddings_path: str | None, embed_fn: str | Callable | None) -> Retriever:
  if not isinstance(retriever, str):
    if not callable(getattr(retriever, "search", None)):
      raise TypeError(f"retriever must be one of {RETRIEVERS} or have a search(query, k) "
                      f"method; got {retriever!r}")
    return retriever
  if retriever == "bm25":
    return _bm25(corpus_key, bm25_index_dir and os.path.abspath(bm25_index_dir))
  if retriever == "dense":
    if embeddings_path is None or embed_fn is None:
      raise ValueError("retriever='dense' needs embeddings_path (the corpus embeddings, .npy or "
                       "a FAISS index) and embed_fn (the query encoder)")
    return _dense(corpus_key, os.path.abspath(embeddings_path), resolve_callable(embed_fn))
  raise ValueError(f"unknown retriever {retriever!r}; expected one of {RETRIEVERS} or an object "
                   "with search(query, k)")
