"""Reductions: forward vs NumPy, backward vs finite differences, ties, dtypes, errors."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl import ops, Tensor
from minidl.testing import check_op
from minidl.testing.strategies import shapes, distinct_arrays

REDUCE = {
    "sum": (ops.reduce_sum, ops.ReduceSum, np.sum),
    "mean": (ops.reduce_mean, ops.ReduceMean, np.mean),
    "max": (ops.reduce_max, ops.ReduceMax, np.max),
    "min": (ops.reduce_min, ops.ReduceMin, np.min),
}


@st.composite
def axis_specs(draw, ndim):
    """An axis argument as users write it: None, (), an int or a tuple, negatives included."""
    kind = draw(st.sampled_from(["none", "empty", "int", "tuple"]))
    if kind == "none":
        return None
    if kind == "empty":
        return ()
    axes = draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True))
    axes = [a - ndim if draw(st.booleans()) else a for a in axes]
    return axes[0] if kind == "int" else tuple(axes)


@st.composite
def reduce_cases(draw):
    shape = draw(shapes(max_dims=3, max_side=4))
    x = draw(distinct_arrays(shape))  # distinct values: max/min have a derivative everywhere
    return x, draw(axis_specs(len(shape))), draw(st.booleans()), draw(st.booleans())


@pytest.mark.parametrize("name", sorted(REDUCE))
@given(case=reduce_cases())
def test_reduce_matches_numpy_and_finite_differences(name, case):
    fn, cls, ref = REDUCE[name]
    x, axis, keep, use_primitive = case
    np_axis = None if axis in (None, ()) else axis  # numpy reads () as "no axis"
    op = (lambda t: cls(keep_dims=keep)(t, axis)) if use_primitive else (lambda t: fn(t, axis, keep))
    check_op(op, [x], reference=lambda a: ref(a, axis=np_axis, keepdims=keep))


@pytest.mark.parametrize("name", sorted(REDUCE))
def test_default_axis_reduces_everything(name):
    fn, cls, ref = REDUCE[name]
    x = np.arange(6.0).reshape(2, 3)
    for y in (fn(Tensor(x)), cls()(Tensor(x))):
        assert y.shape == ()
        np.testing.assert_allclose(y.asnumpy(), ref(x))


@pytest.mark.parametrize("name", sorted(REDUCE))
def test_zero_dim_input(name):
    fn, _, _ = REDUCE[name]
    x = Tensor(np.array(2.5), requires_grad=True)
    for axis in ((), 0, None):
        y = fn(x, axis)
        # an array (of x's module), not a NumPy scalar
        assert y.shape == () and isinstance(y.data, type(x.data)) and y.item() == 2.5
    y.backward()
    np.testing.assert_array_equal(x.grad.asnumpy(), 1.0)


def test_max_ties_split_the_gradient_evenly():
    x = Tensor(np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0], [0.0, 5.0, 1.0]]), requires_grad=True)
    y = ops.reduce_max(x, 1)
    y.backward(Tensor(np.array([6.0, 3.0, 1.0])))
    np.testing.assert_allclose(x.grad.asnumpy(), [[0, 3, 3], [1, 1, 1], [0, 1, 0]])


def test_min_ties_split_the_gradient_evenly_over_several_axes():
    x = Tensor(np.array([[[0.0, 4.0], [0.0, 1.0]], [[2.0, 0.0], [3.0, 0.0]]]), requires_grad=True)
    y = ops.ReduceMin(keep_dims=True)(x, (0, -1))  # reduces dims 0 and 2: shape (1, 2, 1)
    assert y.shape == (1, 2, 1)
    y.backward(Tensor(np.array([[[6.0], [4.0]]])))
    expected = np.array([[[3.0, 0.0], [2.0, 0.0]], [[0.0, 3.0], [0.0, 2.0]]])
    np.testing.assert_allclose(x.grad.asnumpy(), expected)


def test_full_max_with_ties_keeps_the_total_gradient():
    x = Tensor(np.array([7.0, 1.0, 7.0, 7.0]), requires_grad=True)
    ops.amax(x).backward()
    np.testing.assert_allclose(x.grad.asnumpy(), [1 / 3, 0, 1 / 3, 1 / 3])


@pytest.mark.parametrize("name", sorted(REDUCE))
def test_float32_stays_float32_in_forward_and_backward(name):
    fn, _, _ = REDUCE[name]
    x = Tensor(np.array([[1.0, 2.0], [3.0, 5.0]], dtype=np.float32), requires_grad=True)
    y = fn(x, 0)
    assert y.dtype == np.float32
    y.backward(Tensor(np.ones(2, dtype=np.float32)))
    assert x.grad.dtype == np.float32


def test_integer_inputs_keep_their_dtype():
    x = Tensor(np.array([[1, 2], [3, 6]], dtype=np.int32))
    assert ops.reduce_sum(x, 1).dtype == np.int32
    np.testing.assert_array_equal(ops.reduce_sum(x, 1).asnumpy(), [3, 9])
    mean = ops.reduce_mean(x, 0)
    assert mean.dtype == np.int32
    np.testing.assert_array_equal(mean.asnumpy(), [2, 4])
    assert ops.reduce_max(x).dtype == np.int32


def test_sum_backward_broadcasts_without_copying():
    x = Tensor(np.ones((3, 4)), requires_grad=True)
    y = ops.ReduceSum()(x, 1)
    gy = np.array([1.0, 2.0, 3.0])
    (gx,) = y._node.backward(gy)
    assert gx.shape == (3, 4) and np.shares_memory(gx, gy)
    np.testing.assert_array_equal(gx, np.repeat(gy[:, None], 4, axis=1))


def test_gradients_accumulate_over_several_reductions_of_one_tensor():
    x = Tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    loss = ops.reduce_sum(x) + ops.reduce_sum(ops.reduce_mean(x, 0)) + ops.reduce_sum(x, (0, 1))
    loss.backward()
    np.testing.assert_allclose(x.grad.asnumpy(), np.full((2, 3), 2.5))


def test_tensor_methods_and_mindspore_aliases():
    a = np.array([[1.0, -2.0, 4.0], [0.5, 3.0, -1.0]])
    x = Tensor(a)
    np.testing.assert_allclose(x.sum(1, True).asnumpy(), a.sum(1, keepdims=True))
    np.testing.assert_allclose(x.max().asnumpy(), 4.0)
    np.testing.assert_allclose(x.mean(axis=0).asnumpy(), a.mean(0))
    np.testing.assert_allclose(ops.sum(x, dim=1, keepdim=True).asnumpy(), a.sum(1, keepdims=True))
    np.testing.assert_allclose(ops.mean(x, axis=-1, keep_dims=False).asnumpy(), a.mean(-1))
    np.testing.assert_allclose(ops.amax(x, axis=0, keepdims=True).asnumpy(), a.max(0, keepdims=True))
    np.testing.assert_allclose(ops.amin(x, 1).asnumpy(), a.min(1))
    assert ops.sum(x).shape == ()


def test_shard_takes_one_strategy_for_the_tensor_input():
    op = ops.ReduceSum(keep_dims=True).shard(((2, 1),))
    assert op.in_strategy == ((2, 1),)
    with pytest.raises(ValueError, match="ReduceSum takes 1 tensor input"):
        ops.ReduceSum().shard(((2, 1), (1,)))


@pytest.mark.parametrize("axis", [2, -3, (0, 5)])
def test_axis_out_of_range(axis):
    with pytest.raises(ValueError, match=r"ReduceMean: axis -?\d is out of range for a tensor of rank 2"):
        ops.reduce_mean(Tensor(np.ones((2, 3))), axis)


def test_repeated_axis():
    with pytest.raises(ValueError, match=r"ReduceSum: repeated axis in \(1, -1\)"):
        ops.reduce_sum(Tensor(np.ones((2, 3))), (1, -1))


def test_keep_dims_must_be_bool():
    with pytest.raises(TypeError, match="ReduceMax: keep_dims must be a bool, got 1"):
        ops.ReduceMax(1)


def test_max_of_an_empty_axis():
    with pytest.raises(ValueError, match=r"ReduceMin: cannot reduce a tensor of shape \(2, 0\) with a zero-size axis"):
        ops.reduce_min(Tensor(np.ones((2, 0))), 1)
    assert ops.reduce_max(Tensor(np.ones((0, 3))), 1).shape == (0,)


def test_arity_and_input_type():
    with pytest.raises(TypeError, match="ReduceSum: expected 1 to 2 input"):
        ops.ReduceSum()(Tensor(np.ones(2)), 0, 1)
    with pytest.raises(TypeError, match="ReduceSum: x must be a Tensor, got list"):
        ops.reduce_sum([1.0, 2.0])


# ---- Argmax / Argmin --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["argmax", "argmin"])
@given(data=st.data())
def test_arg_extremes_match_numpy(name, data):
    shape = data.draw(shapes(max_dims=3, max_side=4))
    x = data.draw(distinct_arrays(shape))
    x = np.round(x)  # ties: the first index wins, as numpy
    axis = data.draw(st.sampled_from([None] + list(range(-len(shape), len(shape)))))
    keep = data.draw(st.booleans())
    fn, ref = (ops.argmax, np.argmax) if name == "argmax" else (ops.argmin, np.argmin)
    y = fn(Tensor(x), axis, keep)
    want = ref(x, axis=axis, keepdims=keep and axis is not None)
    assert y.dtype == (np.int64 if name == "argmax" else np.int32)  # as MindSpore 2.10's functions
    assert not y.requires_grad
    np.testing.assert_array_equal(y.asnumpy(), want)


def test_arg_extremes_ties_nan_and_dtypes():
    x = Tensor(np.array([[1.0, 3.0, 3.0], [5.0, 0.0, 5.0]], np.float32), requires_grad=True)
    np.testing.assert_array_equal(ops.Argmax()(x).asnumpy(), [1, 0])           # the first maximum
    np.testing.assert_array_equal(ops.Argmin(axis=0)(x).asnumpy(), [0, 1, 0])
    assert ops.Argmax()(x).dtype == np.int32 and ops.Argmin(0, np.int64)(x).dtype == np.int64
    assert ops.argmax(x).shape == () and ops.argmax(x).item() == 3                # the flattened index
    assert ops.argmax(x, None, True).shape == ()                                   # MindSpore: keepdim ignored
    assert ops.argmin(x, axis=1, keepdims=True).shape == (2, 1)
    assert ops.argmax(Tensor(np.array([1.0, np.nan, 3.0]))).item() == 1            # NaN is the maximum
    assert ops.argmax(Tensor(np.array(2.5)), 0).item() == 0                        # a 0-d tensor: index 0
    assert ops.argmax(Tensor(np.array([False, True]))).item() == 1


def test_tensor_argmax_argmin_take_both_spellings():
    t = Tensor(np.array([[1.0, 3.0], [4.0, 0.0]], np.float32))
    assert t.argmax().item() == 2 and t.argmin().item() == 3
    np.testing.assert_array_equal(t.argmax(1).asnumpy(), [1, 0])
    assert t.argmax(axis=1, keepdims=True).shape == (2, 1) and t.argmax(dim=1, keepdim=True).shape == (2, 1)
    assert t.argmin(dim=0).dtype == np.int32


def test_arg_extreme_errors():
    x = Tensor(np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"Argmax: axis 2 is out of range for a tensor of rank 2 \(expected -2 <= axis < 2\)"):
        ops.argmax(x, 2)
    with pytest.raises(TypeError, match=r"Argmin: axis must be an int, got tuple \(0, 1\)"):
        ops.argmin(x, (0, 1))
    with pytest.raises(ValueError, match="Argmax: output_type must be int32 or int64, got <class 'numpy.float32'>"):
        ops.Argmax(0, np.float32)
    with pytest.raises(ValueError, match=r"Argmin: axis 0 of x \(shape \(0, 3\)\) has size 0: there is no minimum"):
        ops.Argmin(0)(Tensor(np.ones((0, 3))))


# ---- CumSum -----------------------------------------------------------------------------------

def _cumsum_ref(x, axis, exclusive, reverse):
    x = np.flip(x, axis) if reverse else x
    y = np.cumsum(x, axis=axis)
    if exclusive:
        y = y - x
    return np.flip(y, axis) if reverse else y


@given(data=st.data(), exclusive=st.booleans(), reverse=st.booleans())
def test_cumsum_matches_numpy_and_finite_differences(data, exclusive, reverse):
    shape = data.draw(shapes(max_dims=3, max_side=4))
    x = data.draw(distinct_arrays(shape))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    check_op(lambda t: ops.CumSum(exclusive, reverse)(t, axis), [x],
             reference=lambda a: _cumsum_ref(a, axis, exclusive, reverse))


def test_cumsum_function_dtype_and_integers():
    c = Tensor(np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32), requires_grad=True)
    y = ops.cumsum(c, 1)
    np.testing.assert_array_equal(y.asnumpy(), [[1, 3, 6], [4, 9, 15]])
    z = ops.cumsum(c, 0, np.float64)
    assert z.dtype == np.float64
    z.backward(Tensor(np.ones((2, 3))))
    assert c.grad.dtype == np.float32
    np.testing.assert_array_equal(c.grad.asnumpy(), [[2, 2, 2], [1, 1, 1]])  # reverse cumsum of ones
    small = ops.cumsum(Tensor(np.array([100, 100], np.int8)), 0)
    assert small.dtype == np.int8  # kept, as MindSpore (NumPy would give int64)
    np.testing.assert_array_equal(c.cumsum().asnumpy(), np.cumsum([1, 2, 3, 4, 5, 6]))  # axis None: flattened


def test_cumsum_errors():
    with pytest.raises(ValueError, match="CumSum: axis 2 is out of range for a tensor of rank 2"):
        ops.cumsum(Tensor(np.ones((2, 3))), 2)
    with pytest.raises(TypeError, match="CumSum: axis must be an int, got NoneType None"):
        ops.cumsum(Tensor(np.ones(2)), None)
    with pytest.raises(TypeError, match="CumSum: x must be a number tensor, got dtype bool"):
        ops.cumsum(Tensor(np.array([True, False])), 0)
    with pytest.raises(ValueError, match="CumSum: x must have rank >= 1, got a 0-d tensor"):
        ops.cumsum(Tensor(np.array(1.0)), 0)
    with pytest.raises(TypeError, match="CumSum: exclusive must be a bool, got 1"):
        ops.CumSum(exclusive=1)
