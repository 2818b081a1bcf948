"""Select / where, Clamp / clamp, clip_by_value and clip_by_global_norm: forward vs NumPy, gradients
vs finite differences, the conventions at the bounds, dtypes, errors."""
import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

from minidl import ops, Tensor
from minidl.testing import check_op
from minidl.testing.strategies import shapes, distinct_arrays


@st.composite
def three_broadcasting(draw):
    """Shapes of condition, input and other that broadcast together, and their arrays."""
    # Mutually broadcastable: two shapes each broadcastable with a third need not be with each other
    # ((3, 1) and (2,) both go with (1, 1)).
    s = draw(hnp.mutually_broadcastable_shapes(num_shapes=3, min_dims=0, max_dims=3, max_side=4)).input_shapes
    cond = draw(hnp.arrays(np.bool_, s[0]))
    return cond, draw(distinct_arrays(s[1])), draw(distinct_arrays(s[2]))


# ---- Select / where ---------------------------------------------------------------------------

@given(case=three_broadcasting(), primitive=st.booleans())
def test_where_broadcasts_and_sends_the_gradient_through_the_mask(case, primitive):
    cond, x, y = case
    fn = (lambda c, a, b: ops.Select()(c, a, b)) if primitive else ops.where
    check_op(fn, [cond, x, y], reference=np.where)


def test_where_takes_python_scalars_and_promotes_like_the_binary_ops():
    c = Tensor(np.array([True, False]))
    f32, i32 = Tensor(np.array([1.5, 2.0], np.float32)), Tensor(np.array([1, 2], np.int32))
    cases = [((f32, 2.5), np.float32, [1.5, 2.5]), ((i32, 2.5), np.float32, [1.0, 2.5]),
             ((1.0, 2.5), np.float32, [1.0, 2.5]), ((i32, f32), np.float32, [1.0, 2.0]),
             ((f32, Tensor(np.array([3.0, 4.0]))), np.float64, [1.5, 4.0]), ((i32, 7), np.int32, [1, 7])]
    for (a, b), dtype, want in cases:  # as MindSpore 2.10's ops.where gives them
        y = ops.where(c, a, b)
        assert y.dtype == dtype, (a, b, y.dtype)
        np.testing.assert_array_equal(y.asnumpy(), want)


def test_where_gradients_keep_each_inputs_dtype_and_shape():
    c = Tensor(np.array([[True], [False]]))
    x = Tensor(np.array([1.0, 2.0, 3.0], np.float32), requires_grad=True)
    y = Tensor(np.array(5.0), requires_grad=True)  # 0-d float64: the result stays float32
    out = ops.where(c, x, y)
    assert out.dtype == np.float32 and out.shape == (2, 3)
    out.sum().backward()
    assert x.grad.dtype == np.float32 and y.grad.dtype == np.float64
    np.testing.assert_array_equal(x.grad.asnumpy(), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(y.grad.asnumpy(), 3.0)


def test_where_errors():
    x = Tensor(np.ones(2))
    with pytest.raises(TypeError, match="Select: condition must be a bool Tensor, got dtype int64"):
        ops.where(Tensor(np.array([1, 0])), x, x)
    with pytest.raises(TypeError, match="Select: condition must be a bool Tensor, got bool"):
        ops.where(True, x, x)
    with pytest.raises(TypeError, match="Select: other must be a Tensor or a number, got NoneType"):
        ops.where(Tensor(np.array([True, False])), x, None)
    with pytest.raises(ValueError, match=r"Select: input of shape \(2,\) cannot be broadcast with shape \(3,\)"):
        ops.where(Tensor(np.array([True, False, True])), x, x)


# ---- Clamp / clamp / clip ----------------------------------------------------------------------

@given(data=st.data())
def test_clamp_matches_numpy_and_finite_differences(data):
    shape = data.draw(shapes(max_dims=3, max_side=4))
    x = data.draw(distinct_arrays(shape, gap=1e-2))
    lo = data.draw(st.sampled_from([None, -1.005, 0.5]))
    hi = data.draw(st.sampled_from([None, 1.005, 2.5] if lo is not None else [1.005, 2.5]))
    check_op(lambda t: ops.clamp(t, lo, hi), [x], reference=lambda a: np.clip(a, lo, hi))


@given(data=st.data())
def test_clamp_with_tensor_bounds(data):
    shape = data.draw(shapes(max_dims=2, max_side=4))
    x = data.draw(distinct_arrays(shape, gap=1e-2))
    lo = data.draw(distinct_arrays(shape[-1:], -2.0, -0.02, gap=1e-2)) + 0.0031  # no value ties with x
    hi = data.draw(distinct_arrays((1,) * len(shape), 0.02, 2.0, gap=1e-2)) + 0.0037
    check_op(lambda a, b, c: ops.Clamp()(a, b, c), [x, lo, hi], reference=np.clip)


def test_clamp_gives_x_the_gradient_on_the_closed_interval():
    x = Tensor(np.array([-1.0, 0.0, 0.5, 1.0, 2.0], np.float32), requires_grad=True)
    y = x.clamp(0.0, 1.0)
    assert y.dtype == np.float32
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.asnumpy(), [0, 1, 1, 1, 0])  # as ops.clamp in MindSpore, torch.clamp
    x.grad = None
    x.clip(1.0, 0.0).sum().backward()  # min > max: everything is max
    np.testing.assert_array_equal(x.grad.asnumpy(), [0, 0, 0, 0, 0])
    np.testing.assert_array_equal(x.clip(1.0, 0.0).asnumpy(), [0, 0, 0, 0, 0])
    np.testing.assert_array_equal(x.clamp(max=0.0).asnumpy(), [-1, 0, 0, 0, 0])


