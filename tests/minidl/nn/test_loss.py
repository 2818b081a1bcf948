"""Losses: values against NumPy formulas (PyTorch / MindSpore semantics), gradients, errors."""
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from minidl import Tensor, nn
from minidl.testing import check_op
from minidl.testing.strategies import arrays

reductions = st.sampled_from(["mean", "sum", "none"])


def reduce(per, reduction):
    return {"mean": np.mean, "sum": np.sum, "none": lambda a: a}[reduction](per)


def log_softmax(x, axis=-1):
    m = x.max(axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis, keepdims=True))


def ce_ref(logits, labels, weight=None, ignore_index=-100, reduction="mean", smoothing=0.0):
    """Cross entropy as PyTorch defines it (class axis 1; index or probability labels)."""
    x, y = logits, np.asarray(labels)
    if x.ndim == 1:
        x, y = x[None], (y[None] if y.ndim == 0 else y[None])
    n_classes = x.shape[1]
    batch_shape = (x.shape[0],) + x.shape[2:]
    logp = log_softmax(np.moveaxis(x, 1, -1).reshape(-1, n_classes))
    w = np.ones(n_classes) if weight is None else np.asarray(weight, np.float64)
    if np.issubdtype(y.dtype, np.integer):
        y = y.reshape(-1)
        valid = y != ignore_index
        ys = np.where(valid, y, 0)
        nll = -logp[np.arange(len(ys)), ys] * w[ys] * valid
        smooth = -(logp * w).sum(-1) * valid
        per = (1 - smoothing) * nll + smoothing / n_classes * smooth
        denominator = (w[ys] * valid).sum()
    else:
        t = np.moveaxis(y, 1, -1).reshape(-1, n_classes) * (1 - smoothing) + smoothing / n_classes
        per = -(t * w * logp).sum(-1)
        denominator = per.shape[0]
    if reduction == "none":
        return per.reshape(batch_shape if logits.ndim > 1 else ())
    return per.sum() if reduction == "sum" else per.sum() / denominator


# -- MSE, L1 ---------------------------------------------------------------------------

@given(shape=st.sampled_from([(3,), (2, 3), (2, 1, 3)]), reduction=reductions, data=st.data())
def test_mse_loss(shape, reduction, data):
    x, y = data.draw(arrays(shape)), data.draw(arrays(shape))
    loss = nn.MSELoss(reduction)
    check_op(lambda x, y: loss(x, y), [x, y], reference=lambda x, y: reduce((x - y) ** 2, reduction))


@given(shape=st.sampled_from([(3,), (2, 3), (2, 1, 3)]), reduction=reductions, data=st.data())
def test_l1_loss(shape, reduction, data):
    x, y = data.draw(arrays(shape)), data.draw(arrays(shape))
    assume(np.all(np.abs(x - y) > 1e-3))  # |.| has no derivative at 0
    loss = nn.L1Loss(reduction)
    check_op(lambda x, y: loss(x, y), [x, y], reference=lambda x, y: reduce(np.abs(x - y), reduction))


def test_loss_base_get_loss_weights_and_reduction_error():
    base = nn.LossBase("sum")
    x = Tensor(np.array([1.0, 2.0, 3.0], np.float32))
    assert base.get_loss(x).item() == pytest.approx(6.0)
    assert base.get_loss(x, Tensor(np.array([1.0, 0.0, 2.0], np.float32))).item() == pytest.approx(7.0)
    assert nn.LossBase("none").get_loss(x) is x
    for cls in (nn.MSELoss, nn.L1Loss, nn.LossBase, nn.CrossEntropyLoss):
        with pytest.raises(ValueError, match=f"{cls.__name__}: reduction must be one of 'mean', 'sum', 'none', "
                                             f"got 'avg'"):
            cls(reduction="avg")
    with pytest.raises(ValueError, match="SoftmaxCrossEntropyWithLogits: reduction must be one of"):
        nn.SoftmaxCrossEntropyWithLogits(reduction="elementwise")


