"""The native kernels' torch ops (selfspec/native/kernels/ops.cpp) check what they are given: a
wrong shape, dtype, device or layout is a RuntimeError in Python, never a crash or garbage. Each op
is called once right, then with one argument spoiled at a time."""

from __future__ import annotations

import pytest
import torch

from selfspec.native import gemv

pytestmark = pytest.mark.skipif(not gemv.available(), reason="no g++ or no AVX2/FMA: the lean step uses PyTorch's kernels")

H, HEADS, KV, HD, INTER, CAP, VOCAB = 32, 2, 1, 16, 32, 8, 10  # a small layer


@pytest.fixture
def ops():
    return gemv._STATE["lib"]


def _bf(*shape):
    return torch.randn(*shape).bfloat16()


def _refused(op, args: dict, **changes):
    with pytest.raises(RuntimeError):
        op(**{**args, **changes})


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same shape and values as t, not contiguous."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    out = wide[..., ::2]
    assert not out.is_contiguous() and torch.equal(out, t)
    return out


# gemv


def _gemv_args():
    return dict(x=_bf(3, 64), w=_bf(24, 64), bias=_bf(24), scale=None, rows_out=None)


def test_gemv_runs_when_called_right(ops):
    args = _gemv_args()
    y = ops.gemv(**args)
    assert y.shape == (3, 24) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), args["x"].float() @ args["w"].float().T + args["bias"].float(),
                               atol=0.1, rtol=0.05)
    q = torch.randint(-127, 128, (24, 64), dtype=torch.int8)
    assert ops.gemv(args["x"], q, None, _bf(24)).shape == (3, 24)
    assert ops.gemv(args["x"].float(), args["w"].float(), None, None, 5).shape == (5, 24)


@pytest.mark.parametrize("change", [
    dict(x=_bf(3, 48)),                      # inner sizes differ
    dict(x=_bf(64)),                         # 1-D x
    dict(w=_bf(2, 24, 64)),                  # 3-D w
    dict(x=_bf(17, 64)),                     # more rows than the kernel takes
    dict(x=_bf(0, 64)),                      # no rows
    dict(rows_out=2),                        # fewer rows out than in
    dict(rows_out=17),
    dict(bias=_bf(23)),                      # bias of another length
])
def test_gemv_refuses_a_wrong_shape(ops, change):
    _refused(ops.gemv, _gemv_args(), **change)


@pytest.mark.parametrize("change", [
    dict(x=_bf(3, 64).half()),                               # float16 activations
    dict(w=_bf(24, 64).float()),                             # float32 weights, bfloat16 x
    dict(x=torch.randn(3, 64)),                              # float32 x, bfloat16 weights
    dict(bias=torch.randn(24)),                              # the bias's dtype (unchecked under ctypes)
    dict(w=torch.randint(-127, 128, (24, 64), dtype=torch.int8)),  # int8 without its scale
    dict(w=torch.randint(-127, 128, (24, 64), dtype=torch.int8), scale=torch.rand(24)),  # the scale's dtype
    dict(scale=_bf(24)),                                     # a scale for bfloat16 weights
    dict(w=torch.randint(0, 255, (24, 64), dtype=torch.uint8)),
])
def test_gemv_refuses_a_wrong_dtype(ops, change):
    _refused(ops.gemv, _gemv_args(), **change)


@pytest.mark.parametrize("name", ["x", "w", "bias"])
def test_gemv_refuses_a_non_contiguous_tensor(ops, name):
    args = _gemv_args()
    _refused(ops.gemv, args, **{name: _strided(args[name])})
    assert gemv.linear(_strided(args["x"]), args["w"]).shape == (3, 24)  # linear makes x contiguous first


def test_gemv_refuses_another_device(ops):
    _refused(ops.gemv, _gemv_args(), x=torch.empty(3, 64, dtype=torch.bfloat16, device="meta"))


def test_linear_keeps_its_value_error_for_too_many_rows():
    with pytest.raises(ValueError, match="takes 1..16 rows"):
        gemv.linear(_bf(17, 64), _bf(24, 64))


# fused_layer


def _layer_args(dtype=torch.bfloat16):
    qkv = (HEADS + 2 * KV) * HD
    t = lambda *shape: torch.randn(*shape).to(dtype) * 0.1  # noqa: E731
    weights = [t(qkv, H), None, t(H, HEADS * HD), t(2 * INTER, H), t(H, INTER), None, None, None, None,
               1 + t(H), None, 1 + t(H), None, None, None]
    return dict(x=t(2, H), weights=weights, cos=t(CAP, HD), sin=t(CAP, HD), keys=torch.zeros(2, 1, KV, CAP, HD, dtype=dtype),
                values=torch.zeros(2, 1, KV, CAP, HD, dtype=dtype), layer=1, heads=HEADS, act=0, sandwich=False,
                qk_norm=False, eps=1e-6, scale=HD ** -0.5, start=3, window=0, attn=True, mlp=True, siblings=False)


