"""llama.cpp's plain greedy decoding of the same GGUF file: what a CPU user would run instead.

Optional (`selfspec bench --llamacpp`): `llama-cpp-python` builds llama.cpp from source, about 8
minutes on 2 cores, so it is no dependency of selfspec or its tests. llama.cpp runs the GGUF's
quantized blocks natively (Q4_1 for SmolLM2), so its tokens are its own model's, not our dequantized
one's: the row is a speed reference, and its "= AR" column is expected to differ.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

INSTALL = "pip install llama-cpp-python (it builds llama.cpp from source: about 8 minutes on 2 cores)"


@contextlib.contextmanager
def gguf_file(name_or_path: str | None) -> Iterator[Path]:
    """The GGUF file a model was converted from, for the with-block: a bundled model's packaged file
    (a split one assembled into a temporary directory, removed on leaving the block; llama.cpp maps
    the file, so a model loaded inside the block keeps working), or a .gguf path as given."""
    from selfspec.model.loading import DEFAULT_MODEL, _bundled

    name_or_path = name_or_path or DEFAULT_MODEL
    bundled = _bundled(name_or_path)
    if bundled is None:
        if str(name_or_path).endswith(".gguf") and Path(name_or_path).is_file():
            yield Path(name_or_path)
            return
        raise ValueError(f"--llamacpp needs a GGUF model (a bundled one or a .gguf file), not {name_or_path!r}")
    scratch = Path(tempfile.mkdtemp(prefix="selfspec-gguf-"))
    try:
        yield bundled.gguf(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class LlamaCpp:
    """One llama.cpp model, greedy, with the given thread count for prefill and decoding."""

    def __init__(self, path: Path, threads: int, context: int = 4096):
        try:
            from llama_cpp import Llama
        except ImportError as err:
            raise ModuleNotFoundError(f"the llama.cpp reference needs llama-cpp-python: {INSTALL}",
                                      name="llama_cpp") from err
        self.llm = Llama(model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                         verbose=False)
        self.threads = threads

    def generate(self, ids: torch.Tensor, n: int, eos_ids: frozenset[int]) -> tuple[list[int], float]:
        """Greedy tokens after the prompt ids (without EOS) and the seconds from the prompt's
        evaluation to the last token, as our wall time counts them."""
        self.llm.reset()
        out: list[int] = []
        t = time.perf_counter()
        for token in self.llm.generate(ids.tolist(), top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            if token in eos_ids:
                break
            out.append(int(token))
            if len(out) >= n:
                break
        return out, time.perf_counter() - t
