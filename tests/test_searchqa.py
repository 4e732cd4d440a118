"""SearchQA: scoring, reply parsing, retrievers, the generated Minecraft set, FlashRAG data."""

import json
import re

from hypothesis import given, settings, strategies as st
import numpy as np
import pytest

from environments import base
from environments.searchqa import (BM25Retriever, DenseRetriever, Doc, SearchQAEnv, TitleFirst,
                                   exact_match, load_flashrag, normalize_answer, parse_reply)
from environments.searchqa import minecraft
from environments.searchqa.env import CORRECT_OBSERVATION, WRONG_OBSERVATION
from environments.searchqa.reply import INVALID_OBSERVATION, Action
from environments.searchqa.retrievers import s_stem, top_k_indices
from env_helpers import env_fixture, run_python

env = env_fixture(SearchQAEnv)

# Answer normalisation and exact match.


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The  U.S.A.!", "usa"),  # articles, punctuation and extra spaces go
        ("An apple a day", "apple day"),  # "An" and "a" are whole-word articles
        ("Theatre anthem", "theatre anthem"),  # ...but not prefixes of words
        ("Jack o'Lantern", "jack olantern"),  # the apostrophe is punctuation
        ("  Iron_Ingot\t", "ironingot"),  # so is "_"
        ("Café", "café"),  # non-ASCII letters stay
    ])
def test_normalize_answer_worked_examples(text, expected):
  assert normalize_answer(text) == expected


def test_exact_match_against_any_gold_answer():
  assert exact_match("  the Eiffel Tower. ", ["Eiffel tower"])
  assert exact_match("5", ["five", "5"])
  assert exact_match("Five", ["5", "five"])
  assert not exact_match("Eiffel", ["Eiffel Tower"])  # exact, not substring, match
  assert not exact_match("", ["Paris"])
  assert exact_match("the", ["A"])  # both normalise to "", as in the reference scorer


# Reply parsing.


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("<think>hm</think>\n<search> capital of France </search>",
         Action("search", "capital of France")),
        ("<answer>Paris</answer>", Action("answer", "Paris")),
        ("<search>a\nb</search>", Action("search", "a\nb")),
        ("<search>first</search> <search>second</search>", Action("search", "first")),
        ("<answer>first</answer> then <answer> last </answer>", Action("answer", "last")),
        ("<answer> </answer>", Action("answer", "")),  # empty answer: valid and wrong
        ("<search>q</search><search>", Action("search", "q")),  # a dangling tag is text
        ("Paris", None),  # no tag
        ("<search>capital</search><answer>Paris</answer>", None),  # both tags
        ("<answer>Paris</answer><search>capital</search>", None),
        ("<search>   </search>", None),  # empty query
        ("<search>unclosed", None),
        ("<search>mixed</answer>", None),
        ("<SEARCH>upper</SEARCH>", None),  # tags are lowercase
    ])
def test_parse_reply_cases(reply, expected):
  assert parse_reply(reply) == expected


def _blocks_by_scanning(reply):
  """The (kind, stripped content) blocks of a reply, found with str.find instead of a regex."""
  blocks, position = [], 0
  while True:
    openings = sorted((reply.find(f"<{kind}>", position), kind) for kind in ("search", "answer"))
    for start, kind in openings:
      if start < 0:
        continue
      content_start = start + len(kind) + 2
      end = reply.find(f"</{kind}>", content_start)
      if end >= 0:
        blocks.append((kind, reply[content_start:end].strip()))
        position = end + len(kind) + 3
        break
    else:
      return blocks


_FRAGMENTS = [
    "<search>", "</search>", "<answer>", "</answer>", "<think>", "</think>", "<", ">", "/", " ",
    "\n", "search", "answer", "Paris", "?"
]
_replies = st.lists(st.one_of(st.sampled_from(_FRAGMENTS), st.text(max_size=4)),
                    max_size=14).map("".join)