def test_loss_base_defaults_to_the_mean_and_reduces_every_axis():
    x = Tensor(np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 9.0]], np.float32))
    base = nn.LossBase()
    assert base.reduction == "mean" and base.get_loss(x).item() == pytest.approx(4.0)
    assert base.get_axis(x) == (0, 1) and base.get_axis(Tensor(np.zeros((2, 1, 3)))) == (0, 1, 2)
    assert base.get_axis(Tensor(np.float32(1.0))) == ()
    y = Tensor(np.array([[0.0, 4.0, 3.0], [4.0, 2.0, 8.0]], np.float32))  # differences 1, -2, 0, 0, 3, 1
    assert nn.MSELoss().reduction == "mean" and nn.MSELoss()(x, y).item() == pytest.approx(15 / 6)
    assert nn.L1Loss().reduction == "mean" and nn.L1Loss()(x, y).item() == pytest.approx(7 / 6)


def test_a_loss_without_construct_says_which_class_lacks_it():
    class Hinge(nn.LossBase):
        pass
    x = Tensor(np.zeros(2, np.float32))
    with pytest.raises(NotImplementedError, match=r"^LossBase: a loss must define construct\(self, logits, labels\)$"):
        nn.LossBase()(x, x)
    with pytest.raises(NotImplementedError, match=r"^Hinge: a loss must define construct\(self, logits, labels\)$"):
        Hinge()(x, x)


# -- SoftmaxCrossEntropyWithLogits -----------------------------------------------------

@given(n=st.integers(1, 4), c=st.integers(2, 4), sparse=st.booleans(), reduction=reductions, data=st.data())
def test_softmax_cross_entropy_with_logits(n, c, sparse, reduction, data):
    x = data.draw(arrays((n, c)))
    labels = np.array(data.draw(st.lists(st.integers(0, c - 1), min_size=n, max_size=n)), np.int32)
    target = labels if sparse else np.eye(c)[labels]
    loss = nn.SoftmaxCrossEntropyWithLogits(sparse=sparse, reduction=reduction)
    check_op(lambda x, t: loss(x, t), [x, target], positions=[0],
             reference=lambda x, t: reduce(ce_ref(x, labels, reduction="none"), reduction))


def test_softmax_cross_entropy_defaults_and_errors():
    loss = nn.SoftmaxCrossEntropyWithLogits()
    assert not loss.sparse and loss.reduction == "none"  # MindSpore's defaults
    x = np.array([[1.0, 2.0, 0.5], [0.1, 0.2, 3.0]], np.float32)
    t = np.array([[0.2, 0.8, 0.0], [0.0, 0.0, 1.0]], np.float32)
    np.testing.assert_allclose(loss(Tensor(x), Tensor(t)).asnumpy(), -(t * log_softmax(x)).sum(1), rtol=1e-6)
    with pytest.raises(ValueError, match=r"SoftmaxCrossEntropyWithLogits: logits must be \(N, C\), got shape \(3,\)"):
        loss(Tensor(x[0]), Tensor(t[0]))


def test_one_hot_labels_with_sparse_true_suggest_sparse_false():
    x = np.array([[1.0, 2.0, 0.5], [0.1, 0.2, 3.0]], np.float32)
    onehot = np.eye(3, dtype=np.float32)[[1, 2]]
    with pytest.raises(TypeError, match=r"SoftmaxCrossEntropyWithLogits\(sparse=True\): labels of dtype float32 have "
                                        r"the logits' shape \(2, 3\), as one-hot labels .* integer class indices of "
                                        r"shape \(2,\); pass sparse=False for one-hot or probability labels"):
        nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")(Tensor(x), Tensor(onehot))
    # what the message suggests gives the same loss either way
    dense = nn.SoftmaxCrossEntropyWithLogits(sparse=False, reduction="mean")(Tensor(x), Tensor(onehot)).item()
    index = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")(
        Tensor(x), Tensor(onehot.argmax(axis=1).astype(np.int32))).item()
    assert dense == pytest.approx(index, rel=1e-6)
    # float labels of another shape keep the primitive's dtype message, without the one-hot hint
    with pytest.raises(TypeError, match=r"SparseSoftmaxCrossEntropyWithLogits: labels must be integer class indices, "
                                        r"got dtype float32$"):
        nn.SoftmaxCrossEntropyWithLogits(sparse=True)(Tensor(x), Tensor(np.array([1.0, 2.0], np.float32)))


