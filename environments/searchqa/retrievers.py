"""Search engines for SearchQA: a corpus of titled documents and two retrievers over it.

Any object with `search(query, k) -> list[Doc]` is a retriever (the `Retriever` protocol), so a
user can plug in their own (a remote server, a different index). Two ship here:

- `BM25Retriever`: Okapi BM25 (the `bm25s` package; Lucene's variant, k1 = 1.5, b = 0.75) over
  "title\\ntext". Tokens are lowercased word runs of two or more characters, English stop words
  removed, plurals folded by Harman's S-stemmer (`s_stem`), so "sticks" finds "Stick".
  Documents that share no token with the query are not returned.
- `DenseRetriever`: inner product between a query embedding and precomputed document
  embeddings, score(q, d) = <embed(q), e_d>, top k by score, ties by document order (FAISS may
  pick a different set among documents tied at the k-th score). The
  embeddings are an [N, D] array (numpy, memory-mapped from .npy) or a FAISS index (.index /
  .faiss, as AgentGym's e5_Flat.index); a numpy array is searched by FAISS when it is installed
  (exact IndexFlatIP), else by numpy. `embed` maps a list of queries to a [Q, D] array; it is
  the user's (e.g. an e5 encoder with its "query: " prefix), as this project downloads no model.
`TitleFirst` wraps either so that documents titled as the query come first.

Corpora are JSONL files, one document a line, in either layout:
  {"id": ..., "contents": "Title\\ntext"}     FlashRAG / Search-R1 (wiki-18.jsonl): the first
                                             line is the title, verbatim (quotes included)
  {"id": ..., "title": ..., "text": ...}
`JsonlCorpus` keeps only the byte offset of each line and parses a line when it is read, so a
corpus of millions of passages costs 8 bytes a document in memory.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from typing import Callable, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from environments import jsonl


@dataclasses.dataclass(frozen=True)
class Doc:
  """One retrievable document."""

  title: str
  text: str


@runtime_checkable
class Retriever(Protocol):
  """A search engine: the `k` best documents for `query`, best first."""

  def search(self, query: str, k: int) -> list[Doc]:
    ...


def parse_document(record: dict, where: str = "document") -> Doc:
  """A corpus record (either JSONL layout of the module docstring) as a Doc."""
  if "contents" in record:
    title, _, text = str(record["contents"]).partition("\n")
    return Doc(title, text)
  if "title" in record and "text" in record:
    return Doc(str(record["title"]), str(record["text"]))
  raise ValueError(f"{where}: a corpus record needs 'contents' or 'title' and 'text'; "
                   f"got keys {sorted(record)}")


class JsonlCorpus(Sequence[Doc]):
  """The documents of a JSONL corpus file, read lazily by line offset."""

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    offsets = []
    with open(self.path, "rb") as corpus:
      position = 0
      for line in corpus:
        if line.strip():
          offsets.append(position)
        position += len(line)
    if not offsets:
      raise ValueError(f"{self.path}: the corpus has no documents")
    self._offsets = np.asarray(offsets, dtype=np.int64)

  def __len__(self) -> int:
    return len(self._offsets)

  def __getitem__(self, index):  # Sequence's int and slice indexing
    if isinstance(index, slice):
      return [self[i] for i in range(*index.indices(len(self)))]
    with open(self.path, "rb") as corpus:
      corpus.seek(int(self._offsets[index]))
      return self._document(corpus.readline(), index)

  def __iter__(self) -> Iterator[Doc]:
    with open(self.path, "rb") as corpus:
      lines = (line for line in corpus if line.strip())
      yield from (self._document(line, index) for index, line in enumerate(lines))

  def _document(self, line: bytes, index: int) -> Doc:
    where = f"{self.path}: document {index}"
    return parse_document(jsonl.parse_line(line, where), where)


def s_stem(word: str) -> str:
  """Harman's (1991) S-stemmer: fold English plurals, "ies" -> "y", "es" -> "e", "s" -> ""."""
  if word.endswith("ies") and not word.endswith(("eies", "aies")):
    return word[:-3] + "y"
  if word.endswith("es") and not word.endswith(("aes", "ees", "oes")):
    return word[:-1]
  if word.endswith("s") and not word.endswith(("us", "ss")):
    return word[:-1]
  return word


def _searchable_text(doc: Doc) -> str:
  return f"{doc.title}\n{doc.text}"


class BM25Retriever:
  """BM25 over a document sequence (module docstring).

  With `index_dir`, the index is loaded from there when it exists and saved there after it is
  built, so a large corpus is tokenized once.
  """

  def __init__(self, docs: Sequence[Doc], index_dir: str | os.PathLike | None = None):
    # Imported here: bm25s imports jax when it loads (seconds), which processes that only read
    # questions or pages need not pay.
    import bm25s  # pylint: disable=g-import-not-at-top
    self.docs = docs
    self._tokenizer = bm25s.tokenization.Tokenizer(stopwords="en", stemmer=s_stem)
    if index_dir is not None and os.path.exists(os.path.join(index_dir, "params.index.json")):
      self._bm25 = bm25s.BM25.load(index_dir, mmap=True, show_progress=False)
      self._tokenizer.load_vocab(index_dir)
    else:
      tokens = self._tokenizer.tokenize(
          (_searchable_text(doc) for doc in docs), length=len(docs), update_vocab=True,
          return_as="tuple", show_progress=False)  # ids with their vocabulary, for save()
      self._bm25 = bm25s.BM25()
      self._bm25.index(tokens, show_progress=False)
      if index_dir is not None:
        self._bm25.save(index_dir, show_progress=False)
        self._tokenizer.save_vocab(index_dir)
    if self._bm25.scores["num_docs"] != len(docs):
      raise ValueError(f"the BM25 index holds {self._bm25.scores['num_docs']} documents but the "
                       f"corpus {len(docs)}; delete the stale index in {index_dir}")

  def search(self, query: str, k: int) -> list[Doc]:
    query_tokens = self._tokenizer.tokenize([query], update_vocab=False, return_as="ids",
                                            show_progress=False)
    k = min(k, len(self.docs))
    indices, scores = self._bm25.retrieve(query_tokens, k=k, show_progress=False, n_threads=1)
    return [self.docs[int(i)] for i, score in zip(indices[0], scores[0]) if score > 0]


