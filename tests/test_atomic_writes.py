"""Whole-or-nothing writes (`specpilot.atomic_io`): a failed write leaves the old content and no temporary
file; a folder replaces an older one in one rename; leftovers of dead writers are swept; an unreadable
cache is reported, removed and rebuilt."""

import json
import os
import subprocess
import sys

import pytest

from specpilot import atomic_io


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if atomic_io.PART in p.name)


def test_a_write_replaces_the_file_whole(tmp_path):
    dest = tmp_path / "sub" / "record.json"
    atomic_io.write_json(dest, {"a": 1})
    atomic_io.write_json(dest, {"a": 2}, indent=2)
    assert json.loads(dest.read_text()) == {"a": 2}
    assert dest.read_text().endswith("\n")
    assert _leftovers(dest.parent) == []


def test_a_failed_write_keeps_the_old_content_and_no_temporary(tmp_path):
    dest = tmp_path / "data.bin"
    atomic_io.write_bytes(dest, b"old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_io.temporary_file(dest) as tmp:
            tmp.write_bytes(b"half of the ne")
            raise RuntimeError("disk full")
    assert dest.read_bytes() == b"old"
    assert _leftovers(tmp_path) == []


def test_a_folder_replaces_an_older_one_and_a_failed_one_leaves_it(tmp_path):
    dest = tmp_path / "model"
    with atomic_io.temporary_directory(dest) as tmp:
        (tmp / "weights").write_bytes(b"v1")
        (tmp / "stale").write_bytes(b"only in v1")
    with atomic_io.temporary_directory(dest) as tmp:
        (tmp / "weights").write_bytes(b"v2")
    assert sorted(p.name for p in dest.iterdir()) == ["weights"]
    assert (dest / "weights").read_bytes() == b"v2"
    with pytest.raises(KeyboardInterrupt):
        with atomic_io.temporary_directory(dest) as tmp:
            (tmp / "weights").write_bytes(b"v3, torn")
            raise KeyboardInterrupt
    assert (dest / "weights").read_bytes() == b"v2"
    assert _leftovers(tmp_path) == []


def test_leftovers_of_a_dead_writer_are_swept_and_a_live_ones_kept(tmp_path):
    dest = tmp_path / "cache.json"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    host = atomic_io.socket.gethostname()
    stale = tmp_path / f".cache.json{atomic_io.PART}{host}-{int(dead.stdout)}-0000"
    stale.write_text("torn")
    live = tmp_path / f".cache.json{atomic_io.PART}{host}-{os.getppid()}-0000"
    live.write_text("being written")
    atomic_io.write_text(dest, "whole")
    assert not stale.exists() and live.exists()
    assert dest.read_text() == "whole"


def test_an_unreadable_cache_is_removed_with_a_warning(tmp_path):
    path = tmp_path / "prompts.json"
    assert atomic_io.read_cache(path, lambda p: json.loads(p.read_text()), "prompt set") is None  # absent
    path.write_text('{"tokens": [[1, 2')  # a writer killed mid-file
    with pytest.warns(atomic_io.CacheRebuildWarning, match="prompt set at .*prompts.json is unreadable"):
        got = atomic_io.read_cache(path, lambda p: json.loads(p.read_text()), "prompt set")
    assert got is None and not path.exists()
    atomic_io.write_json(path, {"tokens": [[1, 2]]})
    assert atomic_io.read_cache(path, lambda p: json.loads(p.read_text()), "prompt set") == {"tokens": [[1, 2]]}


def test_an_error_outside_the_listed_kinds_is_not_swallowed(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{}")

    def broken_loader(p):
        raise TypeError("a bug in the loader, not a torn file")

    with pytest.raises(TypeError):
        atomic_io.read_cache(path, broken_loader, "x")
    assert path.exists()


def test_a_jsonl_file_cut_short_loses_only_its_last_record(tmp_path):
    path = tmp_path / "results.jsonl"
    whole = json.dumps({"method": "ar", "n": 1}) + "\n" + json.dumps({"method": "stock", "n": 2}) + "\n"
    path.write_text(whole + '{"method": "sto')  # a writer killed mid-append
    with pytest.warns(UserWarning, match="results.jsonl:3"):
        assert atomic_io.read_jsonl(path) == [{"method": "ar", "n": 1}, {"method": "stock", "n": 2}]
    path.write_text('{"method": "ar"\n' + whole)  # damage before the end is not a torn append
    with pytest.raises(ValueError, match="results.jsonl:1"):
        atomic_io.read_jsonl(path)