@settings(max_examples=400, deadline=None)
@given(_replies)
def test_parse_reply_matches_an_independent_scanner(reply):
  blocks = _blocks_by_scanning(reply)
  queries = [text for kind, text in blocks if kind == "search"]
  answers = [text for kind, text in blocks if kind == "answer"]
  if queries and answers or not blocks or (queries and not queries[0]):
    expected = None
  elif queries:
    expected = Action("search", queries[0])
  else:
    expected = Action("answer", answers[-1])
  assert parse_reply(reply) == expected


@settings(max_examples=200, deadline=None)
@given(st.text().filter(lambda t: "<" not in t and t.strip()),
       st.text().filter(lambda t: "<" not in t))
def test_a_query_round_trips_through_the_reply_format(query, thought):
  assert parse_reply(f"<think>{thought}</think>\n<search>{query}</search>") == Action(
      "search", query.strip())


@settings(max_examples=150, deadline=None)
@given(_replies)
def test_env_step_never_raises_on_model_output(env, reply):
  env.reset(env.task_ids("test")[0])
  result = env.step(reply)
  action = parse_reply(reply)
  if action is None:
    assert (result.observation, result.reward, result.done) == (INVALID_OBSERVATION, 0.0, False)
  elif action.kind == "search":
    assert result.observation.startswith("<information>") and not result.done
  else:
    assert result.done and result.info["success"] == (result.reward == 1.0)


# Retrievers.


def test_s_stem_folds_plurals():
  assert [s_stem(w) for w in ["sticks", "berries", "boxes", "glass", "cactus", "stick"]
         ] == ["stick", "berry", "boxe", "glass", "cactus", "stick"]


def test_bm25_finds_the_page_of_a_title_query():
  pages = minecraft.dataset().pages
  bm25 = BM25Retriever(pages)
  assert bm25.search("Crafting Table", 3)[0].title == "Crafting Table"
  assert bm25.search("Magma Cream", 3)[0].title == "Magma Cream"
  # A content query: TNT is the page whose recipe takes both.
  assert "TNT" in [doc.title for doc in bm25.search("gunpowder and sand", 3)]
  # Plain BM25 ranks the long page Stick (ingredient of 60 items) below "... on a Stick";
  # TitleFirst puts the page named by the query first, plural or not.
  titled = TitleFirst(bm25, pages)
  assert titled.search("Stick", 3)[0].title == "Stick"
  assert titled.search("sticks", 3)[0].title == "Stick"
  assert bm25.search("zzzz qqqq", 3) == []  # no shared token, no result


def test_bm25_index_saved_and_reloaded(tmp_path):
  docs = [
      Doc("Oak Log", "A log of oak wood."),
      Doc("Stick", "Made from planks."),
      Doc("Torch", "Made from coal and a stick.")
  ]
  built = BM25Retriever(docs, tmp_path / "index")
  reloaded = BM25Retriever(docs, tmp_path / "index")
  for query in ["stick", "oak wood", "coal"]:
    assert reloaded.search(query, 2) == built.search(query, 2)
  with pytest.raises(ValueError, match="stale index"):
    BM25Retriever(docs[:2], tmp_path / "index")


def test_top_k_indices_breaks_ties_by_document_order():
  scores = np.array([1.0, 3.0, 3.0, 2.0, 3.0])
  assert top_k_indices(scores, 2).tolist() == [1, 2]
  assert top_k_indices(scores, 4).tolist() == [1, 2, 4, 3]
  assert top_k_indices(scores, 9).tolist() == [1, 2, 4, 3, 0]


_VOCABULARY = ("oak", "stone", "iron", "tool", "wood")
_DENSE_DOCS = [
    Doc("Oak Planks", "wood from oak"),
    Doc("Stone Pickaxe", "a stone tool"),
    Doc("Iron Pickaxe", "an iron tool, better than stone"),
    Doc("Oak Door", "oak")
]


def _toy_embed(texts):
  """Bag of words over _VOCABULARY: [Q, 5] counts."""
  return np.array([[text.lower().split().count(word) for word in _VOCABULARY] for text in texts],
                  dtype=np.float32)


