"""Many-row bfloat16 products through float32 where bfloat16 is emulated (selfspec.model.wide_product)."""

import torch
import torch.nn.functional as F

from selfspec.native import gemv

from selfspec.model import wide_product


def test_a_widened_product_is_the_float32_product_rounded_once(monkeypatch):
    torch.manual_seed(0)
    x, w, b = torch.randn(40, 96).bfloat16(), torch.randn(72, 96).bfloat16(), torch.randn(72).bfloat16()
    monkeypatch.setattr(gemv, "native_bfloat16", lambda: False)
    assert wide_product.widen(x) and not wide_product.widen(x.float())
    assert not wide_product.widen(x[: wide_product.WIDE_ROWS - 1])  # a step's few rows: no weight copy
    y = wide_product.linear(x, w, b)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x.float(), w.float(), b.float()).bfloat16())
    # and close to PyTorch's own bfloat16 product (both accumulate in float32 and round once)
    torch.testing.assert_close(y.float(), F.linear(x, w, b).float(), rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(gemv, "native_bfloat16", lambda: True)
    assert not wide_product.widen(x)
    assert torch.equal(wide_product.linear(x, w, b), F.linear(x, w, b))


def test_auto_dtype_is_bfloat16_where_the_kernel_runs(monkeypatch):
    from selfspec.api import default_dtype

    monkeypatch.setattr(gemv, "native_bfloat16", lambda: False)
    monkeypatch.setattr(gemv, "available", lambda: True)
    assert default_dtype("cpu") == "bfloat16"
    monkeypatch.setattr(gemv, "available", lambda: False)
    assert default_dtype("cpu") == "float32"
    monkeypatch.setattr(gemv, "native_bfloat16", lambda: True)
    assert default_dtype("cpu") == "bfloat16"
