"""Softmax cross-entropy primitives, NLLLoss, cross_entropy, nll_loss and mse_loss: forward vs NumPy,
gradients, errors."""
import warnings

import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl import ops, Tensor
from minidl.testing import check_op, check_backward
from minidl.testing.strategies import arrays, shapes


def np_log_softmax(x, axis):
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def np_cross_entropy(x, t, weight=None, ignore_index=-100, reduction="mean", s=0.0):
    """PyTorch's cross_entropy written out sample by sample (class axis 1, or 0 for 1-D)."""
    if x.ndim == 1:
        x, t = x[None], np.asarray(t)[None]
        squeeze = True
    else:
        squeeze = False
    c = x.shape[1]
    logp = np.moveaxis(np_log_softmax(x, 1), 1, -1).reshape(-1, c)
    w = np.ones(c) if weight is None else weight
    if np.issubdtype(t.dtype, np.floating):
        tp = np.moveaxis(t, 1, -1).reshape(-1, c) * (1 - s) + s / c
        per = -(logp * tp * w).sum(axis=1)
        denominator = len(per)
    else:
        labels = t.reshape(-1)
        per, denominator = np.zeros(len(labels)), 0.0
        for i, y in enumerate(labels):
            if y == ignore_index:
                continue
            per[i] = (1 - s) * w[y] * -logp[i, y] + s / c * -(w * logp[i]).sum()
            denominator += w[y]
    if reduction == "none":
        batch = (x.shape[0],) + x.shape[2:]
        return per.reshape(()) if squeeze else per.reshape(batch)
    return per.sum() if reduction == "sum" else per.sum() / denominator


@st.composite
def logits_and_labels(draw, sparse):
    n, c = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    x = draw(arrays((n, c), -4.0, 4.0))
    if sparse:
        return x, np.array(draw(st.lists(st.integers(0, c - 1), min_size=n, max_size=n)), np.int32)
    return x, draw(arrays((n, c), 0.0, 1.0))  # any nonnegative rows: the gradient stays exact


@given(case=logits_and_labels(sparse=False))
def test_softmax_cross_entropy(case):
    ref = lambda x, t: -(t * np_log_softmax(x, 1)).sum(axis=1)
    check_op(ops.softmax_cross_entropy, list(case), reference=ref)


@given(case=logits_and_labels(sparse=True))
def test_sparse_softmax_cross_entropy(case):
    x, t = case
    ref = lambda x, t: -np_log_softmax(x, 1)[np.arange(len(t)), t]
    check_op(ops.sparse_softmax_cross_entropy, [x, t], reference=ref)


def test_dense_gradient_is_softmax_minus_onehot():
    rng = np.random.default_rng(1)
    x = Tensor(rng.standard_normal((3, 4)), requires_grad=True)
    onehot = np.eye(4)[[2, 0, 3]]
    gy = np.array([1.0, 2.0, -0.5])
    ops.SoftmaxCrossEntropyWithLogits()(x, Tensor(onehot)).backward(Tensor(gy))
    expected = (np.exp(np_log_softmax(x.asnumpy(), 1)) - onehot) * gy[:, None]
    np.testing.assert_allclose(x.grad.asnumpy(), expected, rtol=1e-12)


def test_sparse_matches_dense_with_onehot():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 3)).astype(np.float32)
    labels = np.array([0, 2, 1, 1, 0])
    dense = ops.softmax_cross_entropy(Tensor(x), Tensor(np.eye(3, dtype=np.float32)[labels]))
    sparse = ops.sparse_softmax_cross_entropy(Tensor(x), Tensor(labels))
    assert sparse.dtype == np.float32 and dense.dtype == np.float32
    np.testing.assert_allclose(sparse.asnumpy(), dense.asnumpy(), rtol=1e-6)


def test_large_logits_stay_finite():
    x = Tensor(np.array([[1e4, -1e4, 0.0], [-3e4, -3e4, -3e4]], np.float32), requires_grad=True)
    loss = ops.sparse_softmax_cross_entropy(x, Tensor(np.array([1, 0])))
    np.testing.assert_allclose(loss.asnumpy(), [2e4, np.log(3.0)], rtol=1e-6)
    loss.sum().backward()
    assert np.isfinite(x.grad.asnumpy()).all()