@pytest.mark.cpu_only
def test_clamp_matches_torch_including_the_bounds():
    torch = pytest.importorskip("torch", reason="the cross-check needs PyTorch: pip install -e '.[bench]'")
    xs = np.array([-1.0, 0.0, 0.5, 1.0, 2.0, 1.5])
    los, his = np.array([0.0, 0.0, 0.2, 0.0, 0.0, 2.0]), np.array([1.0, 1.0, 0.4, 1.0, 1.5, 1.0])  # last: min > max
    tx, tlo, thi = (torch.tensor(a, requires_grad=True) for a in (xs, los, his))
    torch.clamp(tx, tlo, thi).sum().backward()
    x, lo, hi = (Tensor(a, requires_grad=True) for a in (xs, los, his))
    out = ops.clamp(x, lo, hi)
    out.sum().backward()
    np.testing.assert_array_equal(out.asnumpy(), torch.clamp(tx, tlo, thi).detach().numpy())
    for mine, theirs in ((x, tx), (lo, tlo), (hi, thi)):
        np.testing.assert_array_equal(mine.grad.asnumpy(), theirs.grad.numpy())


def test_clamp_keeps_an_integer_dtype_and_checks_its_arguments():
    y = ops.clamp(Tensor(np.array([-2, 0, 3], np.int32)), 0.5, 1.5)
    assert y.dtype == np.int32  # MindSpore keeps x's dtype; PyTorch would give float32
    np.testing.assert_array_equal(y.asnumpy(), [0, 0, 1])
    with pytest.raises(ValueError, match="Clamp: min and max cannot both be None"):
        ops.clamp(Tensor(np.ones(2)))
    with pytest.raises(TypeError, match="Clamp: min must be a number, a Tensor or None, got str 'a'"):
        ops.clamp(Tensor(np.ones(2)), "a")
    with pytest.raises(ValueError, match=r"Clamp: the bounds must broadcast to x's shape \(2,\), but together they "
                                         r"give \(3, 2\)"):
        ops.clamp(Tensor(np.ones(2)), Tensor(np.zeros((3, 1))))


# ---- clip_by_value: MindSpore's composite -------------------------------------------------------

@given(data=st.data())
def test_clip_by_value_matches_numpy_and_finite_differences(data):
    shape = data.draw(shapes(max_dims=3, max_side=4))
    x = data.draw(distinct_arrays(shape, gap=1e-2))
    lo, hi = data.draw(st.sampled_from([(-1.005, 1.005), (None, 0.5), (0.5, None)]))
    check_op(lambda t: ops.clip_by_value(t, lo, hi), [x], reference=lambda a: np.clip(a, lo, hi))


def test_clip_by_value_splits_the_gradient_at_the_bounds_as_mindspore():
    x = Tensor(np.array([-1.0, 0.0, 0.5, 1.0, 2.0], np.float32), requires_grad=True)
    lo = Tensor(np.zeros(5, np.float32), requires_grad=True)
    hi = Tensor(np.ones(5, np.float32), requires_grad=True)
    ops.clip_by_value(x, lo, hi).sum().backward()
    # MindSpore 2.10 gives exactly these (its clip_by_value is Minimum(Maximum(x, min), max)).
    np.testing.assert_array_equal(x.grad.asnumpy(), [0, 0.5, 1, 0.5, 0])
    np.testing.assert_array_equal(lo.grad.asnumpy(), [1, 0.5, 0, 0, 0])
    np.testing.assert_array_equal(hi.grad.asnumpy(), [0, 0, 0, 0.5, 1])