def test_sparse_labels_given_as_a_python_list_get_the_primitives_type_error():
    x = Tensor(np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match=r"SparseSoftmaxCrossEntropyWithLogits: labels must be integer class indices, "
                                        r"got list$"):
        nn.SoftmaxCrossEntropyWithLogits(sparse=True)(x, [1, 0])


# -- CrossEntropyLoss ------------------------------------------------------------------

@st.composite
def ce_cases(draw):
    c = draw(st.integers(2, 4))
    shape = draw(st.sampled_from([(c,), (2, c), (3, c), (2, c, 2), (1, c, 2, 2)]))
    batch = (shape[0],) + shape[2:] if len(shape) > 1 else ()
    probabilities = draw(st.booleans())
    if probabilities:
        raw = draw(arrays(shape, 0.0, 1.0)) + 1e-3
        labels = raw / raw.sum(axis=0 if len(shape) == 1 else 1, keepdims=True)
        ignore = -100
    else:
        labels = np.array(draw(st.lists(st.integers(0, c - 1), min_size=int(np.prod(batch)),
                                        max_size=int(np.prod(batch)))), np.int64).reshape(batch)
        ignore = draw(st.sampled_from([-100, 0]))
        assume(ignore != 0 or np.any(labels != 0))  # a mean over no sample is 0/0
    weight = draw(st.none() | arrays((c,), 0.5, 2.0))
    smoothing = draw(st.sampled_from([0.0, 0.0, 0.1]))
    reduction = draw(reductions)
    logits = draw(arrays(shape))
    return logits, labels, weight, ignore, reduction, smoothing


@given(case=ce_cases())
def test_cross_entropy_loss_forward(case):
    logits, labels, weight, ignore, reduction, smoothing = case
    loss = nn.CrossEntropyLoss(weight=weight, ignore_index=ignore, reduction=reduction, label_smoothing=smoothing)
    y = loss(Tensor(logits), Tensor(labels))
    expected = ce_ref(logits, labels, weight, ignore, reduction, smoothing)
    assert y.shape == np.shape(expected) and y.dtype == np.float64
    np.testing.assert_allclose(y.asnumpy(), expected, rtol=1e-10, atol=1e-12)


@settings(max_examples=6)
@given(case=ce_cases())
def test_cross_entropy_loss_gradients(case):
    logits, labels, weight, ignore, reduction, smoothing = case
    loss = nn.CrossEntropyLoss(weight=weight, ignore_index=ignore, reduction=reduction, label_smoothing=smoothing)
    inputs = [logits, labels.astype(np.int64)] if labels.dtype.kind == "i" else [logits, labels]
    check_op(lambda x, t: loss(x, t), inputs, positions=[0],
             reference=lambda x, t: ce_ref(x, labels, weight, ignore, reduction, smoothing))


def test_cross_entropy_ignore_index_and_weights_by_hand():
    x = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6]]))
    labels = np.array([0, 1, -100])
    # The ignored sample counts neither in the sum nor in the mean's denominator.
    got = nn.CrossEntropyLoss()(Tensor(x), Tensor(labels)).item()
    assert got == pytest.approx(-(np.log(0.5) + np.log(0.8)) / 2)
    weighted = nn.CrossEntropyLoss(weight=np.array([2.0, 1.0, 1.0]))(Tensor(x), Tensor(labels)).item()
    assert weighted == pytest.approx(-(2 * np.log(0.5) + np.log(0.8)) / 3)
    per = nn.CrossEntropyLoss(reduction="none")(Tensor(x), Tensor(labels)).asnumpy()
    np.testing.assert_allclose(per, [-np.log(0.5), -np.log(0.8), 0.0], rtol=1e-12)


def test_cross_entropy_float32_and_int32_labels():
    x = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    labels = np.array([0, 4, 2, 2], np.int32)
    y = nn.CrossEntropyLoss()(Tensor(x), Tensor(labels))
    assert y.dtype == np.float32 and y.shape == ()
    assert y.item() == pytest.approx(ce_ref(x.astype(np.float64), labels), rel=1e-5)