@pytest.mark.parametrize("label", [-1, 3])
def test_sparse_label_out_of_range(label, monkeypatch):
    monkeypatch.setenv("MINIDL_CHECK_LABELS", "1")  # the device-pinned suite checks on the host too
    with pytest.raises(ValueError, match=rf"SparseSoftmaxCrossEntropyWithLogits: label {label} is out of range "
                                         rf"for 3 classes"):
        ops.sparse_softmax_cross_entropy(Tensor(np.zeros((2, 3))), Tensor(np.array([0, label])))


def test_primitive_shape_and_type_errors():
    x = Tensor(np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"SoftmaxCrossEntropyWithLogits: labels of shape \(2, 4\) must match "
                                         r"logits of shape \(2, 3\)"):
        ops.softmax_cross_entropy(x, Tensor(np.zeros((2, 4))))
    with pytest.raises(ValueError, match=r"SoftmaxCrossEntropyWithLogits: logits must be 2-D \(N, C\), "
                                         r"got shape \(3,\)"):
        ops.softmax_cross_entropy(Tensor(np.zeros(3)), Tensor(np.zeros(3)))
    with pytest.raises(TypeError, match=r"SoftmaxCrossEntropyWithLogits: labels must be float probabilities"):
        ops.softmax_cross_entropy(x, Tensor(np.zeros((2, 3), np.int32)))
    with pytest.raises(ValueError, match=r"SparseSoftmaxCrossEntropyWithLogits: labels of shape \(3,\) do not "
                                         r"match logits of shape \(2, 3\): expected labels of shape \(2,\)"):
        ops.sparse_softmax_cross_entropy(x, Tensor(np.zeros(3, np.int32)))
    with pytest.raises(TypeError, match=r"SparseSoftmaxCrossEntropyWithLogits: labels must be integer class "
                                        r"indices, got dtype float32"):
        ops.sparse_softmax_cross_entropy(x, Tensor(np.zeros(2, np.float32)))


@st.composite
def cross_entropy_case(draw):
    """Logits of rank 1 to 3, index or probability targets, and every option."""
    rank = draw(st.integers(1, 3))
    shape = draw(shapes(min_dims=rank, max_dims=rank, max_side=3))
    axis = 0 if rank == 1 else 1
    c = shape[axis]
    x = draw(arrays(shape, -3.0, 3.0))
    batch = shape[:axis] + shape[axis + 1:]
    probabilities = draw(st.booleans())
    ignore_index = draw(st.sampled_from([-100, 0]))
    if probabilities:
        t = draw(arrays(shape, 0.0, 1.0))
    else:
        t = np.array(draw(st.lists(st.integers(0, c - 1), min_size=int(np.prod(batch)),
                                   max_size=int(np.prod(batch)))), np.int64).reshape(batch)
        if ignore_index == 0 and (t != 0).sum() == 0:
            ignore_index = -100  # keep a counted sample: the mean over none is 0/0
    weight = draw(st.one_of(st.none(), arrays((c,), 0.5, 2.0)))
    reduction = draw(st.sampled_from(["mean", "sum", "none"]))
    s = draw(st.sampled_from([0.0, 0.1]))
    return x, t, weight, ignore_index, reduction, s


@given(case=cross_entropy_case())
def test_cross_entropy(case):
    x, t, weight, ignore_index, reduction, s = case
    fn = lambda x: ops.cross_entropy(x, Tensor(t), weight, ignore_index, reduction, s)
    ref = lambda x: np_cross_entropy(x, t, weight, ignore_index, reduction, s)
    check_op(fn, [x], reference=ref)


def test_cross_entropy_fast_path_with_ignored_samples():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3))
    t = np.array([2, -100, 0, 1])
    for reduction in ("mean", "sum", "none"):
        fn = lambda x: ops.cross_entropy(x, Tensor(t), reduction=reduction)
        check_op(fn, [x], reference=lambda x: np_cross_entropy(x, t, reduction=reduction))


def test_cross_entropy_float32():
    x = Tensor(np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32), requires_grad=True)
    loss = ops.cross_entropy(x, Tensor(np.array([0, 3, 1])), weight=np.array([1, 2, 1, 0.5]), label_smoothing=0.2)
    assert loss.dtype == np.float32 and loss.shape == ()
    loss.backward()
    assert x.grad.dtype == np.float32


