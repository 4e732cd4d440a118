"""Hugging Face Hub ids as model names: read from a huggingface_hub cache directory built here in
the Hub's layout (refs/main -> a commit, snapshots/<commit>/<file> -> blobs/<hash>) around the
tiny test checkpoint, with the Hub offline; an id absent from the cache fails in one line."""

import hashlib
import os
import pathlib

import pytest
from huggingface_hub import constants

import tiny
from agentgym_jax import models
from agentgym_jax.models import weights
from model_helpers import assert_loads_the_same

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(cache: pathlib.Path, repo_id: str, checkpoint: pathlib.Path) -> pathlib.Path:
  """Puts `checkpoint`'s files into `cache` as the Hub client stores a downloaded snapshot."""
  repo = cache / f"models--{repo_id.replace('/', '--')}"
  snapshot = repo / "snapshots" / COMMIT
  (repo / "blobs").mkdir(parents=True)
  snapshot.mkdir(parents=True)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(COMMIT)
  for file in checkpoint.iterdir():
    blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
    blob.write_bytes(file.read_bytes())
    (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
  return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
  cache = tmp_path / "hub"
  cache.mkdir()
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  return cache


def test_hub_id_loads_from_the_cache_offline(tmp_path, offline_cache):
  checkpoint = tiny.make_checkpoint(tmp_path / "tiny", seed=3)
  snapshot = _hub_cache(offline_cache, "acme/tiny-agent", checkpoint)
  assert models.resolve("acme/tiny-agent") == snapshot
  assert_loads_the_same("acme/tiny-agent", str(checkpoint))


def test_hub_id_absent_from_the_cache_is_one_line_naming_the_fetch(offline_cache):
  with pytest.raises(weights.WeightsNotFoundError) as error:
    models.resolve("acme/not-fetched")
  message = str(error.value)
  assert len(message.splitlines()) == 1
  assert "offline" in message and str(offline_cache) in message
  assert "`hf download acme/not-fetched`" in message


def test_a_local_directory_wins_over_a_hub_id_of_the_same_name(tmp_path, offline_cache,
                                                               monkeypatch):
  tiny.make_checkpoint(tmp_path / "acme" / "tiny-agent")
  monkeypatch.chdir(tmp_path)
  assert models.resolve("acme/tiny-agent") == pathlib.Path("acme/tiny-agent")