def test_cross_entropy_errors(monkeypatch):
    monkeypatch.setenv("MINIDL_CHECK_LABELS", "1")  # the device-pinned suite checks on the host too
    loss = nn.CrossEntropyLoss()
    x = Tensor(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"CrossEntropyLoss: labels \[3, 7\] are outside \[0, 3\)"):
        loss(x, Tensor(np.array([3, 7])))
    with pytest.raises(ValueError, match=r"CrossEntropyLoss: class-index labels of shape \(3,\) do not match logits "
                                         r"of shape \(2, 3\): expected labels of shape \(2,\)"):
        loss(x, Tensor(np.array([0, 1, 2])))
    with pytest.raises(ValueError, match=r"CrossEntropyLoss: probability labels of shape \(2, 2\) must match the "
                                         r"logits' shape \(2, 3\)"):
        loss(x, Tensor(np.zeros((2, 2), np.float32)))
    with pytest.raises(ValueError, match=r"CrossEntropyLoss: weight has 2 entries but logits of shape \(2, 3\) have "
                                         r"3 classes"):
        nn.CrossEntropyLoss(weight=np.ones(2))(x, Tensor(np.array([0, 1])))
    with pytest.raises(ValueError, match=r"CrossEntropyLoss: label_smoothing must be in \[0, 1\], got 1.5"):
        nn.CrossEntropyLoss(label_smoothing=1.5)


def test_cross_entropy_reference_agrees_with_hand_formula():
    """Guards the NumPy reference itself on a case small enough to work out by hand."""
    x = np.log(np.array([[0.7, 0.2, 0.1]]))
    s = 0.3
    expected = (1 - s) * -np.log(0.7) + s / 3 * -(np.log(0.7) + np.log(0.2) + np.log(0.1))
    assert ce_ref(x, np.array([0]), smoothing=s) == pytest.approx(expected)
    assert ce_ref(x, np.array([[1.0, 0.0, 0.0]]), smoothing=s) == pytest.approx(expected)


@pytest.mark.parametrize("kw", [{}, {"ignore_index": 2}, {"weight": np.array([1.0, 2.0, 0.5, 1.5])},
                                {"label_smoothing": 0.1}], ids=["plain", "ignore_index", "weight", "smoothing"])
def test_cross_entropy_device_labels_out_of_range_give_nan_without_a_host_sync(on_the_double, kw):
    """Checking device labels' range would read a value back every step: by default a bad label
    makes its sample's loss and logits' gradient NaN instead (never a wrapped gather or a silent
    0), the other samples stay exact, and an ignored label stays ignored."""
    from minidl.testing import cupy_double
    x = np.random.default_rng(0).standard_normal((4, 4))
    good, bad = np.array([1, 2, 0, 3]), np.array([1, 7, 0, -1])  # 7 and -1: out of range for 4 classes
    loss = nn.CrossEntropyLoss(reduction="none", **kw)
    want_t = Tensor(x, requires_grad=True)
    want = loss(want_t, Tensor(good))
    want.sum().backward()
    t = Tensor(x, requires_grad=True)
    with cupy_double.count_host_syncs() as syncs:
        got = loss(t, Tensor(bad))
        got.sum().backward()
        mean = nn.CrossEntropyLoss(**kw)(Tensor(x), Tensor(bad))
    assert syncs.total == 0, syncs.by_reason
    got, g = got.asnumpy(), t.grad.asnumpy()
    assert np.isnan(got[[1, 3]]).all() and np.isnan(g[[1, 3]]).all(), (got, g)
    np.testing.assert_allclose(got[[0, 2]], want.asnumpy()[[0, 2]], rtol=1e-12)
    np.testing.assert_allclose(g[[0, 2]], want_t.grad.asnumpy()[[0, 2]], rtol=1e-12)
    assert np.isnan(mean.asnumpy()), "a bad label must show in the reduced loss"