def test_cross_entropy_errors(monkeypatch):
    monkeypatch.setenv("MINIDL_CHECK_LABELS", "1")  # the device-pinned suite checks on the host too
    x = Tensor(np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"cross_entropy: label 3 is out of range for 3 classes"):
        ops.cross_entropy(x, Tensor(np.array([0, 3])))
    with pytest.raises(ValueError, match=r"cross_entropy: labels of shape \(3,\) do not match logits of shape "
                                         r"\(2, 3\): expected labels of shape \(2,\)"):
        ops.cross_entropy(x, Tensor(np.array([0, 1, 2])))
    with pytest.raises(ValueError, match=r"cross_entropy: probability target of shape \(2, 2\) must match input"):
        ops.cross_entropy(x, Tensor(np.zeros((2, 2))))
    with pytest.raises(ValueError, match=r"cross_entropy: weight of shape \(2,\) must be \(3,\)"):
        ops.cross_entropy(x, Tensor(np.array([0, 1])), weight=np.ones(2))
    with pytest.raises(ValueError, match=r"cross_entropy: reduction must be one of .* got 'avg'"):
        ops.cross_entropy(x, Tensor(np.array([0, 1])), reduction="avg")
    with pytest.raises(ValueError, match=r"cross_entropy: label_smoothing must be in \[0, 1\], got 1.5"):
        ops.cross_entropy(x, Tensor(np.array([0, 1])), label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"cross_entropy: input must have a class dimension"):
        ops.cross_entropy(Tensor(np.array(1.0)), Tensor(np.array(0)))


@given(shape=shapes(max_dims=3, max_side=3), reduction=st.sampled_from(["mean", "sum", "none"]), data=st.data())
def test_mse_loss(shape, reduction, data):
    x, y = data.draw(arrays(shape)), data.draw(arrays(shape))
    reduce = {"mean": np.mean, "sum": np.sum, "none": lambda a: a}[reduction]
    check_op(lambda x, y: ops.mse_loss(x, y, reduction), [x, y], reference=lambda x, y: reduce((x - y) ** 2))


def test_mse_loss_broadcasts_and_checks_reduction():
    x = np.arange(6.0).reshape(2, 3)
    check_backward(lambda x, y: ops.mse_loss(x, y), [x, np.array([1.0, 0.0, 2.0])])
    with pytest.raises(ValueError, match=r"mse_loss: reduction must be one of"):
        ops.mse_loss(Tensor(x), Tensor(x), reduction="max")


def test_device_labels_out_of_range_give_nan_without_a_host_sync(on_the_double):
    """On the GPU the range check would read a device value back every step: by default a bad
    label makes its sample's loss and gradient NaN instead (never a wrapped, silently wrong
    gather), and the other samples stay exact."""
    from minidl.testing import cupy_double
    x = np.random.default_rng(0).standard_normal((3, 4))
    for fn in (lambda t, y: ops.sparse_softmax_cross_entropy(t, y),
               lambda t, y: ops.cross_entropy(t, y, reduction="none"),
               lambda t, y: ops.cross_entropy(t, y, reduction="none", label_smoothing=0.1)):
        good = Tensor(x, requires_grad=True)
        want = fn(good, Tensor(np.array([1, 2, 0])))
        want.sum().backward()
        t = Tensor(x, requires_grad=True)
        with cupy_double.count_host_syncs() as syncs:
            loss = fn(t, Tensor(np.array([1, 7, 0])))  # 7: out of range for 4 classes (CuPy would wrap to 3)
            loss.sum().backward()
        assert syncs.total == 0, syncs.by_reason
        got, g = loss.asnumpy(), t.grad.asnumpy()
        assert np.isnan(got[1]) and np.all(np.isnan(g[1]) | (g[1] == 0)) and np.isnan(g[1]).any()
        np.testing.assert_allclose(got[[0, 2]], want.asnumpy()[[0, 2]], rtol=1e-12)
        np.testing.assert_allclose(g[[0, 2]], good.grad.asnumpy()[[0, 2]], rtol=1e-12)


def test_device_labels_are_checked_on_the_host_when_asked(on_the_double, monkeypatch):
    monkeypatch.setenv("MINIDL_CHECK_LABELS", "1")
    with pytest.raises(ValueError, match="label 7 is out of range for 4 classes"):
        ops.sparse_softmax_cross_entropy(Tensor(np.zeros((2, 4))), Tensor(np.array([0, 7])))


# ---- NLLLoss / nll_loss --------------------------------------------------------------------------