@pytest.mark.parametrize("use_faiss", [False, True])
def test_dense_retriever_ranks_by_inner_product(use_faiss):
  if use_faiss:
    pytest.importorskip("faiss")
  embeddings = _toy_embed([f"{d.title} {d.text}" for d in _DENSE_DOCS])
  dense = DenseRetriever(_DENSE_DOCS, embeddings, _toy_embed, use_faiss=use_faiss)
  # "stone tool" is [0, 1, 0, 1, 0]. "Stone Pickaxe a stone tool" counts stone 2, tool 1:
  # score 3; "Iron Pickaxe an iron tool, better than stone" counts stone 1 ("tool," is not a
  # word of the vocabulary): score 1; the oak pages score 0.
  assert [d.title for d in dense.search("stone tool", 2)] == ["Stone Pickaxe", "Iron Pickaxe"]
  # "oak": Oak Planks 2, Oak Door 2 (a tie, document order), others 0.
  assert [d.title for d in dense.search("oak", 2)] == ["Oak Planks", "Oak Door"]


def test_dense_retriever_rejects_mismatched_shapes():
  with pytest.raises(ValueError, match="do not match"):
    DenseRetriever(_DENSE_DOCS, np.zeros((3, 5), np.float32), _toy_embed)
  dense = DenseRetriever(_DENSE_DOCS, np.zeros((4, 5), np.float32), lambda texts: np.zeros((1, 7)))
  with pytest.raises(ValueError, match="expected"):
    dense.search("oak", 2)


# The generated Minecraft set.


def test_world_facts_worked_examples():
  world = minecraft.World()
  assert world.always_drop("creeper") == "gunpowder"
  assert world.always_drop("spider") is None  # string and spider eye: ambiguous
  assert world.mined_drop("diamond_ore") == "diamond"
  assert world.mined_drop("gravel") is None  # flint or gravel
  assert world.only_use("magma_cream") == "magma_block"
  assert world.count("tnt", "gunpowder") == 5  # 5 gunpowder + 4 sand
  assert world.count("stone_pickaxe", "stick") == 2  # both recipes (cobblestone, blackstone)
  assert world.count("stone_pickaxe", "cobblestone") is None  # the blackstone one has none
  assert world.combinations()[("gunpowder", "sand")][0] == "tnt"
  assert ("coal", "stick") in world.combinations()  # torch; campfire also takes logs
  # Storage recipes that TextCraft drops are back: 9 iron nuggets make an ingot.
  assert any(r.count == 1 and [(i.item, i.count) for i in r.ingredients] == [("iron_nugget", 9)]
             for r in world.recipes["iron_ingot"])


def test_generated_questions_worked_examples():
  data = minecraft.dataset()
  by_text = {q.question: q for q in data.test + data.train}
  # Magma Cube -> Magma Cream -> Magma Block.
  question = by_text["What is the only item crafted from the item that a Magma Cube always drops?"]
  assert question.golden_answers == ("Magma Block",) and question.category == "2-hop name"
  # Creeper -> Gunpowder; TNT is 5 Gunpowder + 4 Sand.
  question = by_text[
      "How many of the item that a Creeper always drops does the recipe for TNT use?"]
  assert question.golden_answers == ("5", "five") and question.category == "2-hop count"


def test_generated_set_shape_and_splits(env):
  data = minecraft.dataset()
  assert 200 <= len(data.test) <= 400 and len(data.train) > 5000
  assert len({q.question for q in data.test + data.train}) == len(data.test) + len(data.train)
  titles = [page.title for page in data.pages]
  assert len(set(titles)) == len(titles) > 1000
  assert not any(", " in title for title in titles)  # ingredient-of lists split on ", "
  test_ids, train_ids = env.task_ids("test"), env.task_ids("train")
  assert list(test_ids) == list(range(len(data.test)))
  assert set(test_ids).isdisjoint(train_ids)
  categories = {env.task_info(i)["category"] for i in test_ids}
  assert {"2-hop name", "3-hop name", "2-hop count", "3-hop count", "2-hop food"} <= categories
  for task_id in test_ids:
    info = env.task_info(task_id)
    assert info["split"] == "test"
    assert info["category"].startswith(f"{len(_page_visits(info['hops']))}-hop")