def _with_weight(args, i, tensor):
    weights = list(args["weights"])
    weights[i] = tensor
    return dict(weights=weights)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_layer_runs_when_called_right(ops, dtype):
    args = _layer_args(dtype)
    x = args["x"].clone()
    ops.fused_layer(**args)
    assert not torch.equal(args["x"], x) and torch.isfinite(args["x"].float()).all()
    assert args["keys"][1, 0, 0, 3:5].abs().sum() > 0 and args["keys"][0].abs().sum() == 0  # layer 1's slots 3, 4


def test_fused_layer_refuses_a_wrong_shape(ops):
    args = _layer_args()
    for change in [dict(x=_bf(2, H + 8)),                         # hidden size of another model
                   dict(x=_bf(17, H)),                            # more rows than the kernel takes
                   dict(x=_bf(1, 2, H)),                          # 3-D
                   _with_weight(args, 0, _bf(64, H + 8)),         # wqkv
                   _with_weight(args, 2, _bf(H, HEADS * HD + 16)),  # wo
                   _with_weight(args, 4, _bf(H, INTER + 8)),      # wd against wgu
                   _with_weight(args, 1, _bf(63)),                # bqkv
                   _with_weight(args, 9, _bf(H - 8)),             # norm_in
                   _with_weight(args, 9, None),                   # a required norm missing
                   _with_weight(args, 10, _bf(H)),                # a sandwich norm on a pre-norm layer
                   dict(weights=args["weights"][:14]),            # too few weights
                   dict(heads=3),                                 # heads that do not match wqkv
                   dict(keys=torch.zeros(2, 1, KV, CAP, HD + 16, dtype=torch.bfloat16)),
                   dict(keys=torch.zeros(2, KV, CAP, HD, dtype=torch.bfloat16)),
                   dict(values=torch.zeros(3, 1, KV, CAP, HD, dtype=torch.bfloat16)),
                   dict(layer=2), dict(layer=-1),                 # outside the cache
                   dict(start=CAP - 1),                           # rows past the cache's capacity
                   dict(cos=_bf(4, HD)),                          # too few rotary positions
                   dict(sin=_bf(CAP, HD // 2))]:
        _refused(ops.fused_layer, args, **change)


def test_fused_layer_refuses_a_wrong_dtype(ops):
    args = _layer_args()
    q = torch.randint(-127, 128, (64, H), dtype=torch.int8)
    for change in [dict(x=args["x"].float()),                    # float32 rows, bfloat16 weights
                   dict(x=args["x"].half()),
                   _with_weight(args, 2, args["weights"][2].float()),  # one weight in another dtype
                   _with_weight(args, 9, args["weights"][9].float()),  # a norm
                   _with_weight(args, 0, q),                      # int8 wqkv among bfloat16 weights, no scales
                   dict(keys=args["keys"].float()),
                   dict(cos=args["cos"].float())]:
        _refused(ops.fused_layer, args, **change)


def _int4_layer_args():
    """_layer_args with 4-bit blocks (kernels/quant4.h): each weight [N, K / 32, 16] uint8 and its
    scales and zeros [N, K / 32, 2] bfloat16 in the scales' places."""
    from selfspec.model.quantize import Int4Linear

    args = _layer_args()
    weights = list(args["weights"])
    for i in (0, 2, 3, 4):
        blocks = Int4Linear.quantize(weights[i].float(), torch.bfloat16, layout="blocks")
        weights[i], weights[5 + (0, None, 1, 2, 3)[i]] = blocks.packed, blocks.scales_zeros
    return {**args, "weights": weights}


def test_fused_layer_takes_4_bit_blocks_and_refuses_them_wrong(ops):
    args = _int4_layer_args()
    x = args["x"].clone()
    ops.fused_layer(**args)
    assert not torch.equal(args["x"], x) and torch.isfinite(args["x"].float()).all()
    w = args["weights"]
    for change in [_with_weight(args, 5, None),                            # blocks without their scales
                   _with_weight(args, 6, w[6].float()),                    # float32 scales
                   _with_weight(args, 8, torch.cat([w[8], w[8]], 1)),       # wd's scales for more blocks
                   _with_weight(args, 7, w[7][: w[7].shape[0] // 2].contiguous()),  # scales for fewer rows
                   _with_weight(args, 3, w[3][: w[3].shape[0] // 2].contiguous()),  # wgu of another MLP size
                   _with_weight(args, 0, w[0].view(w[0].shape[0], -1)),     # 2-D blocks
                   _with_weight(args, 2, _bf(H, HEADS * HD))]:              # a bfloat16 weight among blocks
        _refused(ops.fused_layer, args, **change)


def test_fused_layer_refuses_a_non_contiguous_tensor(ops):
    args = _layer_args()
    for change in [dict(x=_strided(args["x"])), _with_weight(args, 0, _strided(args["weights"][0])),
                   _with_weight(args, 11, _strided(args["weights"][11])), dict(keys=_strided(args["keys"])),
                   dict(cos=_strided(args["cos"]))]:
        _refused(ops.fused_layer, args, **change)


# feature_step


def _feature_args(dtype=torch.bfloat16, n=2):
    t = lambda *shape: torch.randn(*shape).to(dtype) * 0.1  # noqa: E731
    weights = [t(3 * HEADS * HD, H), t(H, HEADS * HD), t(INTER, H), t(H, INTER), 1 + t(H), 1 + t(H), 1 + t(H),
               1 + t(H), t(H, 2 * H), 1 + t(H), t(VOCAB, H), None]
    return dict(previous=t(1, n, H), embedded=t(1, n, H), weights=weights, cos=t(CAP, HD), sin=t(CAP, HD),
                keys=torch.zeros(1, 1, HEADS, CAP, HD, dtype=dtype), values=torch.zeros(1, 1, HEADS, CAP, HD, dtype=dtype),
                logits=torch.zeros(1, VOCAB), heads=HEADS, eps=1e-6, scale=HD ** -0.5, final_eps=1e-6, softcap=0.0,
                final_gemma=False, start=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_feature_step_runs_when_called_right(ops, dtype):
    args = _feature_args(dtype)
    h = ops.feature_step(**args)
    assert h.shape == (1, 2, H) and h.dtype == dtype and torch.isfinite(h.float()).all()
    assert args["logits"].abs().sum() > 0
    no_head = _feature_args(dtype)
    no_head["weights"][9:] = [None, None, None]
    assert ops.feature_step(**{**no_head, "logits": None}).shape == (1, 2, H)


def test_feature_step_refuses_a_wrong_shape(ops):
    args = _feature_args()
    for change in [dict(previous=_bf(1, 2, H + 8)), dict(embedded=_bf(1, 3, H)), dict(previous=_bf(2, H)),
                   dict(previous=_bf(1, 17, H), embedded=_bf(1, 17, H)),
                   _with_weight(args, 0, _bf(2 * HEADS * HD, H)),    # qkv
                   _with_weight(args, 8, _bf(H, H)),                 # fc takes both halves
                   _with_weight(args, 10, _bf(VOCAB, H + 8)),        # the draft head
                   _with_weight(args, 11, _bf(VOCAB + 1)),           # its bias
                   _with_weight(args, 9, None),                      # a head without the final norm
                   dict(weights=args["weights"][:9]),
                   dict(logits=torch.zeros(1, VOCAB - 1)), dict(logits=None),
                   dict(keys=torch.zeros(1, 1, HEADS + 1, CAP, HD, dtype=torch.bfloat16)),
                   dict(start=CAP - 1), dict(cos=_bf(3, HD))]:
        _refused(ops.feature_step, args, **change)


def test_feature_step_refuses_a_wrong_dtype(ops):
    args = _feature_args()
    for change in [dict(previous=args["previous"].float()), dict(embedded=args["embedded"].float()),
                   dict(previous=args["previous"].half(), embedded=args["embedded"].half()),
                   _with_weight(args, 3, args["weights"][3].float()), _with_weight(args, 10, args["weights"][10].float()),
                   dict(logits=torch.zeros(1, VOCAB, dtype=torch.bfloat16)), dict(values=args["values"].float())]:
        _refused(ops.feature_step, args, **change)


def test_feature_step_refuses_a_non_contiguous_tensor(ops):
    args = _feature_args()
    for change in [dict(previous=_strided(args["previous"])), _with_weight(args, 8, _strided(args["weights"][8])),
                   dict(keys=_strided(args["keys"])), dict(logits=_strided(args["logits"]))]:
        _refused(ops.feature_step, args, **change)


def test_a_second_cache_directory_in_one_process_reuses_the_loaded_ops(tmp_path):
    """A namespace registers once per process: building again with the cache elsewhere (a test's
    SELFSPEC_CACHE) must reuse the loaded ops, not load a second copy (which aborted the process)."""
    import subprocess
    import sys

    code = ("import os\nfrom selfspec.native import gemv\nfirst = gemv._build()\n"
            f"os.environ['SELFSPEC_CACHE'] = {str(tmp_path)!r}\nsecond = gemv._build()\n"
            "assert (first is None) == (second is None)\nprint('ok')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]
