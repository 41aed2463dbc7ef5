"""Writes that land whole or not at all, and cache reads that survive a write that did not land.

A file or a whole folder is written under a temporary name beside its destination, flushed to disk and
renamed onto it, so a kill -9 or a full disk leaves either the old content or none; a reader that finds a
cache it cannot read warns, removes it and lets the caller rebuild it. Design notes: docs/design/storage.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import uuid
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")
PART = ".part-"  # temporary names: .<name>.part-<host>-<pid>-<random>, never read as the destination
# What reading a torn or corrupt cache raises: the OS, a parser (JSON, UTF-8 and our own format errors
# are ValueErrors), a missing member, a short read, a broken zip (np.load of a torn .npz).
CACHE_READ_ERRORS = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile)


class CacheRebuildWarning(UserWarning):
    """A cache that could not be read was removed and will be rebuilt."""


def _temporary_name(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}{PART}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def sweep(dest: str | Path) -> None:
    """Remove temporary siblings of `dest` left by writers on this host that have died (a kill -9)."""
    dest = Path(dest)
    prefix = f".{dest.name}{PART}{socket.gethostname()}-"
    if not dest.parent.is_dir():
        return
    for stale in dest.parent.iterdir():
        if not stale.name.startswith(prefix):
            continue
        pid = stale.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            remove(stale)


def readable_by_all(folder: str | Path) -> None:
    """Every file of `folder` we own made readable by all, as a folder of weights is: safetensors writes its
    files owner-only, and a sandboxed candidate (a uid of its own) must read the weights."""
    for f in Path(folder).iterdir():
        try:
            st = f.stat()
            if f.is_file() and st.st_uid == os.geteuid() and (st.st_mode & 0o044) != 0o044:
                f.chmod(st.st_mode | 0o044)
        except OSError:
            pass


def remove(path: str | Path) -> None:
    """Remove a file, a link or a whole folder; absent is fine."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def fsync_dir(path: str | Path) -> None:
    """Make the renames inside folder `path` durable (some file systems refuse: nothing to do there)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            path = Path(folder) / name
            if not path.is_symlink():
                _fsync_file(path)
        fsync_dir(folder)


@contextlib.contextmanager
def temporary_file(dest: str | Path) -> Iterator[Path]:
    """A path beside `dest` to write its content to; on a clean exit the file is flushed to disk and
    renamed onto `dest`, on an error (or an interrupt) it is removed and `dest` is left as it was."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    sweep(dest)
    tmp = _temporary_name(dest)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, dest)
    except BaseException:
        remove(tmp)
        raise
    fsync_dir(dest.parent)


@contextlib.contextmanager
def temporary_directory(dest: str | Path) -> Iterator[Path]:
    """A fresh folder beside `dest` to build its whole content in; on a clean exit every file in it is
    flushed to disk and the folder takes `dest`'s place (an older `dest` is removed), on an error it is
    removed. A marker a reader trusts goes in last by convention; the rename is what commits it."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    sweep(dest)
    tmp = _temporary_name(dest)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        replace_directory(tmp, dest)
    except BaseException:
        remove(tmp)
        raise


def replace_directory(src: str | Path, dest: str | Path) -> None:
    """Rename folder `src` onto `dest`. An existing `dest` is renamed aside first and then removed: a kill
    between the two renames leaves `dest` absent (rebuilt), never a mix of old and new files."""
    src, dest = Path(src), Path(dest)
    if dest.exists() or dest.is_symlink():
        old = _temporary_name(dest)
        os.replace(dest, old)
        os.replace(src, dest)
        fsync_dir(dest.parent)
        remove(old)
    else:
        os.replace(src, dest)
        fsync_dir(dest.parent)


def write_bytes(dest: str | Path, data: bytes) -> Path:
    with temporary_file(dest) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
    return Path(dest)


def write_text(dest: str | Path, text: str) -> Path:
    return write_bytes(dest, text.encode("utf-8"))


def write_json(dest: str | Path, obj: Any, **dumps_kwargs) -> Path:
    """`obj` as JSON (json.dumps's keyword arguments apply) and a final newline."""
    return write_text(dest, json.dumps(obj, **dumps_kwargs) + "\n")


def read_cache(path: str | Path, load: Callable[[Path], T], what: str,
               errors: tuple[type[BaseException], ...] = CACHE_READ_ERRORS) -> T | None:
    """`load(path)`, or None when `path` is absent or `load` raises one of `errors`: then a warning names
    the cache and the error, and `path` is removed so the caller rebuilds it instead of failing on it."""
    path = Path(path)
    if not (path.exists() or path.is_symlink()):
        return None
    try:
        return load(path)
    except errors as e:
        discard(path, what, e)
        return None


def discard(path: str | Path, what: str, error: BaseException) -> None:
    """Warn that the cache at `path` is unreadable (`error`) and remove it, so it is rebuilt."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    warnings.warn(f"{what} at {path} is unreadable ({type(error).__name__}: {first[:300]}); "
                  f"removing it and rebuilding", CacheRebuildWarning, stacklevel=3)
    remove(path)


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of an append-only JSON-lines file. A last line that does not parse (a writer killed
    mid-append) is skipped with a warning; a bad line before it is damage, a ValueError naming the line."""
    path = Path(path)
    lines = [(i, ln) for i, ln in enumerate(path.read_text().splitlines(), 1) if ln.strip()]
    records = []
    for k, (i, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if k < len(lines) - 1:
                raise ValueError(f"{path}:{i} is not a JSON record ({e})") from e
            warnings.warn(f"{path}:{i}: skipping a last line cut short ({e})", stacklevel=2)
    return records