def np_nll(x, t, weight=None, ignore_index=-100, reduction="mean", s=0.0):
    """MindSpore's _nll_loss (= PyTorch's nll_loss, plus label smoothing), sample by sample."""
    batch_shape = np.shape(t)
    if x.ndim == 1:
        x, t = x[None], np.asarray(t)[None]
    c = x.shape[1]
    rows = np.moveaxis(x, 1, -1).reshape(-1, c)
    w = np.ones(c) if weight is None else weight
    per, denominator = np.zeros(len(rows)), 0.0
    for i, y in enumerate(t.reshape(-1)):
        if y == ignore_index:
            continue
        per[i] = (1 - s) * -w[y] * rows[i, y] + s / c * -(w * rows[i]).sum()
        denominator += w[y]
    if reduction == "none":
        return per.reshape(batch_shape)
    return per.sum() if reduction == "sum" else per.sum() / denominator


@st.composite
def nll_cases(draw):
    c = draw(st.integers(1, 4))
    shape = draw(st.sampled_from([(c,), (draw(st.integers(1, 3)), c), (draw(st.integers(1, 3)), c, 2)]))
    x = draw(arrays(shape, -4.0, 0.0))
    batch = () if len(shape) == 1 else (shape[0],) + shape[2:]
    n = int(np.prod(batch))
    t = np.array(draw(st.lists(st.sampled_from(list(range(c)) + [-100]), min_size=n, max_size=n)), np.int64)
    t = t.reshape(batch)
    if not (t != -100).any():  # 'mean' of nothing counted is NaN (tested on its own)
        t = np.zeros(batch, np.int64)
    weight = draw(st.none() | arrays((c,), 0.5, 2.0))
    return x, t, weight


@given(case=nll_cases(), reduction=st.sampled_from(["mean", "sum", "none"]), s=st.sampled_from([0.0, 0.2]))
def test_nll_loss(case, reduction, s):
    x, t, weight = case
    args = [x, t] + ([] if weight is None else [weight])
    check_op(lambda x, t, *w: ops.nll_loss(x, t, *w, reduction=reduction, label_smoothing=s), args,
             reference=lambda x, t, *w: np_nll(x, t, *w, reduction=reduction, s=s), positions=[0])


def test_nll_of_log_softmax_is_cross_entropy():
    rng = np.random.default_rng(0)
    x, t, w = rng.standard_normal((5, 4)), np.array([0, 3, -100, 1, 3]), rng.random(4) + 0.5
    for kw in ({}, {"weight": Tensor(w)}, {"label_smoothing": 0.1}, {"weight": Tensor(w), "reduction": "sum"}):
        want = ops.cross_entropy(Tensor(x), Tensor(t), **kw).asnumpy()
        got = ops.nll_loss(ops.log_softmax(Tensor(x), 1), Tensor(t), **kw).asnumpy()
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_nll_loss_primitive_defaults_and_nothing_counted():
    prim = ops.NLLLoss()
    assert (prim.reduction, prim.ignore_index, prim.label_smoothing) == ("mean", -100, 0.0)
    x = Tensor(np.log(np.full((2, 3), 1 / 3)))
    np.testing.assert_allclose(prim(x, Tensor(np.array([0, 2]))).asnumpy(), np.log(3))
    with np.errstate(invalid="ignore"):
        assert np.isnan(prim(x, Tensor(np.array([-100, -100]))).item())  # 0 / 0, as MindSpore and PyTorch
    assert ops.nll_loss(x, Tensor(np.array([-100, -100])), reduction="sum").item() == 0.0
    y = ops.nll_loss(Tensor(np.array([-1.0, -2.0], np.float32)), Tensor(np.array(1)))
    assert y.shape == () and y.dtype == np.float32 and y.item() == 2.0


@pytest.mark.cpu_only
def test_nll_loss_matches_torch():
    torch = pytest.importorskip("torch", reason="the cross-check needs PyTorch: pip install -e '.[bench]'")
    F = torch.nn.functional
    rng = np.random.default_rng(1)
    x, t, w = rng.standard_normal((4, 3, 5)), rng.integers(0, 3, (4, 5)), rng.random(3) + 0.5
    t[0, :2] = -100
    for weight in (None, w):
        for reduction in ("mean", "sum", "none"):
            xt, tx = Tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
            got = ops.nll_loss(xt, Tensor(t), None if weight is None else Tensor(weight), reduction=reduction)
            want = F.nll_loss(tx, torch.tensor(t), None if weight is None else torch.tensor(weight),
                              reduction=reduction)
            np.testing.assert_allclose(got.asnumpy(), want.detach().numpy(), rtol=1e-12)
            got.sum().backward()
            want.sum().backward()
            np.testing.assert_allclose(xt.grad.asnumpy(), tx.grad.numpy(), rtol=1e-12)


