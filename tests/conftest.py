import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import tiny_model  # noqa: E402
from tiny_moe import MOE_ARCHS, tiny_moe_model  # noqa: E402

import selfspec  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def own_profiles(tmp_path_factory):
    """Profiles the user made on this machine (search, tune) must not change what tests see: the
    session, and the CLI subprocesses it starts, read and write profiles in a fresh directory."""
    path = tmp_path_factory.mktemp("profiles")
    before = os.environ.get("SELFSPEC_PROFILES")
    os.environ["SELFSPEC_PROFILES"] = str(path)
    yield path
    if before is None:
        del os.environ["SELFSPEC_PROFILES"]
    else:
        os.environ["SELFSPEC_PROFILES"] = before


@pytest.fixture(scope="session")
def smollm2():
    """The bundled default model, loaded once per test run (converted once per machine)."""
    return selfspec.load("smollm2", dtype="float32", progress=False)


@pytest.fixture(scope="session")
def gemma3():
    return selfspec.load("gemma3", dtype="float32", progress=False)


@pytest.fixture
def tiny():
    def make(arch: str = "llama", seed: int = 0):
        build = tiny_moe_model if arch in MOE_ARCHS else tiny_model  # dense (tiny_models) or MoE (tiny_moe)
        return selfspec.SelfSpecModel(build(arch, seed), name=f"tiny-{arch}")

    return make


@pytest.fixture(autouse=True)
def one_thread_for_tiny_models(request):
    """Tiny models are call-overhead bound: intra-op threads only hand work back and forth (several
    times slower on a loaded 2-core machine). Tests on the real models keep torch's default."""
    if request.node.get_closest_marker("real"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["auto", "pairs", "avx512", "avx2"])
def path(request, monkeypatch):
    """The kernel library (selfspec.native.gemv) this CPU picks, its build without AMX, its AVX-512 build
    without the bfloat16 pairs and its AVX2 build (each the same as the next where the CPU lacks
    AMX, AVX512-BF16 or AVX-512), so every code path of the kernels this CPU can run is tested on it."""
    if request.param != "auto":
        from selfspec.native import gemv

        monkeypatch.setenv("SELFSPEC_GEMV", request.param)
        monkeypatch.setitem(gemv._STATE, "lib", gemv._build())
    return request.param
