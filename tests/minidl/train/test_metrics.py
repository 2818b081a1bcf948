"""Metrics: Accuracy, Loss, TopKCategoricalAccuracy against plain NumPy, and their checks."""
import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

from minidl import Tensor
from minidl.train import (Accuracy, Loss, Metric, TopKCategoricalAccuracy, Top1CategoricalAccuracy,
                          Top5CategoricalAccuracy, get_metric_fn, get_metrics)


@st.composite
def scored_batches(draw, max_batches=3):
    """A list of (logits (n, c), labels (n,)) batches with distinct scores per row."""
    c = draw(st.integers(2, 6))
    batches = []
    for _ in range(draw(st.integers(1, max_batches))):
        n = draw(st.integers(1, 5))
        # distinct values per row: a permutation plus a small shift, so argmax/top-k have no ties
        perm = np.argsort(draw(hnp.arrays(np.float64, (n, c), elements=st.floats(0, 1))), axis=1)
        logits = perm.astype(np.float32) + np.float32(draw(st.floats(-3, 3)))
        labels = draw(hnp.arrays(np.int64, (n,), elements=st.integers(0, c - 1)))
        batches.append((logits, labels))
    return batches


@given(scored_batches())
def test_accuracy_is_fraction_of_argmax_hits_over_all_batches(batches):
    acc = Accuracy("classification")
    acc.clear()
    for logits, labels in batches:
        acc.update(Tensor(logits), Tensor(labels))
    hits = sum(int((lg.argmax(1) == lb).sum()) for lg, lb in batches)
    total = sum(len(lb) for _, lb in batches)
    assert acc.eval() == pytest.approx(hits / total)


@given(scored_batches(), st.integers(1, 6))
def test_top_k_counts_label_among_k_best(batches, k):
    c = batches[0][0].shape[1]
    k = min(k, c)
    metric = TopKCategoricalAccuracy(k)
    for logits, labels in batches:
        metric.update(logits, labels)
    hits = total = 0
    for logits, labels in batches:
        for row, label in zip(logits, labels):
            hits += int((row > row[label]).sum() < k)  # fewer than k classes score higher
            total += 1
    assert metric.eval() == pytest.approx(hits / total)


def test_accuracy_takes_one_hot_labels_and_clear_resets():
    logits = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]], np.float32)
    one_hot = np.array([[0, 1], [0, 1], [0, 1]], np.float32)
    acc = Accuracy()
    acc.update(logits, one_hot)
    assert acc.eval() == pytest.approx(2 / 3)
    acc.clear()
    acc.update(logits, np.array([0, 0, 0]))
    assert acc.eval() == pytest.approx(1 / 3)
    assert acc(logits, np.array([1, 0, 1])) == 1.0  # __call__: clear + update + eval


def test_multilabel_accuracy_needs_every_label_right():
    acc = Accuracy("multilabel")
    acc.update(np.array([[0.9, 0.1], [0.6, 0.7]]), np.array([[1, 0], [1, 0]]))
    assert acc.eval() == 0.5


def test_loss_metric_averages_batch_means():
    m = Loss()
    m.update(Tensor(np.float32(2.0)))
    m.update(np.array([1.0, 3.0, 5.0]))
    assert m.eval() == pytest.approx((2.0 + 3.0) / 2)


def test_top1_top5_are_topk():
    assert Top1CategoricalAccuracy().k == 1
    assert Top5CategoricalAccuracy().k == 5


@pytest.mark.parametrize("metric", [Accuracy(), Loss(), TopKCategoricalAccuracy(2)])
def test_eval_before_update_raises(metric):
    metric.clear()
    with pytest.raises(RuntimeError, match="number of samples is 0"):
        metric.eval()


def test_bad_inputs_name_the_metric_and_the_expectation():
    with pytest.raises(ValueError, match=r"Accuracy.update: needs 2 input"):
        Accuracy().update(np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"labels must have shape \(2,\)"):
        Accuracy().update(np.zeros((2, 3)), np.zeros(3))
    with pytest.raises(ValueError, match=r"class indices in \[0, 3\), got values in \[0, 3\]"):
        Accuracy().update(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(ValueError, match="predictions must have shape"):
        Accuracy().update(np.zeros(3), np.zeros(3))
    with pytest.raises(ValueError, match="eval_type must be"):
        Accuracy("regression")
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        TopKCategoricalAccuracy(0)
    with pytest.raises(ValueError, match="k=4 is larger than the number of classes 3"):
        TopKCategoricalAccuracy(4).update(np.zeros((1, 3)), np.array([0]))
    with pytest.raises(ValueError, match="scalar or 1-D"):
        Loss().update(np.zeros((2, 2)))
    with pytest.raises(TypeError, match="must be a Tensor, an array or a list"):
        Loss().update("2.0")


def test_get_metrics_from_names_and_dicts():
    m = get_metrics({"accuracy", "loss"})
    assert list(m) == ["accuracy", "loss"]
    assert isinstance(m["accuracy"], Accuracy) and isinstance(m["loss"], Loss)
    acc = Accuracy()
    assert get_metrics({"acc": acc})["acc"] is acc
    assert get_metrics(None) == {}
    assert isinstance(get_metric_fn("top_5_accuracy"), Top5CategoricalAccuracy)
    with pytest.raises(ValueError, match="unknown metric 'f1'; expected one of"):
        get_metrics(["f1"])
    with pytest.raises(TypeError, match="must be a Metric instance"):
        get_metrics({"acc": "accuracy"})
    with pytest.raises(TypeError, match="set/list of names or a dict"):
        get_metrics("accuracy")


def test_metric_indexes():
    m = Metric()
    assert m.indexes is None
    assert m.set_indexes([1, 2]).indexes == [1, 2]
    with pytest.raises(ValueError, match="list of ints"):
        m.set_indexes("12")
