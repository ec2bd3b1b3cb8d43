"""Output metadata by rule (``_dispatch/_outputs.py``: pointwise promotion, and the rules' ``outputs``) against the
op itself run on whole CPU tensors: the same shape and dtype wherever the rule answers, and no answer where the op
raises. (Not against meta tracing: its kernels can disagree with the CPU kernels, e.g. ``threshold_backward`` of
float16 and float32 gives float16 on meta and float32 on the CPU, and the parts run the real kernel.) No process group
needed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st_

from sbp_torch._dispatch._outputs import pointwise_outputs

aten = torch.ops.aten

# (op, number of tensor arguments, extra positional arguments)
OPS = [
    (aten.add.Tensor, 2, ()),
    (aten.add.Tensor, 2, ()),
    (aten.add.Scalar, 1, (2.5,)),
    (aten.add.Scalar, 1, (3,)),
    (aten.sub.Tensor, 2, ()),
    (aten.mul.Tensor, 2, ()),
    (aten.mul.Scalar, 1, (True,)),
    (aten.div.Tensor, 2, ()),
    (aten.div.Tensor_mode, 2, ("floor",)),
    (aten.eq.Tensor, 2, ()),
    (aten.lt.Scalar, 1, (0.5,)),
    (aten.where.self, 3, ()),
    (aten.maximum.default, 2, ()),
    (aten.pow.Tensor_Scalar, 1, (2,)),
    (aten.pow.Tensor_Tensor, 2, ()),
    (aten.relu.default, 1, ()),
    (aten.gelu.default, 1, ()),
    (aten.sigmoid.default, 1, ()),
    (aten.exp.default, 1, ()),
    (aten.abs.default, 1, ()),
    (aten.neg.default, 1, ()),
    (aten.sqrt.default, 1, ()),
    (aten.bitwise_and.Tensor, 2, ()),
    (aten.logical_not.default, 1, ()),
    (aten.add_.Tensor, 2, ()),
    (aten.mul_.Scalar, 1, (0.5,)),
    (aten.lerp.Scalar, 2, (0.3,)),
    (aten.addcmul.default, 3, ()),
    (aten.masked_fill.Scalar, 2, (1.0,)),
    (aten.threshold_backward.default, 2, (0.0,)),
    (aten.clamp.default, 1, (0.0, 1.0)),
    (aten.remainder.Scalar, 1, (3,)),
    (aten.isnan.default, 1, ()),
]
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
SHAPE = st_.lists(st_.integers(1, 4), min_size=0, max_size=3).map(tuple)


def _run(func, args):
    try:
        out = func(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    except Exception:  # noqa: BLE001
        return None
    return tuple(out.shape), out.dtype


@settings(max_examples=400, deadline=None)
@given(
    case=st_.sampled_from(OPS),
    shapes=st_.lists(SHAPE, min_size=3, max_size=3),
    dtypes=st_.lists(st_.sampled_from(DTYPES), min_size=3, max_size=3),
)
def test_rule_agrees_with_tracing(case, shapes, dtypes):
    func, n, extra = case
    tensors = [torch.zeros(shape, dtype=dtype) for shape, dtype in zip(shapes[:n], dtypes[:n])]
    if func is aten.where.self or func is aten.masked_fill.Scalar:  # the condition / mask is bool
        index = 0 if func is aten.where.self else 1
        tensors[index] = tensors[index].bool()
    args = tuple(tensors) + tuple(extra)
    ruled, real = pointwise_outputs(func, args, {}), _run(func, args)
    if real is None:
        assert ruled is None, f"{func} {args}: the op raises but the rule answered {ruled}"
    elif ruled is not None:
        assert (ruled[0].shape, ruled[0].dtype) == real, (func, shapes[:n], dtypes[:n])
    else:  # (it may decline what it cannot know, but not the common calls: those would all be traced)
        floats = {t.dtype for t in tensors if t.dtype != torch.bool} <= {torch.float32, torch.float64}
        assert not floats, f"{func} {args}: the rule declined a call on float tensors"


@pytest.mark.parametrize(
    "func,args",
    [
        (aten.bernoulli.p, (torch.zeros(3), 0.5)),  # draws random numbers: running it would move the generator
        (aten.add.out, (torch.zeros(3), torch.zeros(3))),
        (aten.cat.default, ([torch.zeros(3), torch.zeros(3)],)),
        (aten.add_.Tensor, (torch.zeros(3), torch.zeros(2, 3))),  # self would have to grow
    ],
)
def test_rule_declines_what_it_cannot_know(func, args):
    state = torch.get_rng_state()
    assert pointwise_outputs(func, args, {}) is None
    assert torch.equal(torch.get_rng_state(), state)


def test_rule_answers_common_calls_with_torchs_promotion():
    """0-dim tensors promote by category (an int64 vector plus a 0-dim float64 is float64), numbers to the
    default dtype (plus 2.5 is float32), and a float16 vector stays float16 beside a 0-dim float64."""
    ruled = pointwise_outputs(aten.add.Tensor, (torch.zeros(3, 4), torch.zeros(4)), {})
    assert ruled is not None and (ruled[0].shape, ruled[0].dtype) == ((3, 4), torch.float32)
    ruled = pointwise_outputs(
        aten.add.Tensor, (torch.zeros(3, dtype=torch.int64), torch.tensor(1.0, dtype=torch.float64)), {}
    )
    assert ruled is not None and (ruled[0].shape, ruled[0].dtype) == ((3,), torch.float64)
    ruled = pointwise_outputs(aten.add.Scalar, (torch.zeros(3, dtype=torch.int64), 2.5), {})
    assert ruled is not None and (ruled[0].shape, ruled[0].dtype) == ((3,), torch.float32)
    ruled = pointwise_outputs(
        aten.mul.Tensor, (torch.zeros(3, dtype=torch.float16), torch.tensor(2.0, dtype=torch.float64)), {}
    )
    assert ruled is not None and ruled[0].dtype == torch.float16
    ruled = pointwise_outputs(aten.eq.Scalar, (torch.zeros(2, 1, 5), 1), {})
    assert ruled is not None and (ruled[0].shape, ruled[0].dtype) == ((2, 1, 5), torch.bool)


# (op, builder of the arguments from a shape and a dtype); each rule must agree with the op run on CPU tensors
TABLE_CASES = [
    (aten.native_layer_norm.default, lambda s, d: (torch.randn(s, dtype=d), list(s[-1:]), None, None, 1e-5)),
    (aten.native_layer_norm.default, lambda s, d: (torch.randn(s, dtype=d), list(s[-2:]), None, None, 1e-5)),
    (aten.native_layer_norm.default, lambda s, d: (torch.randn(s, dtype=d), [7], None, None, 1e-5)),
    (aten._softmax.default, lambda s, d: (torch.randn(s, dtype=d), -1, False)),
    (aten._log_softmax.default, lambda s, d: (torch.randn(s, dtype=d), 0, False)),
    (aten.sum.dim_IntList, lambda s, d: (torch.randn(s, dtype=d), [-1])),
    (aten.sum.dim_IntList, lambda s, d: (torch.randn(s, dtype=d), [0, -1], True)),
    (aten.sum.dim_IntList, lambda s, d: (torch.randn(s, dtype=d), [])),
    (aten.sum.dim_IntList, lambda s, d: (torch.randn(s, dtype=d), [5])),
    (aten.cat.default, lambda s, d: ([torch.randn(s, dtype=d), torch.randn(s, dtype=d)], -1)),
    (aten.cat.default, lambda s, d: ([torch.randn(s, dtype=d), torch.randn(s[:-1] + (1,), dtype=d)], -1)),
    (aten.cat.default, lambda s, d: ([torch.randn(s, dtype=d), torch.randn((2,) + s, dtype=d)], 0)),
    (aten.mm.default, lambda s, d: (torch.randn(s[:2], dtype=d), torch.randn(s[-1:] + (3,), dtype=d))),
    (
        aten.addmm.default,
        lambda s, d: (
            torch.randn(s[-1:], dtype=d),
            torch.randn((2,) + s[:1], dtype=d),
            torch.randn(s[:1] + s[-1:], dtype=d),
        ),
    ),
    (
        aten.addmm.default,
        lambda s, d: (torch.randn(s, dtype=d), torch.randn((2, 3), dtype=d), torch.randn((3, 4), dtype=d)),
    ),
]


@settings(max_examples=200, deadline=None)
@given(
    case=st_.sampled_from(TABLE_CASES),
    shape=st_.lists(st_.integers(1, 4), min_size=1, max_size=3).map(tuple),
    dtype=st_.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64]),
)
def test_table_rules_agree_with_the_op(case, shape, dtype):
    from sbp_torch._dispatch import BoundCall
    from sbp_torch._dispatch._decide import shown_call
    from sbp_torch._dispatch._outputs import ruled_outputs
    from sbp_torch._signatures import rule_for

    func, build = case
    if dtype is torch.int64:

        def as_long(a):
            if isinstance(a, list):
                return [as_long(t) for t in a]
            return a.long() if isinstance(a, torch.Tensor) else a

        args = tuple(as_long(a) for a in build(shape, torch.float32))
    else:
        args = build(shape, dtype)
    try:
        out = func(*args)
        real = [(tuple(o.shape), o.dtype) for o in (out if isinstance(out, tuple) else (out,))]
    except Exception:  # noqa: BLE001
        real = None
    bound, rule = BoundCall(func, args, {}), rule_for(func)
    ruled = ruled_outputs(bound, shown_call(bound, rule, mesh_shape=(1,)), rule)
    if real is None:
        assert ruled is None, f"{func}: the op raises but the rule answered {ruled}"
    elif ruled is not None:
        assert [(r.shape, r.dtype) for r in ruled] == real, (func, shape, dtype)
    if dtype in (torch.float32, torch.float64) and real is not None:
        assert ruled is not None, f"{func} {shape}: the rule should answer float32 and float64"
