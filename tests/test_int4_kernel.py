"""The 4-bit few-row product kernel (selfspec.native.gemv.int4_linear, kernels/quant4.h): the
values of its Python reference (x quantized to int8 in blocks of 32, exact integer dot products
with the nibbles, one float scale a block), near the float32 product of the dequantized weights,
each row's result the same
whatever the rows and threads beside it (exact mode and greedy identity rely on it), and a wrong
call refused with a RuntimeError."""

import pytest
import torch

from selfspec.model.quantize import Int4Linear, dequantize_blocks, from_groups, int4_linear, pack_scales, to_groups
from selfspec.native import gemv

pytestmark = pytest.mark.skipif(not gemv.available(), reason="no g++ or no AVX2/FMA: int4 keeps PyTorch's kernel")


def reference(x: torch.Tensor, q: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """quant4.h's arithmetic in float64: each block of 32 of a row of x as int8, xq = round(x / dx)
    (dx = the block's max |x| / 127, rounded as the kernel rounds: x · (127 / max)), times the
    dequantized block, times dx."""
    rows, k = x.shape
    xb = x.float().view(rows, k // 32, 32)
    amax = xb.abs().amax(-1)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inverse[..., None]).double()
    dx = (amax / 127.0).double()
    w = dequantize_blocks(q, sz).double().view(q.shape[0], k // 32, 32)
    return torch.einsum("rbe,nbe,rb->rn", xq, w, dx)


def _blocks(out_features, in_features, seed=0):
    """Random 4-bit blocks (any output size: the kernel's tails), as an Int4Linear."""
    g = torch.Generator().manual_seed(seed)
    blocks, groups = in_features // 32, -(-in_features // 512)
    q = torch.randint(0, 256, (out_features, blocks, 16), generator=g, dtype=torch.uint8)
    scale_codes = torch.randint(0, 256, (out_features, blocks), generator=g, dtype=torch.uint8)
    min_codes = torch.randint(0, 256, (out_features, blocks), generator=g, dtype=torch.uint8)
    steps = torch.rand(2, out_features, groups, generator=g) * torch.tensor([0.01 / 128, 0.16 / 255])[:, None, None]
    base = -torch.rand(out_features, groups, generator=g) * 0.08
    return Int4Linear(q, pack_scales(scale_codes, min_codes, steps[0], steps[1], base), None), g


# N % 16 and % 4 tails; K of 2, 3, 5 and 12 blocks (a last chunk of 4 blocks partly filled, or full)
@pytest.mark.parametrize("out_features, in_features", [(48, 64), (20, 96), (36, 160), (16, 1536)])
def test_values_match_the_reference_and_the_float32_product(out_features, in_features, path):
    linear, g = _blocks(out_features, in_features)
    q, sz = linear.packed, linear.scales_zeros
    w = dequantize_blocks(q, sz)
    w32 = gemv.int4_dequantize(q, sz)
    # q · scale is exact in float32 (a 4-bit integer times an 8-bit code times a bfloat16), so the
    # kernel's FMAs (the minimum's, the weight's) and the reference's products-then-sums round alike;
    # bfloat16 is that float32 rounded once.
    assert torch.equal(w32, w)
    assert torch.equal(gemv.int4_dequantize(q, sz, torch.bfloat16), w32.bfloat16())
    x = torch.randn(gemv.MAX_ROWS, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    for rows in (1, 2, 3, 4, 5, 8, 9, 16):
        got = gemv.int4_linear(x[:rows], q, sz, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        want = reference(x[:rows], q, sz) + bias.double()
        # the kernel's float32 sums in its order, then bfloat16: within a bfloat16 step of the output
        torch.testing.assert_close(got.double(), want, atol=4e-3 * want.abs().max().item(), rtol=8e-3)
        exact = x[:rows].float() @ w.t() + bias.float()  # x as int8 moves a product by ~1% at most
        torch.testing.assert_close(got.float(), exact, atol=3e-2 * exact.abs().max().item(), rtol=3e-2)
        padded = gemv.int4_linear(x[:rows], q, sz, bias, rows_out=gemv.MAX_ROWS)  # exact mode's bucket
        assert torch.equal(padded[:rows], got) and torch.equal(padded[rows:], got[-1:].expand(16 - rows, -1))


# K of 18 blocks (a group of 16 and one of 2), and of 83 (five groups and a tail of 3: eight rows
# take it in tiles of three groups, one row in one tile)
@pytest.mark.parametrize("in_features", [576, 2656])
def test_each_row_is_the_same_whatever_the_rows_and_threads_beside_it(in_features, path):
    linear, g = _blocks(200, in_features, seed=1)
    x = torch.randn(gemv.MAX_ROWS, in_features, generator=g).bfloat16()
    together = gemv.int4_linear(x, linear.packed, linear.scales_zeros)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for r in range(gemv.MAX_ROWS):
                assert torch.equal(gemv.int4_linear(x[r:r + 1], linear.packed, linear.scales_zeros)[0], together[r])
            for rows in (2, 3, 4, 7, 8, 9):
                part = gemv.int4_linear(x[:rows], linear.packed, linear.scales_zeros)
                assert torch.equal(part, together[:rows])
    finally:
        torch.set_num_threads(threads)


def test_a_row_holding_an_infinity_gives_nan_and_leaves_the_others_alone(path):
    linear, g = _blocks(32, 160, seed=2)
    x = torch.randn(3, 160, generator=g).bfloat16()
    clean = gemv.int4_linear(x, linear.packed, linear.scales_zeros)
    x[1, 100] = float("inf")
    got = gemv.int4_linear(x, linear.packed, linear.scales_zeros)
    assert torch.isnan(got[1]).all() and torch.equal(got[0], clean[0]) and torch.equal(got[2], clean[2])


def test_the_groups_layout_is_a_permutation_of_each_rows_blocks():
    blocks = torch.randint(0, 256, (3, 83, 16), dtype=torch.uint8)
    packed = to_groups(blocks)
    assert packed.shape == blocks.shape and torch.equal(from_groups(packed), blocks)
    # block 17 (the second group, 16 blocks, lane 1): its bytes 4k..4k+3 are slice k's lane 1
    row = packed[1].reshape(-1)
    for k in range(4):
        assert torch.equal(row[16 * 16 + 64 * k + 4: 16 * 16 + 64 * k + 8], blocks[1, 17, 4 * k: 4 * k + 4])
    # block 81 (the last group, 3 blocks, lane 1): slices of 12 bytes
    for k in range(4):
        assert torch.equal(row[80 * 16 + 12 * k + 4: 80 * 16 + 12 * k + 8], blocks[1, 81, 4 * k: 4 * k + 4])


def test_both_layouts_hold_the_weights_to_the_same_precision():
    w = torch.randn(32, 128) * 0.05
    blocks = Int4Linear.quantize(w, torch.bfloat16, layout="blocks")
    packed = Int4Linear.quantize(w, torch.bfloat16, layout="int4pack")
    assert blocks.layout == "blocks" and packed.layout == "int4pack"
    assert blocks.in_features == packed.in_features == 128 and blocks.out_features == packed.out_features == 32
    assert blocks.weight.dtype == packed.weight.dtype == torch.bfloat16
    # each weight within half its block's step (its range over 15), up to the bfloat16 rounding of
    # the result
    g = w.view(32, 4, 32)
    step = ((g.amax(-1) - g.amin(-1)) / 15)[..., None]
    for layout in (blocks, packed):
        err = (layout.weight.float().view(32, 4, 32) - g).abs()
        assert (err <= 0.5 * step * 1.02 + g.abs() / 256).all()
    rms = [(layout.weight.float() - w).pow(2).mean().sqrt() for layout in (blocks, packed)]
    assert abs(rms[0] / rms[1] - 1) < 0.1, rms
    x = torch.randn(3, 128).bfloat16()
    decode = int4_linear(x, blocks.packed, blocks.scales_zeros)  # the kernel
    prefill = int4_linear(x.repeat(40, 1), blocks.packed, blocks.scales_zeros)[:3]  # 120 rows: a GEMM
    torch.testing.assert_close(decode.float(), prefill.float(), atol=0.02, rtol=0.01)
    exact = x.float() @ w.t()  # both near the unquantized product (4-bit noise over 128 inputs)
    for y in (decode, packed(x)):
        torch.testing.assert_close(y.float(), exact, atol=0.2 * exact.abs().max().item(), rtol=0)


def test_a_wrong_call_is_a_runtime_error():
    linear, _ = _blocks(48, 64)
    ops = gemv._STATE["lib"]
    q, sz, x = linear.packed, linear.scales_zeros, torch.randn(2, 64).bfloat16()
    assert ops.int4_gemv(x, q, sz, None, None).shape == (2, 48)
    wrong = [
        dict(x=torch.randn(2, 96).bfloat16()),                  # inner sizes differ
        dict(x=torch.randn(2, 64)),                             # float32 x
        dict(x=torch.randn(17, 64).bfloat16()),                 # more rows than the kernel takes
        dict(x=torch.randn(2, 128).bfloat16()[:, ::2]),         # not contiguous
        dict(q=q.view(48, 32 * 2 // 2 * 1, 1).expand(48, 32, 1).contiguous()),  # not [out, in / 32, 16]
        dict(q=q.to(torch.int8)),                               # wrong dtype
        dict(sz=sz.float()),                                    # float32 scales
        dict(sz=sz[:24].contiguous()),                          # fewer outputs than q
        dict(bias=torch.randn(47).bfloat16()),                  # wrong bias size
        dict(rows_out=1),                                       # fewer rows out than in
    ]
    for change in wrong:
        args = dict(x=x, q=q, sz=sz, bias=None, rows_out=None) | change
        with pytest.raises(RuntimeError):
            ops.int4_gemv(**args)
    with pytest.raises(RuntimeError):
        ops.int4_dequantize(q, sz[..., :18].contiguous())  # a record cut short
    with pytest.raises(RuntimeError):
        ops.int4_dequantize(q.view(48, 64), sz)
    for args in [(torch.randn(40, 96).bfloat16(), q, sz, None),      # inner sizes differ
                 (torch.randn(40, 64), q, sz, None),                   # float32 x
                 (torch.randn(0, 64).bfloat16(), q, sz, None),         # no rows
                 (torch.randn(40, 64).bfloat16(), q, sz, torch.randn(47).bfloat16())]:  # wrong bias size
        with pytest.raises(RuntimeError):
            ops.int4_rows(*args)
    with pytest.raises(RuntimeError):
        ops.int4_prefill(torch.randn(40, 96).bfloat16(), q, sz, None, 1 << 20)  # inner sizes differ
    with pytest.raises(RuntimeError):
        ops.int4_prefill(torch.randn(40, 64).bfloat16(), q, sz, torch.randn(48), 1 << 20)  # bias dtype differs


# K of 18 and of 83 blocks (as above); 17 to 250 rows: on AVX512-VNNI tiles of 4 outputs x 3 rows
# with 1- and 2-row tails, and spans of rows (66 at 83 blocks); on AVX2, and for 198 outputs (not
# a whole number of tiles), sweeps of sixteen rows in passes
@pytest.mark.parametrize("out_features", [200, 198])
@pytest.mark.parametrize("in_features", [576, 2656])
def test_a_prefill_gives_each_row_its_one_row_result(in_features, out_features, path):
    linear, g = _blocks(out_features, in_features, seed=3)
    q, sz = linear.packed, linear.scales_zeros
    x = torch.randn(250, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    alone = torch.cat([gemv.int4_linear(x[r:r + 1], q, sz, bias) for r in range(250)])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in (17, 23, 64, 100, 250):
                got = gemv.int4_rows(x[:rows], q, sz, bias)
                assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
                assert torch.equal(got, alone[:rows])
    finally:
        torch.set_num_threads(threads)


def test_the_module_routes_short_prefills_to_the_kernel_and_long_ones_to_the_gemm(path, monkeypatch):
    linear, g = _blocks(64, 576, seed=4)
    q, sz = linear.packed, linear.scales_zeros
    limit = gemv.int4_rows_limit()
    x = torch.randn(limit + 1, 576, generator=g).bfloat16()
    alone = torch.cat([int4_linear(x[r:r + 1], q, sz) for r in range(limit + 1)])
    if limit:  # short: the decode step's bits
        assert torch.equal(int4_linear(x[:limit], q, sz), alone[:limit])
        assert torch.equal(int4_linear(x[:gemv.MAX_ROWS + 1], q, sz), alone[:gemv.MAX_ROWS + 1])
    w = gemv.int4_dequantize(q, sz, torch.bfloat16)
    gemm = torch.nn.functional.linear(x, w)
    torch.testing.assert_close(int4_linear(x, q, sz), gemm)  # one row past the limit: the GEMM's own
    monkeypatch.setenv("SELFSPEC_INT4_ROWS", "0")
    assert gemv.int4_rows_limit() == 0
    torch.testing.assert_close(int4_linear(x[:20], q, sz), gemm[:20])
    monkeypatch.setenv("SELFSPEC_INT4_ROWS", "many")
    with pytest.raises(ValueError, match="SELFSPEC_INT4_ROWS"):
        gemv.int4_rows_limit()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_prefill_tile_by_tile_is_the_whole_dequantized_gemm(dtype, path):
    # 100 outputs in tiles of 16 (the smallest; a 4-row tail), 32 or all at once, with and without bias
    linear, g = _blocks(100, 256)
    q, sz = linear.packed, linear.scales_zeros
    x = torch.randn(40, 256, generator=g).to(dtype)
    bias = torch.randn(100, generator=g).to(dtype)
    w = gemv.int4_dequantize(q, sz, dtype)
    for b in (None, bias):
        want = torch.nn.functional.linear(x, w, b)
        for tile_bytes in (1, 32 * 256 * x.element_size(), 1 << 30):
            got = gemv.int4_prefill(x, q, sz, b, tile_bytes)
            assert got.shape == (40, 100) and got.dtype == dtype and got.is_contiguous()
            torch.testing.assert_close(got, want, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    # through the module: more rows than the kernel takes go this way
    long = x.repeat(-(-(gemv.int4_rows_limit() + 1) // 40), 1)[:gemv.int4_rows_limit() + 1]
    torch.testing.assert_close(int4_linear(long.bfloat16(), q, sz).float(),
                               torch.nn.functional.linear(long.bfloat16(), w.bfloat16()).float(), atol=2e-2, rtol=2e-2)


def test_a_prefill_that_wants_a_gradient_gets_one(path):
    linear, g = _blocks(100, 256)
    x = torch.randn(40, 256, generator=g).bfloat16().requires_grad_(True)
    y = int4_linear(x, linear.packed, linear.scales_zeros)
    y.float().sum().backward()  # the tiled op keeps none: this took the dequantized GEMM
    w = gemv.int4_dequantize(linear.packed, linear.scales_zeros).sum(0)
    torch.testing.assert_close(x.grad.float(), w.expand(40, -1), atol=0.05, rtol=0.02)