def test_nll_loss_device_targets_out_of_range_give_nan_without_a_host_sync(on_the_double):
    from minidl.testing import cupy_double
    x = np.log(np.random.default_rng(0).dirichlet(np.ones(4), 3))
    t = Tensor(x, requires_grad=True)
    with cupy_double.count_host_syncs() as syncs:
        loss = ops.nll_loss(t, Tensor(np.array([1, 7, -100])), reduction="none")
        loss.sum().backward()
    assert syncs.total == 0, syncs.by_reason
    got, g = loss.asnumpy(), t.grad.asnumpy()
    assert np.isnan(got[1]) and np.isnan(g[1]).all()
    np.testing.assert_allclose(got[[0, 2]], [-x[0, 1], 0.0])
    np.testing.assert_allclose(g[0], [0.0, -1.0, 0.0, 0.0])


def test_nll_loss_errors(monkeypatch):
    monkeypatch.setenv("MINIDL_CHECK_LABELS", "1")  # the device-pinned suite checks on the host too
    x = Tensor(np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"NLLLoss: label 3 is out of range for 3 classes"):
        ops.nll_loss(x, Tensor(np.array([0, 3])))
    with pytest.raises(ValueError, match=r"NLLLoss: labels of shape \(3,\) do not match logits of shape \(2, 3\)"):
        ops.nll_loss(x, Tensor(np.array([0, 1, 2])))
    with pytest.raises(TypeError, match=r"NLLLoss: labels must be integer class indices, got dtype float64"):
        ops.nll_loss(x, Tensor(np.array([0.0, 1.0])))
    with pytest.raises(TypeError, match=r"NLLLoss: labels must be integer class indices, got dtype float64; labels of "
                                        r"the logits' shape look one-hot \(or class probabilities\): pass integer "
                                        r"class indices of shape \(2,\) \(e.g. labels.argmax\(axis=1\)\)"):
        ops.nll_loss(x, Tensor(np.eye(3)[[0, 2]]))
    with pytest.raises(ValueError, match=r"NLLLoss: weight of shape \(2,\) must be \(3,\)"):
        ops.nll_loss(x, Tensor(np.array([0, 1])), Tensor(np.ones(2)))
    with pytest.raises(ValueError, match=r"NLLLoss: reduction must be one of"):
        ops.nll_loss(x, Tensor(np.array([0, 1])), reduction="avg")
    with pytest.raises(ValueError, match=r"NLLLoss: label_smoothing must be in \[0, 1\], got 1.5"):
        ops.NLLLoss(label_smoothing=1.5)
    with pytest.raises(TypeError, match=r"NLLLoss: ignore_index must be an int, got None"):
        ops.NLLLoss(ignore_index=None)
    with pytest.raises(ValueError, match=r"NLLLoss: inputs must have a class dimension"):
        ops.nll_loss(Tensor(np.array(1.0)), Tensor(np.array(0)))


# ---- edge cases: stability, arguments that are not arrays, boundary labels, dtypes ---------------

def test_dense_and_reference_log_softmax_shift_each_row_by_its_own_max():
    """Logits far apart between rows (float32): shifting by anything but each row's max (or adding
    it) overflows or underflows exp. The sparse op's reference body (the one the GPU runs) too."""
    from minidl import kernels
    x = np.array([[1e4, -1e4, 0.0], [-3e4, -3e4, -3e4]], np.float32)
    onehot = np.eye(3, dtype=np.float32)[[1, 0]]
    dense = ops.softmax_cross_entropy(Tensor(x), Tensor(onehot)).asnumpy()
    np.testing.assert_allclose(dense, [2e4, np.log(3.0)], rtol=1e-6)
    with kernels.reference_only():
        sparse = ops.sparse_softmax_cross_entropy(Tensor(x), Tensor(np.array([1, 0]))).asnumpy()
    np.testing.assert_allclose(sparse, [2e4, np.log(3.0)], rtol=1e-6)