def test_cross_entropy_device_labels_are_checked_on_the_host_when_asked(on_the_double, monkeypatch):
    monkeypatch.setenv("MINIDL_CHECK_LABELS", "1")
    with pytest.raises(ValueError, match=r"CrossEntropyLoss: labels \[-1, 7\] are outside \[0, 4\)"):
        nn.CrossEntropyLoss()(Tensor(np.zeros((3, 4))), Tensor(np.array([0, 7, -1])))
    monkeypatch.setenv("MINIDL_CHECK_LABELS", "0")  # read at each call: "0" turns it back off
    assert np.isnan(nn.CrossEntropyLoss()(Tensor(np.zeros((3, 4))), Tensor(np.array([0, 7, -1]))).asnumpy())


def test_cross_entropy_argument_errors_name_the_value():
    with pytest.raises(ValueError, match=r"CrossEntropyLoss: weight must be 1-D \(one per class\), got shape \(2, 2\)"):
        nn.CrossEntropyLoss(weight=np.ones((2, 2)))
    for bad in (True, "0.1", -0.1, None):
        with pytest.raises(ValueError, match=rf"CrossEntropyLoss: label_smoothing must be in \[0, 1\], got {bad!r}"):
            nn.CrossEntropyLoss(label_smoothing=bad)
    for bad in (1.5, True, None, "1"):
        with pytest.raises(TypeError, match=rf"CrossEntropyLoss: ignore_index must be an int, got {bad!r}"):
            nn.CrossEntropyLoss(ignore_index=bad)


@pytest.mark.parametrize("s", [0.1, 1.0])
def test_cross_entropy_label_smoothing_without_weight(s):
    """Smoothing on its own (no weight), up to s = 1 (a uniform target), as PyTorch and MindSpore allow."""
    x = np.random.default_rng(1).standard_normal((4, 3))
    labels = np.array([0, 2, -100, 1])
    for reduction in ("mean", "sum", "none"):
        got = nn.CrossEntropyLoss(reduction=reduction, label_smoothing=s)(Tensor(x), Tensor(labels)).asnumpy()
        np.testing.assert_allclose(got, ce_ref(x, labels, reduction=reduction, smoothing=s), rtol=1e-12)
    if s == 1.0:  # every class weighs 1/C: the label does not matter, the ignored sample still counts nothing
        per = nn.CrossEntropyLoss(reduction="none", label_smoothing=1)(Tensor(x), Tensor(labels)).asnumpy()
        np.testing.assert_allclose(per, -log_softmax(x).mean(1) * [1, 1, 0, 1], rtol=1e-12)


def test_cross_entropy_takes_python_lists_and_numbers():
    x = np.random.default_rng(2).standard_normal((3, 4))
    got = nn.CrossEntropyLoss(weight=[2.0, 1.0, 0.5, 1.0])(Tensor(x), [0, 3, 2]).item()
    assert got == pytest.approx(ce_ref(x, np.array([0, 3, 2]), weight=[2.0, 1.0, 0.5, 1.0]), rel=1e-6)
    assert nn.CrossEntropyLoss()(Tensor(x[0]), 3).item() == pytest.approx(-log_softmax(x[0])[3], rel=1e-12)


def test_cross_entropy_one_class_with_an_ignored_sample():
    """With C = 1 the only class index is 0: an ignored sample must not be looked up as any other."""
    x, labels = Tensor(np.array([[0.5], [2.0], [-1.0]])), Tensor(np.array([0, -100, 0]))
    np.testing.assert_array_equal(nn.CrossEntropyLoss(reduction="none")(x, labels).asnumpy(), [0.0, 0.0, 0.0])
    assert nn.CrossEntropyLoss()(x, labels).item() == 0.0


def test_cross_entropy_names_at_most_five_bad_labels(monkeypatch):
    monkeypatch.setenv("MINIDL_CHECK_LABELS", "1")  # the device-pinned suite checks on the host too
    with pytest.raises(ValueError, match=r"CrossEntropyLoss: labels \[-2, 3, 4, 5, 6\] are outside \[0, 3\) "
                                         r"\(ignore_index=-100\)$"):
        nn.CrossEntropyLoss()(Tensor(np.zeros((8, 3))), Tensor(np.array([9, 0, 8, 6, 5, 4, 3, -2])))


