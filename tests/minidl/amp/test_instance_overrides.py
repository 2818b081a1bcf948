"""amp.auto_mixed_precision keeps what a user set on a cell instance: a BatchNorm's own
``with_relu`` and a construct taking keywords, also under recompute and when the level changes;
under "auto" a float64 BatchNorm's moving statistics are updated in place, never cast; a Dense
type met for the first time gets its level's rules.

Each test compares a network whose cells were changed on the instance with its twin that does
the same computation from its class: every level must treat the two alike.
"""
import numpy as np
import pytest

import minidl
from minidl import Tensor, amp, nn
from minidl.testing.modes import mode

from .test_auto_mixed_precision_o1 import F16, F32, run_recorded

LEVELS = [["O1"], ["O2"], ["O3"], ["auto"], ["O2", "O1"], ["O3", "auto"], ["O2", "O3", "O2"], ["O1", "O2"]]


class DoubledBatchNormReLU(nn.BatchNorm2d):
    """The twin of a BatchNorm whose instance with_relu doubles the class's."""

    def with_relu(self, x, residual=None):
        self.seen = (x.dtype, self.gamma.dtype)
        return super().with_relu(x, residual) * 2


class FusedNet(nn.Cell):
    def __init__(self, bn):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), bn

    def construct(self, x):
        return self.bn.with_relu(self.conv(x))


def _own_with_relu_net():
    net = FusedNet(nn.BatchNorm2d(4))
    bn = net.bn

    def with_relu(x, residual=None):  # (set on the instance: the class's with_relu is not this)
        bn.seen = (x.dtype, bn.gamma.dtype)
        return nn.BatchNorm2d.with_relu(bn, x, residual) * 2
    bn.with_relu = with_relu
    return net


@pytest.mark.parametrize("levels", LEVELS, ids="-".join)
def test_a_batchnorms_own_with_relu_is_cast_at_every_level_and_kept_across_changes_of_level(levels, rng):
    x = Tensor(rng.standard_normal((2, 3, 5, 5)).astype(np.float32))
    minidl.set_seed(0)
    own = _own_with_relu_net()
    minidl.set_seed(0)
    twin = FusedNet(DoubledBatchNormReLU(4))
    for level in levels:
        own, twin = amp.auto_mixed_precision(own, level), amp.auto_mixed_precision(twin, level)
        got, want = own(x), twin(x)
        assert got.dtype == want.dtype == np.float32, level
        np.testing.assert_array_equal(got.asnumpy(), want.asnumpy(), err_msg=level)
        # (the with_relu's input and gamma) O2 keeps the black-listed BatchNorm in float32, O3 casts
        # it; O1 and "auto" cast per op, not per call: the Conv's output as each leaves it
        want_seen = {"O1": (np.float32,) * 2, "O2": (np.float32,) * 2, "O3": (np.float16,) * 2,
                     "auto": (np.float16, np.float32)}[level]
        assert own._backbone.bn.seen == twin._backbone.bn.seen == want_seen, level
    assert got.asnumpy().any()  # (the ReLU left something to double)


class ScaledDense(nn.Dense):
    """The twin of a Dense whose instance construct takes a keyword ``scale``."""

    def construct(self, x, scale=None):
        return super().construct(x) * scale


def _own_scaled_dense():
    fc = nn.Dense(4, 3)
    # (the class's construct takes no keyword: only the instance's can run this call)
    fc.construct = lambda x, scale=None: nn.Dense.construct(fc, x) * scale
    return fc


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recomputed"])
@pytest.mark.parametrize("levels", LEVELS, ids="-".join)
def test_an_instance_construct_taking_keywords_is_cast_at_every_level_also_recomputed(levels, recompute, rng):
    """The keyword reaches the instance's construct, under the level's casts and, with recompute
    set first, in the forward and in the re-run in backward: values and gradients as the twin's."""
    x = Tensor(rng.standard_normal((2, 4)).astype(np.float32))
    scale = Tensor(np.float32(3.0))
    minidl.set_seed(5)
    own = _own_scaled_dense()
    minidl.set_seed(5)
    twin = ScaledDense(4, 3)
    if recompute:
        own.recompute()
        twin.recompute()
    for level in levels:
        own, twin = amp.auto_mixed_precision(own, level), amp.auto_mixed_precision(twin, level)
        results = []
        for net in (own, twin):
            out = net(x, scale=scale)
            grads = minidl.grad(lambda a, n=net: n(a, scale=scale).astype(minidl.float32).sum(), None,
                                net.trainable_params())(x)
            results.append((out, grads))
        (got, got_grads), (want, want_grads) = results
        assert got.dtype == want.dtype, level
        np.testing.assert_array_equal(got.asnumpy(), want.asnumpy(), err_msg=level)
        for g, w in zip(got_grads, want_grads):
            assert g.dtype == w.dtype == np.float32, level  # (float32 master weights' gradients)
            np.testing.assert_array_equal(g.asnumpy(), w.asnumpy(), err_msg=level)
    if recompute:
        assert type(own._backbone.construct).__name__ == "_RecomputedConstruct"  # (still recomputed, outermost)


def test_under_auto_a_float64_batchnorms_moving_statistics_are_updated_in_place(rng):
    """"auto" casts BatchNorm's inputs to float32 but not the statistics it writes: a cast copy
    would take the update and the float64 statistics would never move."""
    x = Tensor(rng.standard_normal((4, 3, 5, 5)).astype(np.float32) * 2 + 1)
    plain, cast = (nn.BatchNorm2d(3, momentum=0.5, dtype=minidl.float64) for _ in range(2))
    net = amp.auto_mixed_precision(cast, "auto").set_train(True)
    plain.set_train(True)
    for _ in range(2):
        want, got = plain(x), net(x)
    np.testing.assert_array_equal(got.asnumpy(), want.astype(got.dtype).asnumpy())
    for name in ("moving_mean", "moving_variance"):
        moved, kept = getattr(plain, name), getattr(cast, name)
        assert kept.dtype == np.float64, name
        assert not np.allclose(moved.asnumpy(), 0.0 if name == "moving_mean" else 1.0), name  # (it moved)
        np.testing.assert_array_equal(kept.asnumpy(), moved.asnumpy(), err_msg=name)


@pytest.mark.parametrize("level, want", [
    ("O1", [("MatMul", (F16, F16), F16), ("BiasAdd", (F16, F16), F16), ("Sigmoid", (F16,), F16)]),
    ("auto", [("MatMul", (F16, F16), F16), ("BiasAdd", (F32, F32), F32), ("Sigmoid", (F32,), F32)])])
def test_a_dense_type_met_for_the_first_time_runs_its_ops_and_its_activations_by_its_levels_rules(level, want, rng):
    """The policy of a white-listed cell type is made on its first call (then kept per type): a
    type defined here is new on every call, so this test makes it, as a user's own Dense would."""
    class FirstSeenDense(nn.Dense):
        pass
    net = amp.auto_mixed_precision(FirstSeenDense(4, 8, activation="sigmoid"), level)
    x = Tensor(rng.standard_normal((2, 4)).astype(np.float32))
    out, recording = run_recorded(net, x)
    assert out.dtype == F32  # (O1: every op's output cast back; "auto": BiasAdd promoted to the bias's float32)
    assert recording.without_casts() == want  # (O1: the activation cell inside the Dense is cast as the Dense)
    with mode(minidl.PYNATIVE_MODE):
        one_op = net(x)  # (the local runtime runs one ops.Dense: cast as the MatMul and BiasAdd it stands for)
    assert one_op.dtype == F32
    np.testing.assert_array_equal(one_op.asnumpy(), out.asnumpy())