def test_inputs_that_are_not_arrays_get_the_ops_own_errors():
    """A Python scalar or list where an array belongs: the op's ValueError/TypeError with the
    shape () or the type it got, never an AttributeError from inside the op."""
    x = Tensor(np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"SoftmaxCrossEntropyWithLogits: logits must be 2-D \(N, C\), "
                                         r"got shape \(\)$"):
        ops.softmax_cross_entropy(1.0, Tensor(np.zeros((2, 3))))
    with pytest.raises(ValueError, match=r"SoftmaxCrossEntropyWithLogits: labels of shape \(\) must match "
                                         r"logits of shape \(2, 3\)"):
        ops.softmax_cross_entropy(x, 1.0)
    with pytest.raises(TypeError, match=r"SparseSoftmaxCrossEntropyWithLogits: labels must be integer class "
                                        r"indices, got list$"):
        ops.sparse_softmax_cross_entropy(x, [0, 1])
    with pytest.raises(ValueError, match=r"cross_entropy: input must have a class dimension, got shape \(\)$"):
        ops.cross_entropy(1.0, Tensor(np.array(0)))
    with pytest.raises(ValueError, match=r"NLLLoss: inputs must have a class dimension, got shape \(\)$"):
        ops.nll_loss(1.0, Tensor(np.array(0)))
    with pytest.raises(ValueError, match=r"NLLLoss: weight of shape \(\) must be \(3,\)"):
        ops.nll_loss(x, Tensor(np.array([0, 1])), 2.0)


def test_labels_whose_dtype_is_not_numpys_are_refused_by_name():
    """An array-like from another library (its dtype has no NumPy ``kind``, as a torch tensor's)."""
    class ForeignLabels:
        dtype, shape, size = "int64", (2, 3), 6

    with pytest.raises(TypeError, match=r"SparseSoftmaxCrossEntropyWithLogits: labels must be integer class "
                                        r"indices, got dtype int64$"):
        ops.sparse_softmax_cross_entropy(Tensor(np.zeros((2, 3))), ForeignLabels())


def test_integer_or_1d_logits_are_refused_naming_what_was_given():
    xi = Tensor(np.zeros((2, 3), np.int64))
    t = Tensor(np.array([0, 1]))
    with pytest.raises(TypeError, match=r"SoftmaxCrossEntropyWithLogits: logits must be a float tensor, "
                                        r"got dtype int64$"):
        ops.softmax_cross_entropy(xi, Tensor(np.zeros((2, 3))))
    with pytest.raises(TypeError, match=r"SparseSoftmaxCrossEntropyWithLogits: logits must be a float tensor, "
                                        r"got dtype int64$"):
        ops.sparse_softmax_cross_entropy(xi, t)
    with pytest.raises(ValueError, match=r"SparseSoftmaxCrossEntropyWithLogits: logits must be 2-D \(N, C\), "
                                         r"got shape \(3,\)"):
        ops.sparse_softmax_cross_entropy(Tensor(np.zeros(3)), Tensor(np.array(0)))
    with pytest.raises(TypeError, match=r"cross_entropy: input must be float logits, got dtype int64$"):
        ops.cross_entropy(xi, t)
    with pytest.raises(TypeError, match=r"NLLLoss: inputs must be float log-probabilities, got dtype int64$"):
        ops.nll_loss(xi, t)


def test_label_smoothing_and_ignore_index_must_be_numbers_not_bools():
    x, t = Tensor(np.zeros((2, 3))), Tensor(np.array([0, 1]))
    with pytest.raises(ValueError, match=r"cross_entropy: label_smoothing must be in \[0, 1\], got True"):
        ops.cross_entropy(x, t, label_smoothing=True)
    for bad in (None, True):
        with pytest.raises(TypeError, match=rf"cross_entropy: ignore_index must be an int, got {bad}"):
            ops.cross_entropy(x, t, ignore_index=bad)
    with pytest.raises(TypeError, match=r"NLLLoss: label_smoothing must be a float, got True"):
        ops.NLLLoss(label_smoothing=True)


def test_label_smoothing_one_is_a_uniform_target():
    """s = 1 is allowed (the interval is closed): the target is 1/C for every class."""
    x = np.random.default_rng(5).standard_normal((3, 4))
    t = np.array([0, 3, 1])
    want = -np_log_softmax(x, 1).mean(axis=1).mean()
    np.testing.assert_allclose(ops.cross_entropy(Tensor(x), Tensor(t), label_smoothing=1.0).item(), want,
                               rtol=1e-12)
    np.testing.assert_allclose(ops.nll_loss(Tensor(np_log_softmax(x, 1)), Tensor(t), label_smoothing=1).item(),
                               want, rtol=1e-12)


def test_unsigned_integer_labels():
    x = np.random.default_rng(6).standard_normal((4, 3))
    t = np.array([0, 2, 1, 2], np.uint8)
    want = -np_log_softmax(x, 1)[np.arange(4), t]
    np.testing.assert_allclose(ops.sparse_softmax_cross_entropy(Tensor(x), Tensor(t)).asnumpy(), want, rtol=1e-12)
    np.testing.assert_allclose(ops.cross_entropy(Tensor(x), Tensor(t), reduction="none").asnumpy(), want,
                               rtol=1e-12)
    np.testing.assert_allclose(ops.nll_loss(Tensor(np_log_softmax(x, 1)), Tensor(t), reduction="none").asnumpy(),
                               want, rtol=1e-12)


