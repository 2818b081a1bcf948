"""Shape ops: forward vs NumPy, backward vs finite differences, errors."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import ops, Tensor
from minidl.testing import check_op
from minidl.testing.strategies import shapes, arrays

small = shapes(max_dims=3, max_side=4)


# ---- Reshape, Transpose, ExpandDims, Squeeze, Flatten ---------------------------------------

@given(data=st.data())
def test_reshape(data):
    shape = data.draw(small)
    x = data.draw(arrays(shape))
    target = list(data.draw(st.permutations(shape)))
    for _ in range(data.draw(st.integers(0, 2))):
        target.insert(data.draw(st.integers(0, len(target))), 1)
    if data.draw(st.booleans()):
        target[data.draw(st.integers(0, len(target) - 1))] = -1
    target = tuple(target)
    check_op(lambda t: ops.reshape(t, target), [x], reference=lambda a: a.reshape(target))
    check_op(lambda t: ops.Reshape()(t, list(target)), [x], reference=lambda a: a.reshape(target),
             check_float32=False)


def test_tensor_reshape_view_and_flatten_methods():
    x = Tensor(np.arange(24.0).reshape(2, 3, 4))
    assert x.reshape(4, 6).shape == (4, 6)
    assert x.view((-1, 2)).shape == (12, 2)
    assert x.flatten().shape == (2, 12)
    assert x.transpose().shape == (4, 3, 2)


@given(data=st.data())
def test_transpose(data):
    shape = data.draw(small)
    x = data.draw(arrays(shape))
    perm = data.draw(st.permutations(range(len(shape))))
    perm = tuple(p - len(shape) if data.draw(st.booleans()) else p for p in perm)  # negatives allowed
    positive = tuple(p % len(shape) for p in perm)
    fn = data.draw(st.sampled_from([ops.transpose, ops.permute, lambda t, p: ops.Transpose()(t, p)]))
    check_op(lambda t: fn(t, perm), [x], reference=lambda a: a.transpose(positive))


@given(data=st.data())
def test_expand_dims(data):
    shape = data.draw(shapes(min_dims=0, max_dims=3, max_side=4))
    x = data.draw(arrays(shape))
    axis = data.draw(st.integers(-len(shape) - 1, len(shape)))
    check_op(lambda t: ops.expand_dims(t, axis), [x], reference=lambda a: np.expand_dims(a, axis))


@given(data=st.data())
def test_squeeze(data):
    shape = data.draw(shapes(max_dims=4, min_side=1, max_side=3))
    x = data.draw(arrays(shape))
    ones = [i for i, n in enumerate(shape) if n == 1]
    if ones and data.draw(st.booleans()):
        axes = data.draw(st.lists(st.sampled_from(ones), min_size=1, unique=True))
        axes = tuple(a - len(shape) if data.draw(st.booleans()) else a for a in axes)
        axis = axes[0] if len(axes) == 1 else axes
    else:
        axis = ()
    check_op(lambda t: ops.Squeeze(axis)(t), [x],
             reference=lambda a: np.squeeze(a, axis=None if axis == () else axis))


@given(data=st.data())
def test_flatten(data):
    shape = data.draw(shapes(min_dims=1, max_dims=4, max_side=3))
    x = data.draw(arrays(shape))
    check_op(ops.flatten, [x], reference=lambda a: a.reshape(a.shape[0], -1))


def test_reshape_errors():
    x = Tensor(np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"Reshape: cannot reshape a tensor of shape \(2, 3\) \(6 elements\) "
                                         r"into shape \(4, 2\) \(8 elements\)"):
        ops.reshape(x, (4, 2))
    with pytest.raises(ValueError, match=r"Reshape: .* into shape \(4, -1\): 6 is not a multiple of 4"):
        ops.reshape(x, (4, -1))
    with pytest.raises(ValueError, match=r"Reshape: at most one -1 is allowed in shape, got \(-1, -1\)"):
        ops.reshape(x, (-1, -1))
    with pytest.raises(ValueError, match=r"Reshape: shape entries must be >= 0 or -1, got \(-2, -3\)"):
        ops.reshape(x, (-2, -3))
    with pytest.raises(TypeError, match=r"Reshape: every entry of shape must be an int, got 2.0"):
        ops.reshape(x, (2.0, 3))
    with pytest.raises(ValueError, match=r"Reshape: .*-1 is ambiguous next to a 0"):
        ops.reshape(Tensor(np.ones((0, 3))), (0, -1))


def test_transpose_errors():
    x = Tensor(np.ones((2, 3, 4)))
    for perm in [(0, 1), (0, 1, 1), (0, 1, 3), (0, -1, 2)]:
        with pytest.raises(ValueError, match=r"Transpose: perm .* is not a permutation of range\(3\) "
                                             r"for a tensor of shape \(2, 3, 4\)"):
            ops.transpose(x, perm)


def test_expand_dims_and_squeeze_errors():
    x = Tensor(np.ones((2, 1)))
    with pytest.raises(ValueError, match=r"ExpandDims: axis 3 is out of range for a tensor of rank 2 "
                                         r"\(expected -3 <= axis <= 2\)"):
        ops.expand_dims(x, 3)
    with pytest.raises(TypeError, match="ExpandDims: axis must be an int, got"):
        ops.expand_dims(x, (0,))
    with pytest.raises(ValueError, match=r"Squeeze: cannot squeeze axis 0 of a tensor of shape \(2, 1\): "
                                         r"its size is 2, not 1"):
        ops.squeeze(x, 0)
    with pytest.raises(ValueError, match="Squeeze: axis 2 is out of range for a tensor of rank 2"):
        ops.squeeze(x, 2)
    with pytest.raises(ValueError, match="Flatten: x must have at least 1 dimension"):
        ops.flatten(Tensor(np.array(1.0)))


# ---- Concat, stack ----------------------------------------------------------------------------

@st.composite
def concat_cases(draw):
    shape = list(draw(small))
    nd = len(shape)
    axis = draw(st.integers(-nd, nd - 1))
    sizes = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3))
    sizes[0] = max(sizes[0], 1)
    xs = []
    for n in sizes:
        shape[axis] = n
        xs.append(draw(arrays(tuple(shape))))
    return xs, axis


@given(case=concat_cases(), primitive=st.booleans())
def test_concat(case, primitive):
    xs, axis = case
    fn = (lambda *ts: ops.Concat(axis)(ts)) if primitive else (lambda *ts: ops.concat(list(ts), axis))
    check_op(fn, xs, reference=lambda *a: np.concatenate(a, axis=axis))


def test_concat_gradients_go_only_where_needed():
    a = Tensor(np.ones((2, 2)), requires_grad=True)
    b = Tensor(np.ones((1, 2)))
    y = ops.cat((a, b))
    y.backward(Tensor(np.arange(6.0).reshape(3, 2)))
    np.testing.assert_array_equal(a.grad.asnumpy(), [[0, 1], [2, 3]])
    assert b.grad is None


@given(data=st.data())
def test_stack(data):
    shape = data.draw(shapes(min_dims=0, max_dims=2, max_side=3))
    n = data.draw(st.integers(1, 3))
    xs = [data.draw(arrays(shape)) for _ in range(n)]
    axis = data.draw(st.integers(-len(shape) - 1, len(shape)))
    check_op(lambda *ts: ops.stack(ts, axis), xs, reference=lambda *a: np.stack(a, axis=axis))


def test_concat_errors():
    a = Tensor(np.ones((2, 3)))
    with pytest.raises(ValueError, match="Concat: needs at least one tensor, got an empty tuple"):
        ops.concat(())
    with pytest.raises(ValueError, match=r"Concat: input 1 has rank 1 but input 0 has rank 2 "
                                         r"\(shapes \(3,\) and \(2, 3\)\)"):
        ops.concat((a, Tensor(np.ones(3))))
    with pytest.raises(TypeError, match="Concat: input 1 has dtype float32 but input 0 has dtype float64"):
        ops.concat((a, Tensor(np.ones((2, 3), dtype=np.float32))))
    with pytest.raises(ValueError, match=r"Concat: input 1 of shape \(2, 4\) and input 0 of shape \(2, 3\) "
                                         r"differ in dimension 1 \(4 vs 3\); only axis 0 may differ"):
        ops.concat((a, Tensor(np.ones((2, 4)))))
    with pytest.raises(ValueError, match="Concat: cannot concatenate 0-d tensors"):
        ops.concat((Tensor(np.array(1.0)), Tensor(np.array(2.0))))
    with pytest.raises(ValueError, match="Concat: axis 2 is out of range for a tensor of rank 2"):
        ops.concat((a, a), axis=2)
    with pytest.raises(TypeError, match="Concat: input 1 must be a Tensor, got float"):
        ops.concat((a, 1.0))
    with pytest.raises(TypeError, match="Concat: axis must be an int"):
        ops.Concat(axis=0.5)


def test_stack_errors():
    with pytest.raises(ValueError, match=r"stack: all tensors must have the same shape; input 1 has shape \(3,\), "
                                         r"input 0 has shape \(2,\)"):
        ops.stack((Tensor(np.ones(2)), Tensor(np.ones(3))))
    with pytest.raises(ValueError, match="stack: expected a non-empty tuple or list of tensors"):
        ops.stack([])
    with pytest.raises(ValueError, match=r"stack: axis 2 is out of range for tensors of rank 1 "
                                         r"\(expected -2 <= axis <= 1\)"):
        ops.stack((Tensor(np.ones(2)), Tensor(np.ones(2))), 2)


# ---- StridedSlice -----------------------------------------------------------------------------

@given(data=st.data())
def test_cast_float64_roundtrip_and_gradient(data):
    x = data.draw(arrays(data.draw(small)))
    # the float32 path would (rightly) give float64 here, so it is not checked
    check_op(lambda t: ops.cast(t, minidl.float64), [x], reference=lambda a: a, check_float32=False)


def test_cast_gradient_comes_back_in_the_input_dtype():
    x = Tensor(np.array([1.5, -2.0]), requires_grad=True)
    y = ops.cast(x, minidl.float32)
    assert y.dtype == np.float32
    (y * y).sum().backward()
    assert x.grad.dtype == np.float64
    np.testing.assert_allclose(x.grad.asnumpy(), [3.0, -4.0])
    assert x.astype("float16").dtype == np.float16


def test_cast_to_or_from_integers_stops_the_gradient():
    x = Tensor(np.array([1.7, -2.2]), requires_grad=True)
    i = ops.cast(x, minidl.int32)
    np.testing.assert_array_equal(i.asnumpy(), [1, -2])
    f = ops.cast(i, minidl.float64)
    loss = (f * x).sum()
    loss.backward()
    np.testing.assert_allclose(x.grad.asnumpy(), [1.0, -2.0])  # only through the direct path


def test_cast_errors():
    x = Tensor(np.ones(2))
    with pytest.raises(TypeError, match="Cast: dtype must be a dtype such as minidl.float32, got 'floaty'"):
        ops.cast(x, "floaty")
    with pytest.raises(TypeError, match="Cast: dtype must be a dtype such as minidl.float32, got None"):
        ops.cast(x, None)


def _one_hot_ref(indices, depth, on, off, axis):
    hot = (indices[..., None] == np.arange(depth)).astype(np.float64)
    out = np.where(hot > 0, on, off)
    return np.moveaxis(out, -1, axis if axis != -1 else out.ndim - 1)


@given(data=st.data())
def test_one_hot(data):
    shape = data.draw(shapes(min_dims=0, max_dims=2, max_side=3))
    depth = data.draw(st.integers(1, 4))
    indices = np.array(data.draw(st.lists(st.integers(-1, depth), min_size=int(np.prod(shape)),
                                          max_size=int(np.prod(shape)))), dtype=np.int64).reshape(shape)
    axis = data.draw(st.integers(-1, len(shape)))
    on_off = [np.array(data.draw(st.floats(-3, 3))), np.array(data.draw(st.floats(-3, 3)))]
    check_op(lambda on, off: ops.one_hot(Tensor(indices), depth, on, off, axis), on_off,
             reference=lambda on, off: _one_hot_ref(indices, depth, on, off, axis))


def test_one_hot_defaults_dtypes_and_out_of_range_rows():
    y = ops.one_hot(Tensor(np.array([0, 2, 3, -1])), 3)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y.asnumpy(), [[1, 0, 0], [0, 0, 1], [0, 0, 0], [0, 0, 0]])
    on = Tensor(np.array(5.0))
    y = ops.OneHot(axis=0)(Tensor(np.array([1, 0])), 2, on, Tensor(np.array(-1.0)))
    assert y.dtype == np.float64
    np.testing.assert_array_equal(y.asnumpy(), [[-1, 5], [5, -1]])
    assert ops.one_hot(Tensor(np.array([1])), Tensor(np.array(2)), 1, 0).dtype == np.float32
    wide = ops.one_hot(Tensor(np.array([200], dtype=np.uint8)), 300).asnumpy()  # depth beyond uint8
    assert wide.sum() == 1 and wide[0, 200] == 1


def test_one_hot_errors():
    idx = Tensor(np.array([0, 1]))
    with pytest.raises(TypeError, match="OneHot: indices must be an integer tensor, got dtype float64"):
        ops.one_hot(Tensor(np.array([0.0])), 2)
    with pytest.raises(ValueError, match="OneHot: depth must be >= 0, got -2"):
        ops.one_hot(idx, -2)
    with pytest.raises(TypeError, match="OneHot: depth must be an int, got 2.5"):
        ops.one_hot(idx, 2.5)
    with pytest.raises(ValueError, match=r"OneHot: axis 2 is out of range for indices of rank 1 "
                                         r"\(expected -1 <= axis <= 1\)"):
        ops.one_hot(idx, 3, axis=2)
    with pytest.raises(ValueError, match=r"OneHot: on_value must be a scalar, got shape \(2,\)"):
        ops.one_hot(idx, 3, Tensor(np.ones(2)))
    with pytest.raises(TypeError, match=r"OneHot: on_value \(float32\) and off_value \(float64\) must have "
                                        r"the same dtype"):
        ops.one_hot(idx, 3, Tensor(np.float32(1)), Tensor(np.array(0.0)))
    with pytest.raises(TypeError, match="OneHot: off_value must be a Tensor or a Python number, got 'x'"):
        ops.one_hot(idx, 3, 1.0, "x")


@pytest.mark.parametrize("fn, value", [(ops.zeros_like, 0), (ops.ones_like, 1)])
def test_zeros_like_and_ones_like(fn, value):
    x = Tensor(np.array([[1.5, 2.0]], dtype=np.float32), requires_grad=True)
    y = fn(x)
    assert y.shape == (1, 2) and y.dtype == np.float32
    np.testing.assert_array_equal(y.asnumpy(), np.full((1, 2), value))
    (y * 3.0 + x).sum().backward()  # no gradient flows through the constant
    np.testing.assert_array_equal(x.grad.asnumpy(), [[1.0, 1.0]])
