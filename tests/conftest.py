import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import tiny_model  # noqa: E402

import selfspec  # noqa: E402


@pytest.fixture(scope="session")
def smollm2():
    """The bundled default model, loaded once per test run (converted once per machine)."""
    return selfspec.load("smollm2", progress=False)


@pytest.fixture(scope="session")
def gemma3():
    return selfspec.load("gemma3", progress=False)


@pytest.fixture
def tiny():
    def make(arch: str = "llama", seed: int = 0):
        return selfspec.SelfSpecModel(tiny_model(arch, seed), name=f"tiny-{arch}")

    return make
