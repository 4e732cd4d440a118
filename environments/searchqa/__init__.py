"""SearchQA (Deep Search): answer questions by searching a corpus, Search-R1 format."""

from environments.searchqa.env import SearchQAEnv, format_information
from environments.searchqa.qa_data import Question, load_flashrag
from environments.searchqa.reply import Action, exact_match, normalize_answer, parse_reply
from environments.searchqa.retrievers import (BM25Retriever, DenseRetriever, Doc, JsonlCorpus,
                                              Retriever, TitleFirst)

__all__ = [
    "Action", "BM25Retriever", "DenseRetriever", "Doc", "JsonlCorpus", "Question", "Retriever",
    "SearchQAEnv", "TitleFirst", "exact_match", "format_information", "load_flashrag",
    "normalize_answer", "parse_reply"
]