def test_the_first_of_several_out_of_range_labels_is_named(monkeypatch):
    monkeypatch.setenv("MINIDL_CHECK_LABELS", "1")  # the device-pinned suite checks on the host too
    with pytest.raises(ValueError, match=r"cross_entropy: label 5 is out of range for 3 classes "
                                         r"\(expected 0 <= label < 3\)"):
        ops.cross_entropy(Tensor(np.zeros((3, 3))), Tensor(np.array([0, 5, -2])))


def test_cross_entropy_one_class_with_an_ignored_sample():
    """With one class every loss is 0; an ignored sample must not be looked up as any other class."""
    x = Tensor(np.array([[0.5], [-1.0], [2.0]]), requires_grad=True)
    loss = ops.cross_entropy(x, Tensor(np.array([0, -100, 0])))
    assert loss.item() == 0.0
    loss.backward()
    np.testing.assert_array_equal(x.grad.asnumpy(), np.zeros((3, 1)))
    assert ops.cross_entropy(Tensor(np.array([[0.5]])), Tensor(np.array([[1.0]]))).item() == 0.0  # one sample


def test_cross_entropy_weight_given_as_a_list():
    x = np.random.default_rng(7).standard_normal((3, 4))
    t = np.array([0, 3, 1])
    w = [1.0, 2.0, 0.5, 1.5]
    got = ops.cross_entropy(Tensor(x), Tensor(t), weight=w).item()
    np.testing.assert_allclose(got, np_cross_entropy(x, t, np.array(w)), rtol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_class_axis_in_the_middle_with_weights_and_smoothing(reduction):
    """(N, C, d) inputs, C != d: the class weights and the smoothing broadcast along axis 1."""
    rng = np.random.default_rng(8)
    x, w = rng.standard_normal((2, 3, 2)), np.array([0.5, 2.0, 1.0])
    t = np.array([[0, 2], [1, -100]])
    p = rng.random((2, 3, 2))
    check_op(lambda x: ops.nll_loss(x, Tensor(t), Tensor(w), reduction=reduction, label_smoothing=0.2), [x],
             reference=lambda x: np_nll(x, t, w, reduction=reduction, s=0.2))
    check_op(lambda x: ops.cross_entropy(x, Tensor(t), w, reduction=reduction), [x],
             reference=lambda x: np_cross_entropy(x, t, w, reduction=reduction))
    check_op(lambda x: ops.cross_entropy(x, Tensor(p), w, reduction=reduction), [x],
             reference=lambda x: np_cross_entropy(x, p, w, reduction=reduction))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_float32_probability_targets(reduction):
    rng = np.random.default_rng(9)
    x, p = rng.standard_normal((3, 4)).astype(np.float32), rng.random((3, 4)).astype(np.float32)
    got = ops.cross_entropy(Tensor(x), Tensor(p), reduction=reduction)
    assert got.dtype == np.float32
    want = np_cross_entropy(x.astype(np.float64), p.astype(np.float64), reduction=reduction)
    np.testing.assert_allclose(got.asnumpy(), want, rtol=1e-5)


def test_float32_gradients_stay_float32():
    rng = np.random.default_rng(10)
    x = Tensor(rng.standard_normal((3, 4)).astype(np.float32), requires_grad=True)
    p = Tensor(rng.random((3, 4)).astype(np.float32), requires_grad=True)
    ops.softmax_cross_entropy(x, p).sum().backward()
    assert x.grad.dtype == np.float32 and p.grad.dtype == np.float32
    lp = Tensor(np_log_softmax(rng.standard_normal((3, 4)), 1).astype(np.float32), requires_grad=True)
    ops.nll_loss(lp, Tensor(np.array([0, 3, 1])), label_smoothing=0.1).backward()
    assert lp.grad.dtype == np.float32


def test_device_labels_at_the_class_boundaries_match_numpy(on_the_double):
    """On the GPU path (labels unchecked): labels 0 and C-1 give NumPy's values, labels C, -1 and
    below -C give NaN, an ignored label gives 0, and no other sample changes."""
    x = np.random.default_rng(11).standard_normal((6, 4))
    logp = np_log_softmax(x, 1)
    t = np.array([0, 3, 4, -1, -7, 2])
    good, bad = [0, 1, 5], [2, 3, 4]
    softmax_minus_onehot = np.exp(logp) - np.eye(4)[np.clip(t, 0, 3)]

    xt = Tensor(x, requires_grad=True)
    loss = ops.sparse_softmax_cross_entropy(xt, Tensor(t))
    loss.sum().backward()
    got, g = loss.asnumpy(), xt.grad.asnumpy()
    np.testing.assert_allclose(got[good], -logp[good, t[good]], rtol=1e-12)
    np.testing.assert_allclose(g[good], softmax_minus_onehot[good], rtol=1e-12, atol=1e-15)
    assert np.isnan(got[bad]).all() and np.isnan(g[bad]).all()

    ti = t.copy()
    ti[5] = -100  # ignored
    counted = np.where(ti == -100, -100, np.clip(ti, 0, 3))  # the reference needs labels in range
    for got, want in ((ops.cross_entropy(Tensor(x), Tensor(ti), reduction="none", label_smoothing=0.1),
                       np_cross_entropy(x, counted, reduction="none", s=0.1)),
                      (ops.nll_loss(Tensor(logp), Tensor(ti), reduction="none"),
                       np_nll(logp, counted, reduction="none"))):
        got = got.asnumpy()
        np.testing.assert_allclose(got[[0, 1, 5]], want[[0, 1, 5]], rtol=1e-12)
        assert got[5] == 0.0 and np.isnan(got[bad]).all()
    with np.errstate(invalid="ignore"):
        assert np.isnan(ops.nll_loss(Tensor(logp), Tensor(ti), reduction="sum").item())


def test_on_the_device_host_labels_are_uploaded(on_the_double):
    x = np.random.default_rng(12).standard_normal((3, 4))
    t = np.array([0, 3, 1])
    got = ops.cross_entropy(Tensor(x), t).item()
    np.testing.assert_allclose(got, np_cross_entropy(x, t), rtol=1e-12)


def test_on_the_device_logits_and_labels_on_two_devices_are_refused(on_the_double):
    """Either input left on the host (a NumPy array): the error that names both devices, never a
    loss computed half on the host."""
    x, t = np.random.default_rng(13).standard_normal((3, 4)), np.array([0, 3, 1])
    for name, call in (("SparseSoftmaxCrossEntropyWithLogits", lambda: ops.sparse_softmax_cross_entropy(Tensor(x), t)),
                       ("SparseSoftmaxCrossEntropyWithLogits", lambda: ops.sparse_softmax_cross_entropy(x, Tensor(t))),
                       ("SparseSoftmaxCrossEntropyWithLogits", lambda: ops.cross_entropy(x, Tensor(t))),
                       ("NLLLoss", lambda: ops.nll_loss(x, Tensor(t))),
                       ("NLLLoss", lambda: ops.nll_loss(Tensor(x), t))):
        with pytest.raises(TypeError, match=rf"{name}: inputs on two devices: on the host \(NumPy\): "):
            call()


def test_masked_logits_and_ignored_targets_give_pytorchs_finite_losses():
    """A -inf logit (a masked class) or a log-probability of -inf: a class with target weight 0,
    or an ignored sample, contributes exactly 0 (never 0 * inf = NaN), in value and gradient."""
    lg = np.array([[-np.inf, 1.0, 2.0], [0.1, -np.inf, 0.3], [0.5, 0.2, -np.inf]])
    t = np.array([-100, 2, 0])
    finite = np.where(np.isinf(lg), -1e30, lg)  # the same softmax without infinities
    for kw in ({}, {"weight": [0.5, 2.0, 1.0]}):
        w = np.array(kw.get("weight", np.ones(3)))
        want = np_cross_entropy(finite, t, w)
        x = Tensor(lg, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # nor a 0 * inf warning on the way
            loss = ops.cross_entropy(x, Tensor(t), **kw)
            loss.backward()
        np.testing.assert_allclose(loss.item(), want, rtol=1e-12)
        assert np.isfinite(x.grad.asnumpy()).all()
        with np.errstate(divide="ignore"):
            logp = np.log(np.exp(np_log_softmax(finite, 1)))  # -inf at the masked classes
        lp = Tensor(logp, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            loss = ops.nll_loss(lp, Tensor(t), Tensor(w))
            loss.backward()
        np.testing.assert_allclose(loss.item(), want, rtol=1e-12)
        assert np.isfinite(lp.grad.asnumpy()).all()