def test_no_answer_dominates_a_category():
  data = minecraft.dataset()
  for split in (data.test, data.train):
    by_category = {}
    for question in split:
      by_category.setdefault(question.category, []).append(question.golden_answers[0])
    for category, answers in by_category.items():
      if len(answers) >= 20:
        top = max(answers.count(a) for a in set(answers))
        assert top <= 0.3 * len(answers), (category, top, len(answers))


_DETERMINISM_SCRIPT = """
import hashlib, json
from environments.searchqa import minecraft
data = minecraft.dataset()
blob = json.dumps([[p.title, p.text] for p in data.pages]
                  + [[q.id, q.question, list(q.golden_answers), q.category]
                     for q in data.test + data.train])
print(hashlib.sha256(blob.encode()).hexdigest())
"""


def test_generation_is_deterministic_across_hash_seeds():
  digests = [
      run_python("-c", _DETERMINISM_SCRIPT, hash_seed=seed).strip() for seed in ("0", "4242")
  ]
  assert digests[0] == digests[1] and len(digests[0]) == 64


# A scripted oracle solves every generated test question through the env's search results.

_DOC_LINE = re.compile(r"Doc (\d+)\(Title: (.*?)\) (.*)")
_RECIPE = re.compile(r"Recipe: (.+?) -> \d+ (.+?)\.(?= |$)")
_INGREDIENT_OF = re.compile(r"It is an ingredient of: (.+?)\.(?= |$)")


def _page_visits(hops):
  return [h["title"] for i, h in enumerate(hops) if i == 0 or h["title"] != hops[i - 1]["title"]]


def _search(env, query):
  """title -> text of the documents a search step returns."""
  result = env.step(f"<think>I need {query}.</think>\n<search> {query} </search>")
  assert not result.done and result.reward == 0.0
  assert result.observation.startswith("<information>")
  assert result.observation.endswith("</information>")
  lines = result.observation[len("<information>"):-len("</information>")].split("\n")
  docs = {}
  for number, line in enumerate(lines, 1):
    match = _DOC_LINE.fullmatch(line)
    assert match and int(match.group(1)) == number, line
    docs[match.group(2)] = match.group(3)
  return docs


def _made_from_just(text, title, names):
  """Whether a page has a recipe of `title` that takes exactly the items `names`."""
  for inputs, output in _RECIPE.findall(text):
    if output == title and {part.split(" ", 1)[1] for part in inputs.split(" + ")} == names:
      return True
  return False


def _find_combination(env, names):
  """The page of the item crafted from just the two `names`: a search for both, or else the
  pages in both of their ingredient-of lists."""
  for title, text in _search(env, " ".join(names)).items():
    if _made_from_just(text, title, set(names)):
      return title, text
  uses = [
      set(_INGREDIENT_OF.search(_search(env, name)[name]).group(1).split(", ")) for name in names
  ]
  for candidate in sorted(uses[0] & uses[1]):
    text = _search(env, candidate)[candidate]
    if _made_from_just(text, candidate, set(names)):
      return candidate, text
  raise AssertionError(f"no page made from just {names}")


def _words(text):
  return f" {normalize_answer(text)} "


def _solve(env, task_id):
  """Reads the question's pages in order, checking that each search finds the page, that the
  page states the hop's fact, and that every name searched for was known by then."""
  info = env.task_info(task_id)
  known = _words(env.reset(task_id))
  for hop in info["hops"]:
    for name in hop["names"]:
      assert _words(name) in known, (name, info)
    if len(hop["names"]) == 1:
      docs = _search(env, hop["names"][0])
      assert hop["title"] in docs, (hop, list(docs))
      text = docs[hop["title"]]
    else:
      title, text = _find_combination(env, hop["names"])
      assert title == hop["title"]
    assert hop["evidence"] in text, (hop, text)
    known += _words(hop["evidence"])
  assert any(
      _words(answer) in _words(info["hops"][-1]["evidence"]) for answer in info["golden_answers"])
  return env.step(f"<think>Found it.</think>\n<answer> {info['golden_answers'][0]} </answer>")


