"""The hand-written one-to-four-row product kernel (selfspec.native.gemv): right values, and each row's
result independent of the other rows and of the thread count, which exact mode relies on."""

import pytest
import torch

from selfspec.native import gemv
from selfspec.api import SelfSpecModel
from tiny_models import tiny_model

pytestmark = pytest.mark.skipif(not gemv.available(), reason="no g++ or no AVX2/FMA: the lean step uses PyTorch's kernels")


def _reference(x, w, bias=None, scale=None):
    y = x.float() @ w.float().t()
    if scale is not None:
        y = y * scale.float()
    return y if bias is None else y + bias.float()


@pytest.mark.parametrize("out_features, in_features", [(48, 64), (37, 100), (5, 31)])  # K % 32 and % 64 tails, N % 16 tails
@pytest.mark.parametrize("weights", ["bfloat16", "int8", "float32"])
def test_values_match_a_float32_product(out_features, in_features, weights, path):
    g = torch.Generator().manual_seed(0)
    dtype = torch.float32 if weights == "float32" else torch.bfloat16
    x = torch.randn(4, in_features, generator=g).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype)
    scale = None
    if weights == "int8":
        w = torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int8)
        scale = (torch.rand(out_features, generator=g) / 100).bfloat16()
    else:
        w = torch.randn(out_features, in_features, generator=g).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for rows in (1, 2, 3, 4):
        got = gemv.linear(x[:rows], w, bias, scale)
        assert got.dtype == dtype and got.shape == (rows, out_features)
        want = _reference(x[:rows], w, bias, scale)
        torch.testing.assert_close(got.float(), want, atol=tolerance * want.abs().max().item(), rtol=tolerance)
        padded = gemv.linear(x[:rows], w, bias, scale, rows_out=4)  # exact mode's bucket: copies of the last row
        assert torch.equal(padded[:rows], got) and torch.equal(padded[rows:], got[-1:].expand(4 - rows, -1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_row_is_the_same_whatever_the_rows_and_threads_beside_it(dtype, path):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 576, generator=g).to(dtype)
    x = torch.randn(gemv.MAX_ROWS, 576, generator=g).to(dtype)
    together = gemv.linear(x, w)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for r in range(0, gemv.MAX_ROWS - 1, 3):
                assert torch.equal(gemv.linear(x[r:r + 1], w)[0], together[r])
                assert torch.equal(gemv.linear(x[r:r + 2], w)[0], together[r])
    finally:
        torch.set_num_threads(threads)


def test_more_rows_than_the_kernel_takes_are_refused():
    with pytest.raises(ValueError, match="takes 1..16 rows"):
        gemv.linear(torch.zeros(gemv.MAX_ROWS + 1, 32, dtype=torch.bfloat16), torch.zeros(16, 32, dtype=torch.bfloat16))


def test_the_lean_step_uses_it_in_bfloat16_eager_and_agrees_with_pytorchs_products(monkeypatch):
    """bfloat16 and float32: on (compiled code calls it as a custom op), and the logits stay within
    rounding of PyTorch's kernels."""
    ids = torch.arange(3, 15)
    logits = {}
    lib = gemv._STATE["lib"]
    for use in (False, True):  # ends with the kernel in place
        monkeypatch.setitem(gemv._STATE, "lib", lib if use else None)
        model = SelfSpecModel(tiny_model("llama", dtype=torch.bfloat16))
        assert model.adapter.step.shape.gemv is use
        a = model.adapter
        with torch.inference_mode():
            cache = a.new_cache(32)
            a.run_layers(a.embed(ids), range(a.n_layers), 0, cache)
            logits[use] = a.head(a.run_layers(a.embed(torch.tensor([7])), range(a.n_layers), len(ids), cache))
    torch.testing.assert_close(logits[True], logits[False], atol=0.1, rtol=0.05)
    assert SelfSpecModel(tiny_model("llama")).adapter.step.shape.gemv  # float32
    compiled = SelfSpecModel(tiny_model("llama", dtype=torch.bfloat16), compile=True).adapter.step.shape
    assert compiled.gemv and compiled.compiled


def test_a_failed_build_falls_back_to_pytorch_with_a_note(tmp_path, monkeypatch, capsys):
    for source in gemv.KERNELS.iterdir():
        (tmp_path / source.name).write_bytes(source.read_bytes())
    broken = tmp_path / "gemv.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gemv, "SOURCE", broken)
    assert gemv._build() is None
    assert "could not build the one-row product kernel" in capsys.readouterr().err
    assert not list((tmp_path / "cache" / "kernels").rglob("*.so"))  # nothing half-built left behind
    monkeypatch.setenv("SELFSPEC_GEMV", "0")
    assert gemv._build() is None


def test_weight_prefetch_changes_no_result(monkeypatch):
    """The build's weight prefetch (on Intel CPUs, $SELFSPEC_PREFETCH elsewhere) moves no bit: the
    same products with it off and far ahead, every row count and both weight dtypes, and the
    variable picks what the build compiles in. Every path has it (AVX2 as well as the pairs), so
    this runs on every CPU the kernel builds on."""
    monkeypatch.setenv("SELFSPEC_PREFETCH", "0")
    assert gemv._prefetch() == 0
    torch.manual_seed(0)
    w = torch.randn(200, 320).to(torch.bfloat16)
    q = torch.randint(-127, 128, (200, 320), dtype=torch.int8)
    scale = torch.rand(200).to(torch.bfloat16)
    x = torch.randn(16, 320).to(torch.bfloat16)
    results = []
    for ahead in ("0", "64", "1024"):
        monkeypatch.setenv("SELFSPEC_PREFETCH", ahead)
        assert gemv._prefetch() == int(ahead)
        monkeypatch.setitem(gemv._STATE, "lib", gemv._build())
        results.append([gemv.linear(x[:n], w) for n in (1, 3, 16)] + [gemv.linear(x[:4], q, scale=scale),
                                                                       gemv.linear(x[:5].float(), w.float())])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def _int8_case(rows, out_features, in_features, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    w = torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    scale = (torch.rand(out_features, generator=g) / 100).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    return x, w, scale, bias


def test_int8_rows_are_the_same_whatever_the_rows_and_threads_beside_it(path):
    x, w, scale, _ = _int8_case(gemv.MAX_ROWS, 200, 576, 2)
    together = gemv.linear(x, w, scale=scale)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for r in range(0, gemv.MAX_ROWS - 1, 3):
                assert torch.equal(gemv.linear(x[r:r + 1], w, scale=scale)[0], together[r])
                assert torch.equal(gemv.linear(x[r:r + 2], w, scale=scale)[0], together[r])
                # five to eight rows: one pass over W on the pairs path, two of four elsewhere
                assert torch.equal(gemv.linear(x[r:r + 7], w, scale=scale)[:2], together[r:r + 2])
    finally:
        torch.set_num_threads(threads)


def _integer_reference(x, w, scale, bias):
    """What the integer products compute, in exact integer and IEEE steps (kernels/product.h,
    rows_vnni): each row of x as int16 at s = max|x| / 16383 (rounded to nearest even), the int64
    sum of products, times s and the weight scale in double, then float32, + bias, bfloat16."""
    xf = x.float()
    s = xf.abs().amax(dim=1, keepdim=True) / 16383  # float32 division, as the kernel's
    q = torch.where(s > 0, torch.round(xf / s), torch.zeros_like(xf)).long()
    y = ((q @ w.long().t()).double() * s.double() * scale.double()).float() + bias.float()
    return y.bfloat16()


@pytest.fixture
def vnni(monkeypatch):
    if not gemv.vnni("avx512"):
        pytest.skip("this CPU has no AVX512-VNNI (or AVX-512 BW): int8 weights take the float products")
    monkeypatch.setenv("SELFSPEC_GEMV", "avx512")
    monkeypatch.setitem(gemv._STATE, "lib", gemv._build())


@pytest.mark.parametrize("out_features, in_features", [(48, 64), (37, 100), (5, 31), (70, 1536)])
def test_int8_integer_products_are_the_integer_reference_bit_for_bit(out_features, in_features, vnni):
    """On the avx512 path with VNNI: exact integer sums, so the kernel's bits are a formula's,
    the same on every CPU that runs it, for any rows, K tail and thread count."""
    x, w, scale, bias = _int8_case(gemv.MAX_ROWS, out_features, in_features, 3)
    x[1] = 0  # a row of zeros: its outputs are the bias
    got = gemv.linear(x, w, bias, scale)
    want = _integer_reference(x, w, scale, bias)
    assert torch.equal(got, want)
    assert torch.equal(got[1], bias)
    x[2, in_features // 2] = float("nan")  # a NaN stays in its row, as the float products keep it
    got = gemv.linear(x[:4], w, bias, scale)
    assert got[2].isnan().all() and torch.equal(got[[0, 1, 3]], want[[0, 1, 3]])


def test_int8_on_avx512_without_vnni_still_matches(monkeypatch):
    """SELFSPEC_VNNI=0 (and AVX-512 CPUs without VNNI) keep the 16-lane float FMAs for int8."""
    if "avx512f" not in gemv._cpu_flags():
        pytest.skip("this CPU has no AVX-512")
    monkeypatch.setenv("SELFSPEC_GEMV", "avx512")
    monkeypatch.setenv("SELFSPEC_VNNI", "0")
    assert not gemv.vnni("avx512")
    monkeypatch.setitem(gemv._STATE, "lib", gemv._build())
    x, w, scale, bias = _int8_case(4, 37, 100, 4)
    got = gemv.linear(x, w, bias, scale)
    want = _reference(x, w, bias, scale)
    torch.testing.assert_close(got.float(), want, atol=1e-2 * want.abs().max().item(), rtol=1e-2)
    assert not torch.equal(got, _integer_reference(x, w, scale, bias))  # the float products, not the integer ones
    for r in range(4):
        assert torch.equal(gemv.linear(x[r:r + 1], w, bias, scale)[0], got[r])
