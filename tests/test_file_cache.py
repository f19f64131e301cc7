"""selfspec.model.file_cache: a file is read once while unchanged, again when it changes, once for
many threads at a time; profiles go through it."""

import json
import os
import threading
import time

import pytest

from selfspec.model import profiles
from selfspec.model.file_cache import FileCache


def counting_reader(reads: list):
    def read(path, *args):
        reads.append((str(path), *args))
        return json.loads(open(path).read())
    return read


def test_many_calls_read_the_file_once(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('{"x": 1}')
    cache, reads = FileCache(4), []
    read = counting_reader(reads)
    values = [cache.get(path, read) for _ in range(50)]
    assert len(reads) == 1 and all(v is values[0] for v in values) and values[0] == {"x": 1}
    assert cache.get(str(tmp_path / "." / "a.json"), read) is values[0]  # the same file by another spelling


def test_a_changed_file_is_read_again(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('{"x": 1}')
    cache, reads = FileCache(4), []
    read = counting_reader(reads)
    assert cache.get(path, read) == {"x": 1}
    path.write_text('{"x": 22}')  # another size
    assert cache.get(path, read) == {"x": 22}
    path.write_text('{"x": 33}')  # the same size, a later modification time
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert cache.get(path, read) == {"x": 33}
    assert cache.get(path, read) == {"x": 33}
    assert len(reads) == 3 and len(cache) == 1  # a file's older value is replaced, not kept beside


def test_the_reader_and_its_arguments_are_part_of_the_key(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("[1]")
    cache, reads = FileCache(8), []
    read = counting_reader(reads)
    cache.get(path, read, "model a")
    cache.get(path, read, "model b")
    cache.get(path, read, "model a")
    cache.get(path, counting_reader(reads), "model a")
    assert reads == [(str(path), "model a"), (str(path), "model b"), (str(path), "model a")]  # the last: another reader


def test_only_the_most_recently_used_are_kept(tmp_path):
    cache, reads = FileCache(2), []
    read = counting_reader(reads)
    paths = [tmp_path / f"{i}.json" for i in range(3)]
    for p in paths:
        p.write_text("0")
    cache.get(paths[0], read)
    cache.get(paths[1], read)
    cache.get(paths[0], read)  # now the most recent: paths[1] goes first
    cache.get(paths[2], read)
    cache.get(paths[0], read)
    assert len(reads) == 3 and len(cache) == 2
    cache.get(paths[1], read)
    assert len(reads) == 4


def test_a_missing_file_is_not_cached_and_the_reader_says_so(tmp_path):
    cache = FileCache(2)

    def read(path):
        raise FileNotFoundError(f"no {path}: run the tuner")

    with pytest.raises(FileNotFoundError, match="run the tuner"):
        cache.get(tmp_path / "none.json", read)
    assert len(cache) == 0


def test_a_failed_read_is_not_cached(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("{not json")
    cache, reads = FileCache(2), []
    read = counting_reader(reads)
    for _ in range(2):
        with pytest.raises(json.JSONDecodeError):
            cache.get(path, read)
    assert len(reads) == 2 and len(cache) == 0


def test_threads_asking_at_once_share_one_read(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('{"x": 1}')
    cache, reads, start = FileCache(2), [], threading.Barrier(16)

    def slow_read(p):
        reads.append(p)
        time.sleep(0.2)  # every other thread asks while this read is under way
        return {"x": 1}

    values = []
    threads = [threading.Thread(target=lambda: (start.wait(), values.append(cache.get(path, slow_read))))
               for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(values) == 16 and len(reads) == 1 and all(v is values[0] for v in values)


def test_a_profile_is_read_once_while_unchanged(tmp_path, monkeypatch):
    identity = profiles.ModelIdentity(name="m", config_hash="abc")
    path = tmp_path / "m.json"
    reads = []
    read_json = profiles._read_json
    monkeypatch.setattr(profiles, "_read_json", lambda p: reads.append(p) or read_json(p))
    profiles.save_section(identity, "tune", {"gamma": 2}, path)  # reads nothing: there is no file yet
    for _ in range(10):
        assert profiles.load_profile(identity, path)["tune"] == {"gamma": 2}
    profiles.load_profile(identity, path)["tune"]["gamma"] = 99  # a caller's copy: the cached value is untouched
    assert len(reads) == 1
    time.sleep(0.01)  # a later modification time even on coarse clocks
    profiles.save_section(identity, "tune", {"gamma": 3}, path)  # starts from the cached profile, rewrites it
    assert profiles.load_profile(identity, path)["tune"] == {"gamma": 3}
    assert len(reads) == 2
