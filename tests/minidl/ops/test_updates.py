"""ops.ApplyMomentum (MindSpore's primitive, nn.Momentum's update): the rule, in place, and never
recorded for backward. Its compiled kernel is held to this reference bit for bit by
tests/minidl/kernels/test_kernels.py (the kernel's cases)."""
import numpy as np
import pytest

from minidl import kernels, ops, Tensor


def rule(w, v, lr, g, m, nesterov, scale=1.0):
    g = g * scale
    v = m * v + g
    return (w - lr * (g + m * v) if nesterov else w - lr * v), v


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_the_rule_in_place(nesterov, scale):
    rng = np.random.default_rng(0)
    w, v, g = (rng.standard_normal((5, 3)) for _ in range(3))
    want_w, want_v = rule(w, v, 0.1, g, 0.9, nesterov, scale)
    w_arr, v_arr = w.copy(), v.copy()
    out = ops.ApplyMomentum(use_nesterov=nesterov, gradient_scale=scale)(w_arr, v_arr, 0.1, g, 0.9)
    np.testing.assert_allclose(w_arr, want_w, rtol=1e-12)
    np.testing.assert_allclose(v_arr, want_v, rtol=1e-12)
    assert out.data is w_arr  # the variable itself, updated


def test_tensors_that_require_grad_record_nothing():
    w = Tensor(np.ones(4, np.float32), requires_grad=True)
    v = Tensor(np.zeros(4, np.float32))
    out = ops.ApplyMomentum()(w, v, 0.5, Tensor(np.ones(4, np.float32)), 0.9)
    assert out._node is None
    np.testing.assert_array_equal(w.asnumpy(), np.full(4, 0.5, np.float32))


def test_mismatched_shapes_are_named():
    with pytest.raises(ValueError, match=r"ApplyMomentum: variable \(4,\), accumulation \(4,\) and gradient \(3,\)"):
        ops.ApplyMomentum()(np.ones(4), np.zeros(4), 0.1, np.ones(3), 0.9)


@pytest.mark.parametrize("nesterov", [False, True])
def test_a_scratch_buffer_changes_nothing_but_where_the_step_is_computed(nesterov):
    rng = np.random.default_rng(1)
    w, v, g = (rng.standard_normal((6, 4)).astype(np.float32) for _ in range(3))
    plain = [w.copy(), v.copy()]
    with_scratch = [w.copy(), v.copy()]
    scratch = np.empty_like(w)
    with kernels.reference_only():
        ops.ApplyMomentum(use_nesterov=nesterov)(*plain[:2], 0.1, g, 0.9)
        ops.ApplyMomentum(use_nesterov=nesterov)(*with_scratch[:2], 0.1, g, 0.9, scratch)
    for a, b in zip(plain, with_scratch):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("reference", [False, True])
def test_multi_apply_momentum_is_apply_momentum_per_parameter(nesterov, reference):
    rng = np.random.default_rng(2)
    shapes = [(5, 3), (4,), (2, 2, 2)]
    for dtype in (np.float32, np.float64):
        ws, vs, gs = ([rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(3))
        one = [(w.copy(), v.copy()) for w, v in zip(ws, vs)]
        many = [Tensor(w.copy()) for w in ws], [Tensor(v.copy()) for v in vs]  # tensors or arrays alike
        with kernels.reference_only(reference):
            for (w, v), g in zip(one, gs):
                ops.ApplyMomentum(use_nesterov=nesterov)(w, v, 0.1, g, 0.9)
            ops.MultiApplyMomentum(use_nesterov=nesterov)(many[0], many[1], 0.1, [Tensor(g) for g in gs], 0.9)
        for (w, v), w_many, v_many in zip(one, *many):
            np.testing.assert_array_equal(w_many.asnumpy(), w)
            np.testing.assert_array_equal(v_many.asnumpy(), v)


def test_multi_apply_momentum_needs_one_entry_of_each_per_parameter():
    with pytest.raises(ValueError, match="MultiApplyMomentum: got 2 variables, 2 accumulations and 1 gradients"):
        ops.MultiApplyMomentum()([np.ones(2)] * 2, [np.zeros(2)] * 2, 0.1, [np.ones(2)], 0.9)