def test_oracle_solves_every_test_question_from_search_results(env):
  for task_id in env.task_ids("test"):
    result = _solve(env, task_id)
    assert (result.observation, result.reward, result.done) == (CORRECT_OBSERVATION, 1.0, True)
    assert result.info["success"]


# The env protocol.


def test_env_implements_the_protocol_and_registers(env):
  assert isinstance(env, base.Env)
  made = base.make("searchqa")
  assert made.task_info(0) == env.task_info(0)
  for tag in ("<search>", "</search>", "<information>", "<answer>", "</answer>"):
    assert tag in env.instruction
  with pytest.raises(ValueError, match="out of range"):
    env.task_info(len(env.task_ids("test")) + len(env.task_ids("train")))
  with pytest.raises(ValueError, match="unknown split"):
    env.task_ids("dev")


def test_episode_searches_are_not_capped_and_answers_end_it(env):
  task_id = env.task_ids("test")[0]
  assert env.reset(task_id) == f"Question: {env.task_info(task_id)['question']}"
  for count in range(1, 31):
    result = env.step("<search>stick</search>")
    assert not result.done and result.info["searches"] == count
  result = env.step("no tags at all")
  assert (result.observation, result.done, result.info["action"]) == (INVALID_OBSERVATION, False,
                                                                      "invalid")
  result = env.step("<answer>certainly not this</answer>")
  assert (result.observation, result.reward, result.done,
          result.info["success"]) == (WRONG_OBSERVATION, 0.0, True, False)
  with pytest.raises(RuntimeError, match="reset"):
    env.step("<answer>again</answer>")


def test_bad_options_fail_clearly(tmp_path):
  with pytest.raises(ValueError, match="top_k"):
    SearchQAEnv(top_k=0)
  with pytest.raises(ValueError, match="need data_dir"):
    SearchQAEnv(corpus_path="corpus.jsonl")
  with pytest.raises(ValueError, match="embed_fn"):
    SearchQAEnv(retriever="dense")
  with pytest.raises(ValueError, match="unknown retriever"):
    SearchQAEnv(retriever="tfidf")
  with pytest.raises(FileNotFoundError, match="not a directory"):
    SearchQAEnv(data_dir=str(tmp_path / "missing"))


# FlashRAG-format data.


def _write_jsonl(path, records):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps(record) + "\n" for record in records))


@pytest.fixture
def flashrag_dir(tmp_path):
  _write_jsonl(tmp_path / "nq" / "test.jsonl", [
      {
          "id": "test_0", "question": "what is the capital of france", "golden_answers": ["Paris"],
          "metadata": {"source": "wiki"}
      },
      {"id": "test_1", "question": "Who wrote Hamlet?", "golden_answers": "William Shakespeare"},
  ])
  _write_jsonl(
      tmp_path / "nq" / "train.jsonl",
      [{"id": "train_0", "question": "Where is the Eiffel Tower?", "golden_answers": ["Paris"]}])
  # Bamboogle ships a test file in FlashRAG; a dev file is read when there is no test file.
  _write_jsonl(tmp_path / "bamboogle" / "dev.jsonl", [{
      "id": "dev_0", "question": "Which river flows through Paris?",
      "golden_answers": ["Seine", "the Seine", "River Seine"]
  }])
  _write_jsonl(tmp_path / "corpus.jsonl", [
      {"id": "0", "contents": '"Paris"\nParis is the capital and largest city of France.'},
      {"id": "1", "contents": '"Hamlet"\nHamlet is a tragedy written by William Shakespeare.'},
      {"id": "2", "title": "Seine", "text": "The Seine is a river that flows through Paris."},
  ])
  return tmp_path


