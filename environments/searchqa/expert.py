"""SearchQA's expert, for the generated questions: a search for each page the answer goes
through (the question's hops, in order, each page once in a row), then the first gold answer,
with the last hop's evidence as its thought. A search for a page's title brings that page first
on the generated corpus (retrievers.TitleFirst). FlashRAG questions carry no hops, so there is no
expert for them.
"""

from __future__ import annotations

from environments import base


def replies(env: base.Env, task_id: int) -> list[str]:
  """The searches and the answer of a generated question, in the env's action format."""
  info = env.task_info(task_id)
  hops = info.get("hops")
  if not hops:
    raise base.ExpertError(f"task {task_id} has no hops (a FlashRAG question): nothing to follow")
  titles = [
      hop["title"] for i, hop in enumerate(hops) if i == 0 or hop["title"] != hops[i - 1]["title"]
  ]
  searches = [
      base.reply_for(env, f"I look up {title}.", f"<search> {title} </search>") for title in titles
  ]
  answer = info["golden_answers"][0]
  thought = f"{hops[-1]['evidence']} So the answer is {answer}."
  return [*searches, base.reply_for(env, thought, f"<answer> {answer} </answer>")]