def title_key(text: str) -> str:
  """A title or query reduced to its stemmed lowercase words: "Sticks!" -> "stick"."""
  return " ".join(s_stem(word) for word in re.findall(r"\w+", text.lower()))


class TitleFirst:
  """Wraps a retriever: documents whose title is the query come first (`title_key` equality).

  A search engine over an encyclopedia sends a query that names an article to that article
  ("Stick" to the page Stick, which BM25 ranks below the short pages titled "... on a Stick").
  The lookup table holds one entry per distinct title, so it is meant for corpora that fit in
  memory several times over.
  """

  def __init__(self, retriever: Retriever, docs: Sequence[Doc]):
    self.retriever = retriever
    self._by_title: dict[str, list[Doc]] = {}
    for doc in docs:
      self._by_title.setdefault(title_key(doc.title), []).append(doc)

  def search(self, query: str, k: int) -> list[Doc]:
    ranked = self._by_title.get(title_key(query), []) + self.retriever.search(query, k)
    return list(dict.fromkeys(ranked))[:k]


def load_embeddings(path: str | os.PathLike):
  """Document embeddings: an [N, D] float32 array (.npy, memory-mapped) or a FAISS index."""
  path = os.fspath(path)
  if path.endswith(".npy"):
    embeddings = np.load(path, mmap_mode="r")
    if embeddings.ndim != 2:
      raise ValueError(f"{path}: embeddings must be [num_docs, dim], got shape {embeddings.shape}")
    return embeddings
  if path.endswith((".index", ".faiss")):
    try:
      import faiss  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ImportError(
          f"reading the FAISS index {path} needs faiss (pip install faiss-cpu)") from None
    return faiss.read_index(path)
  raise ValueError(f"{path}: embeddings must be a .npy array or a FAISS .index/.faiss file")


def resolve_callable(spec: str | Callable) -> Callable:
  """A callable, or the one a "module:attribute" string names."""
  if callable(spec):
    return spec
  module_name, sep, attribute = str(spec).partition(":")
  if not sep:
    raise ValueError(f"expected a callable or 'module:attribute', got {spec!r}")
  return getattr(importlib.import_module(module_name), attribute)


class DenseRetriever:
  """Top-k inner product search over precomputed embeddings (module docstring)."""

  def __init__(self, docs: Sequence[Doc], embeddings, embed: Callable[[list[str]], np.ndarray],
               use_faiss: bool | None = None):
    self.docs = docs
    self._embed = embed
    if isinstance(embeddings, np.ndarray):
      if embeddings.ndim != 2 or len(embeddings) != len(docs):
        raise ValueError(f"embeddings of shape {embeddings.shape} do not match "
                         f"{len(docs)} documents")
      faiss = _optional_faiss() if use_faiss is not False else None
      if use_faiss and faiss is None:
        raise ImportError("use_faiss=True needs faiss (pip install faiss-cpu)")
      self._matrix = np.asarray(embeddings, dtype=np.float32)
      self._index = None
      if faiss is not None:
        self._index = faiss.IndexFlatIP(self._matrix.shape[1])
        self._index.add(np.ascontiguousarray(self._matrix))
    else:  # a FAISS index
      if embeddings.ntotal != len(docs):
        raise ValueError(f"the FAISS index holds {embeddings.ntotal} vectors but the corpus "
                         f"{len(docs)} documents")
      self._matrix, self._index = None, embeddings

  def search(self, query: str, k: int) -> list[Doc]:
    query_vector = np.asarray(self._embed([query]), dtype=np.float32)
    dim = self._index.d if self._index is not None else self._matrix.shape[1]
    if query_vector.shape != (1, dim):
      raise ValueError(f"embed returned shape {query_vector.shape} for one query; expected "
                       f"(1, {dim})")
    k = min(k, len(self.docs))
    if self._index is not None:
      scores, indices = self._index.search(query_vector, k)
      # FAISS orders equal scores its own way; document order makes ties deterministic.
      order = [int(i) for _, i in sorted(zip(-scores[0], indices[0])) if i >= 0]
    else:
      order = top_k_indices(self._matrix @ query_vector[0], k).tolist()
    return [self.docs[i] for i in order]


def top_k_indices(scores: np.ndarray, k: int) -> np.ndarray:
  """Indices of the k largest `scores` [N], best first, ties broken by lower index.

  A partial partition finds the k-th largest score in O(N); only the candidates at or above it
  are sorted, so a large corpus is not fully sorted per query.
  """
  if k < len(scores):
    kth_largest = -np.partition(-scores, k - 1)[k - 1]
    candidates = np.flatnonzero(scores >= kth_largest)
  else:
    candidates = np.arange(len(scores))
  return candidates[np.lexsort((candidates, -scores[candidates]))][:k]


def _optional_faiss():
  try:
    import faiss  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return faiss
