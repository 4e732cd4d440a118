"""The README and docs/ pages link to files that exist, and to headings those files have."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
# A markdown link's target: `](path)` or `](path#anchor)`; the text before it may span lines.
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def relative_links(page: pathlib.Path) -> list[str]:
  """The page's link targets outside code blocks that are not URLs or in-page anchors."""
  text = FENCE.sub("", page.read_text())
  return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:|#", t)]


def anchors(page: pathlib.Path) -> set[str]:
  """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to '-'."""
  headings = re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.M)
  return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_pages_have_links_to_check():
  links = relative_links(ROOT / "README.md")
  assert "docs/training.md" in links and "docs/config.md" in links


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
  broken = []
  for target in relative_links(page):
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve()
    if not resolved.exists():
      broken.append(target)
    elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
      broken.append(target)
  assert not broken, f"{page.name}: links to nothing: {broken}"


def test_the_pages_moved_out_of_the_readme_are_reachable_from_it():
  seen, todo = set(), [ROOT / "README.md"]
  while todo:
    page = todo.pop()
    if page in seen or page.suffix != ".md" or not page.exists():
      continue
    seen.add(page)
    todo += [(page.parent / t.partition("#")[0]).resolve() for t in relative_links(page)]
  moved = ["training", "models", "multihost", "performance", "results", "config", "tpu",
           "environments"]
  assert not [name for name in moved if ROOT / "docs" / f"{name}.md" not in seen]