def test_clip_by_value_on_a_list_ints_and_errors():
    a, b = Tensor(np.array([-1.0, 2.0], np.float32)), Tensor(np.array([[0.5], [3.0]], np.float32))
    out = ops.clip_by_value([a, b], 0.0, 1.0)
    assert isinstance(out, tuple) and len(out) == 2
    np.testing.assert_array_equal(out[0].asnumpy(), [0, 1])
    np.testing.assert_array_equal(out[1].asnumpy(), [[0.5], [1.0]])
    np.testing.assert_array_equal(ops.clip_by_value(a, 1.0, 0.0).asnumpy(), [0, 0])  # min > max: max
    ints = ops.clip_by_value(Tensor(np.array([-2, 0, 3], np.int32)), 0.5, 1.5)
    assert ints.dtype == np.int32
    np.testing.assert_array_equal(ints.asnumpy(), [0, 0, 1])
    with pytest.raises(ValueError, match="clip_by_value: clip_value_min and clip_value_max cannot both be None"):
        ops.clip_by_value(a)
    with pytest.raises(TypeError, match="clip_by_value: clip_value_max must be a number, a Tensor or None, got str"):
        ops.clip_by_value(a, 0.0, "1")
    with pytest.raises(TypeError, match="clip_by_value: x must be a Tensor or a tuple / list of them, got ndarray"):
        ops.clip_by_value(np.ones(2), 0.0, 1.0)


# ---- clip_by_global_norm ----------------------------------------------------------------------

def _global_norm_ref(clip_norm):
    def ref(*xs):
        g = np.sqrt(sum(np.sum(x * x) for x in xs))
        return np.concatenate([(x * clip_norm / max(g, clip_norm)).ravel() for x in xs])
    return ref


@given(data=st.data(), clip_norm=st.sampled_from([0.5, 2.0, 50.0]))
def test_clip_by_global_norm_matches_the_formula_and_finite_differences(data, clip_norm):
    xs = [data.draw(distinct_arrays(data.draw(shapes(max_dims=2, max_side=3)))) for _ in range(2)]

    def fn(*ts):
        return ops.concat([ops.reshape(t, (-1,)) for t in ops.clip_by_global_norm(ts, clip_norm)])
    check_op(fn, xs, reference=_global_norm_ref(clip_norm))


def test_clip_by_global_norm_mindspore_example_and_dtypes():
    x1 = Tensor(np.array([[2.0, 3.0], [1.0, 2.0]], np.float32))
    x2 = Tensor(np.array([[1.0, 4.0], [3.0, 1.0]], np.float32))
    out = ops.clip_by_global_norm((x1, x2), 1.0)
    assert isinstance(out, tuple) and all(t.dtype == np.float32 for t in out)
    np.testing.assert_allclose(out[0].asnumpy(), [[0.298142403, 0.447213590], [0.149071202, 0.298142403]], rtol=1e-6)
    np.testing.assert_allclose(out[1].asnumpy(), [[0.149071202, 0.596284807], [0.447213590, 0.149071202]], rtol=1e-6)
    small = ops.clip_by_global_norm([Tensor(np.array([0.3, 0.4]))], 1.0)  # norm 0.5 <= 1: unchanged
    assert small[0].dtype == np.float64
    np.testing.assert_allclose(small[0].asnumpy(), [0.3, 0.4])
    ints = ops.clip_by_global_norm((Tensor(np.array([30, 40], np.int32)),), 10)
    assert ints[0].dtype == np.int32
    np.testing.assert_array_equal(ints[0].asnumpy(), [6, 8])


def test_clip_by_global_norm_errors():
    t = (Tensor(np.ones(2)),)
    with pytest.raises(ValueError, match="clip_by_global_norm: clip_norm must be > 0, got 0"):
        ops.clip_by_global_norm(t, 0)
    with pytest.raises(TypeError, match="clip_by_global_norm: clip_norm must be a number, got str 'a'"):
        ops.clip_by_global_norm(t, "a")
    with pytest.raises(ValueError, match="clip_by_global_norm: use_norm must be None"):
        ops.clip_by_global_norm(t, 1.0, 2.0)
    with pytest.raises(TypeError, match="clip_by_global_norm: x must be a non-empty tuple or list of Tensors"):
        ops.clip_by_global_norm(Tensor(np.ones(2)), 1.0)