def test_flashrag_questions_load_with_agentgym_ids_and_paper_categories(flashrag_dir):
  env = SearchQAEnv(data_dir=str(flashrag_dir), test_sources=("nq", "bamboogle"),
                    train_sources=("nq",))
  assert list(env.task_ids("test")) == [0, 1, 2] and list(env.task_ids("train")) == [3]
  infos = [env.task_info(i) for i in range(4)]
  assert [i["category"] for i in infos] == ["NQ", "NQ", "Bamboogle", "NQ"]
  assert [i["id"] for i in infos] == ["test_0", "test_1", "dev_0", "train_0"]
  assert infos[0]["question"] == "what is the capital of france?"  # a "?" is added
  assert infos[0]["metadata"] == {"source": "wiki"}
  assert infos[1]["golden_answers"] == ["William Shakespeare"]  # a string is a list of one

  assert env.reset(0) == "Question: what is the capital of france?"
  result = env.step("<search>Paris</search>")
  # "paris" is twice in the Paris page, once in Seine's, never in Hamlet's (no result). The
  # FlashRAG title line is kept verbatim, quotes included, as AgentGym shows it.
  assert result.observation == (
      '<information>Doc 1(Title: "Paris") Paris is the capital and largest city of France.\n'
      "Doc 2(Title: Seine) The Seine is a river that flows through Paris.</information>")
  assert env.step("<answer> paris. </answer>").reward == 1.0
  env.reset(2)
  assert env.step("<answer>The Seine</answer>").info["success"]


def test_flashrag_errors_name_the_file(flashrag_dir):
  with pytest.raises(FileNotFoundError, match="triviaqa"):
    SearchQAEnv(data_dir=str(flashrag_dir))  # the default sources include triviaqa
  _write_jsonl(flashrag_dir / "bad" / "test.jsonl", [{"question": "q", "golden_answers": []}])
  with pytest.raises(ValueError, match=r"bad/test.jsonl: record 0: golden_answers"):
    load_flashrag(flashrag_dir, ("bad",), ())
  (flashrag_dir / "corpus.jsonl").rename(flashrag_dir / "wiki.jsonl")
  with pytest.raises(FileNotFoundError, match="corpus_path"):
    SearchQAEnv(data_dir=str(flashrag_dir), test_sources=("nq",), train_sources=())


def test_flashrag_parquet_reads_like_jsonl(flashrag_dir):
  parquet = pytest.importorskip("pyarrow.parquet")
  pyarrow = pytest.importorskip("pyarrow")
  records = [json.loads(line) for line in (flashrag_dir / "nq" / "train.jsonl").open()]
  (flashrag_dir / "pq").mkdir()
  parquet.write_table(pyarrow.Table.from_pylist(records), flashrag_dir / "pq" / "train.parquet")
  from_jsonl = load_flashrag(flashrag_dir, (), ("nq",))["train"]
  from_parquet = load_flashrag(flashrag_dir, (), ("pq",))["train"]
  assert [(q.id, q.question, q.golden_answers) for q in from_parquet
         ] == [(q.id, q.question, q.golden_answers) for q in from_jsonl]


def test_dense_retrieval_through_the_env(flashrag_dir):
  from environments.searchqa.retrievers import JsonlCorpus
  docs = list(JsonlCorpus(flashrag_dir / "corpus.jsonl"))
  vocabulary = ("capital", "tragedy", "river")

  def embed(texts):
    return np.array([[t.lower().count(w) for w in vocabulary] for t in texts], np.float32)

  np.save(flashrag_dir / "embeddings.npy", embed([f"{d.title} {d.text}" for d in docs]))
  env = SearchQAEnv(data_dir=str(flashrag_dir), retriever="dense", top_k=1, embed_fn=embed,
                    embeddings_path=str(flashrag_dir / "embeddings.npy"), test_sources=("nq",),
                    train_sources=())
  env.reset(0)
  assert env.step("<search>which river</search>").observation == (
      "<information>Doc 1(Title: Seine) The Seine is a river that flows through Paris."
      "</information>")
