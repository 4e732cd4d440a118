"""Paths of what runs read and write, on the local disk or in a bucket (`gs://`, `s3://`).

Workdirs, checkpoints, metrics, trajectories, evaluations, exports and model directories are
`etils.epath.Path`s, the path type Orbax uses: a local path behaves as `pathlib.Path`, and a
`gs://bucket/dir` path reads and writes Cloud Storage objects through fsspec (`gcsfs`, the `gcs`
extra). `pathlib.Path("gs://bucket/run")` would instead name a local folder `gs:`.

Object stores cannot append to or rename an object, so `replace_file` writes the whole file:
through a temporary file and an atomic rename locally, as one object write (atomic too) in a
bucket.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import tempfile

from etils import epath

Path = epath.Path


class UnreachablePathError(OSError):
  """A bucket path that cannot be listed or written; the message is one line."""


def path(value: str | os.PathLike[str]) -> epath.Path:
  """`value` as a path, local or in a bucket."""
  return epath.Path(value)


def is_remote(value: str | os.PathLike[str]) -> bool:
  """Whether `value` names a bucket path (scheme://...) rather than a local one."""
  return "://" in os.fspath(value)


def check_directory(value: str | os.PathLike[str], what: str) -> epath.Path:
  """`value` as a directory that may exist (a resumed run) and can be written.

  A local file, or a bucket path whose bucket cannot be listed or written (no such bucket, no
  permission, no credentials, fsspec's backend for the scheme not installed), raises
  UnreachablePathError with one line that names `what` (e.g. "--workdir=gs://b/run"). A bucket
  path is probed by writing and deleting one small object in it.
  """
  directory = path(value)
  try:
    if directory.exists() and not directory.is_dir():
      raise UnreachablePathError(f"{what} is a file, not a directory")
    if is_remote(value):
      directory.mkdir(parents=True, exist_ok=True)
      probe = directory / ".agentgym_write_probe"
      probe.write_text("")
      probe.unlink()
  except UnreachablePathError:
    raise
  except Exception as error:  # Every backend's failure (import, auth, HTTP) becomes one line.
    reason = " ".join(str(error).split())[:300] or type(error).__name__
    raise UnreachablePathError(
        f"{what} cannot be reached ({type(error).__name__}: {reason}); check the bucket's name "
        f"and this machine's permission to write there, and that the `gcs` extra is installed "
        f"(pip install -e \".[gcs]\")") from error
  return directory


def replace_file(target: str | os.PathLike[str], text: str) -> None:
  """Writes `text` to `target` so that a reader sees the old file or the new one, never a
  part: locally through a temporary file and an atomic rename (making the directory if it is
  missing), in a bucket as one object."""
  target = path(target)
  if is_remote(target):
    target.write_text(text, encoding="utf-8")
    return
  target.parent.mkdir(parents=True, exist_ok=True)
  temporary = target.with_name(target.name + ".tmp")
  with open(temporary, "w", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(temporary, target)


def copy_tree(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> None:
  """Copies the files of directory `source` (not its subdirectories) into `destination`,
  local or in a bucket, each file as one write."""
  destination = path(destination)
  destination.mkdir(parents=True, exist_ok=True)
  for file in path(source).iterdir():
    if file.is_file():
      (destination / file.name).write_bytes(file.read_bytes())


def local_directory(value: str | os.PathLike[str]) -> pathlib.Path:
  """A local directory holding the files of directory `value`: `value` itself when local; a
  bucket directory is copied once into ~/.cache/agentgym_jax/remote/<hash of its path> (loaders
  memory-map files, which needs them on disk)."""
  if not is_remote(value):
    return pathlib.Path(value).expanduser()
  key = hashlib.sha256(os.fspath(value).encode()).hexdigest()[:16]
  cache = pathlib.Path.home() / ".cache" / "agentgym_jax" / "remote" / key
  if not (cache / ".complete").exists():
    shutil.rmtree(cache, ignore_errors=True)
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = pathlib.Path(tempfile.mkdtemp(prefix=key, dir=cache.parent))
    try:
      copy_tree(value, partial)
    except Exception as error:  # Every backend's failure (import, auth, HTTP) becomes one line.
      shutil.rmtree(partial)
      reason = " ".join(str(error).split())[:300] or type(error).__name__
      raise UnreachablePathError(
          f"{os.fspath(value)} cannot be read ({type(error).__name__}: {reason})") from error
    (partial / ".complete").write_text(os.fspath(value))
    partial.rename(cache)
  return cache