def test_cross_entropy_refuses_0d_logits():
    with pytest.raises(ValueError, match=r"^CrossEntropyLoss: logits must have a class dimension, got a 0-d tensor$"):
        nn.CrossEntropyLoss()(Tensor(np.float32(1.0)), Tensor(np.array(0)))


def test_cross_entropy_probability_labels_with_spatial_axes():
    """(N, C, d) probabilities: the class axis is 1, so the target is moved like the logits."""
    rng = np.random.default_rng(3)
    x, raw = rng.standard_normal((2, 3, 4)), rng.random((2, 3, 4)) + 0.1
    p = raw / raw.sum(1, keepdims=True)
    for kw in ({}, {"weight": np.array([1.0, 2.0, 0.5])}, {"label_smoothing": 0.2}):
        got = nn.CrossEntropyLoss(reduction="none", **kw)(Tensor(x), Tensor(p)).asnumpy()
        want = ce_ref(x, p, kw.get("weight"), reduction="none", smoothing=kw.get("label_smoothing", 0.0))
        assert got.shape == (2, 4)
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_cross_entropy_float32_stays_float32_with_ignored_samples_and_probabilities():
    x = np.random.default_rng(4).standard_normal((4, 3)).astype(np.float32)
    labels = np.array([0, -100, 2, 1])
    p = np.eye(3, dtype=np.float32)[[0, 1, 2, 1]] * 0.8 + 0.2 / 3
    for reduction in ("mean", "none"):
        for y, want in ((labels, ce_ref(x.astype(np.float64), labels, reduction=reduction)),
                        (p, ce_ref(x.astype(np.float64), p.astype(np.float64), reduction=reduction))):
            got = nn.CrossEntropyLoss(reduction=reduction)(Tensor(x), Tensor(y))
            assert got.dtype == np.float32, (reduction, y.dtype, got.dtype)
            np.testing.assert_allclose(got.asnumpy(), want, rtol=1e-5)


def test_cross_entropy_refuses_blocks_naming_the_tensor_and_both_shapes():
    """Under tensor parallelism a cut logits or labels tensor would give a silently wrong loss."""
    from minidl_parallel import Layout, redistribute, run_threads

    def rank():
        x, y = Tensor(np.zeros((4, 3))), Tensor(np.array([0, 1, 2, 0]))
        messages = []
        for logits, labels in ((redistribute(x, Layout((2,), (0, None))), y), (x, redistribute(y, Layout((2,), (0,))))):
            with pytest.raises(ValueError) as error:
                nn.CrossEntropyLoss()(logits, labels)
            messages.append(str(error.value))
        return messages
    for logits_error, labels_error in run_threads(2, rank, timeout=60):
        assert logits_error == ("CrossEntropyLoss: logits of logical shape (4, 3) is cut across ranks (this rank "
                                "holds (2, 3)); CrossEntropyLoss builds arrays from local data and cannot run on "
                                "blocks: use nn.SoftmaxCrossEntropyWithLogits, or dataset_strategy='full_batch' with "
                                "whole logits")
        assert labels_error.startswith("CrossEntropyLoss: labels of logical shape (4,) is cut across ranks (this "
                                       "rank holds (2,));")


def test_cross_entropy_on_the_device_takes_host_labels_and_host_arrays(on_the_double):
    """Device logits with NumPy labels run on the device; NumPy logits and labels (not Tensors)
    run where they are, also with a weight, though the context is the GPU."""
    cupy = on_the_double
    x, labels = np.random.default_rng(5).standard_normal((5, 3)), np.array([0, 2, 1, 2, 0])
    p, w = np.eye(3)[labels] * 0.7 + 0.1, np.array([1.0, 2.0, 3.0])
    for kw in ({}, {"weight": w}, {"label_smoothing": 0.1}):
        want = ce_ref(x, labels, kw.get("weight"), smoothing=kw.get("label_smoothing", 0.0))
        for logits in (Tensor(x), Tensor(x).data):  # a device Tensor or a bare device array
            got = nn.CrossEntropyLoss(**kw)(logits, labels)
            assert isinstance(got.data, cupy.ndarray)
            assert got.item() == pytest.approx(want, rel=1e-12)
        assert nn.CrossEntropyLoss(**kw)(x, labels).item() == pytest.approx(want, rel=1e-12)
    got = nn.CrossEntropyLoss(weight=w)(x, p).item()
    assert got == pytest.approx(ce_ref(x, p, w), rel=1e-12)
    # host logits with device labels: minidl's error naming both devices, not CuPy's refusal to copy
    for kw, y in (({}, labels), ({"weight": w}, labels), ({}, p)):
        with pytest.raises(TypeError, match=r"inputs on two devices: on the host \(NumPy\): .*; on the GPU \(CuPy\): "):
            nn.CrossEntropyLoss(**kw)(x, Tensor(y))


def test_cross_entropy_weighted_mean_on_the_device(on_the_double):
    """The mean divides by the summed weights of the samples' classes, the first and last class included."""
    x = np.random.default_rng(6).standard_normal((5, 3))
    labels, w = np.array([0, 2, 1, 2, 0]), np.array([1.0, 2.0, 4.0])
    for s in (0.0, 0.1):
        got = nn.CrossEntropyLoss(weight=w, label_smoothing=s)(Tensor(x), Tensor(labels)).item()
        assert got == pytest.approx(ce_ref(x, labels, w, smoothing=s), rel=1e-12)


# ---- NLLLoss -------------------------------------------------------------------------------------

@given(reduction=reductions, weighted=st.booleans(), seed=st.integers(0, 2**16))
def test_nll_loss_cell_of_log_softmax_is_cross_entropy(reduction, weighted, seed):
    rng = np.random.default_rng(seed)
    x, t = rng.standard_normal((4, 3, 2)), rng.integers(0, 3, (4, 2))
    t[0, 0] = -100
    w = rng.random(3) + 0.5 if weighted else None
    nll = nn.NLLLoss(weight=w, reduction=reduction)
    got = nll(nn.LogSoftmax(axis=1)(Tensor(x)), Tensor(t)).asnumpy()
    want = nn.CrossEntropyLoss(weight=w, reduction=reduction)(Tensor(x), Tensor(t)).asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-12)
    check_op(lambda x: nll(nn.LogSoftmax(axis=1)(x), Tensor(t)), [x], check_float32=False)


def test_nll_loss_cell_arguments():
    loss = nn.NLLLoss()
    assert (loss.weight, loss.ignore_index, loss.reduction) == (None, -100, "mean")
    assert "ignore_index=-100, reduction=mean" in repr(loss)
    y = nn.NLLLoss(ignore_index=1)(Tensor(np.log(np.full((2, 3), 1 / 3))), Tensor(np.array([1, 0])))
    np.testing.assert_allclose(y.asnumpy(), np.log(3))
    with pytest.raises(ValueError, match=r"NLLLoss: reduction must be one of 'mean', 'sum', 'none', got 'avg'"):
        nn.NLLLoss(reduction="avg")
    with pytest.raises(ValueError, match=r"NLLLoss: weight must be 1-D \(one per class\), got shape \(2, 2\)"):
        nn.NLLLoss(weight=np.ones((2, 2)))


def test_nll_loss_cell_passes_ignore_index_on_and_takes_a_weight_list():
    logp = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6]]))
    labels = Tensor(np.array([0, 1, 2]))
    assert nn.NLLLoss(ignore_index=1)(Tensor(logp), labels).item() == pytest.approx(-(np.log(0.5) + np.log(0.6)) / 2)
    assert nn.NLLLoss(ignore_index=0, reduction="sum")(Tensor(logp), labels).item() == \
        pytest.approx(-(np.log(0.8) + np.log(0.6)))
    got = nn.NLLLoss(weight=[2.0, 1.0, 0.5])(Tensor(logp), labels).item()
    assert got == pytest.approx(-(2 * np.log(0.5) + np.log(0.8) + 0.5 * np.log(0.6)) / 3.5, rel=1e-6)
