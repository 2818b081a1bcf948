"""The one op-test harness: give an op, its inputs and a NumPy reference, get checks of

1. the forward against the reference (float64, tight tolerance),
2. every input gradient against central finite differences of sum(f(x) * gy) in float64,
3. the float32 path: output dtype stays float32 and values match the reference loosely,
4. the fast kernels (minidl/kernels) that ran against the reference bodies: the same forward
   and gradients, bit for bit or within the kernels' stated bound.

Inputs are NumPy arrays; float arrays are differentiated, integer/bool arrays (labels,
indices) are passed through as constants. ``fn`` receives minidl Tensors and returns one.

Example:
    >>> check_op(lambda x: ops.relu(x), [x], reference=lambda x: np.maximum(x, 0))
"""
import numpy as np

from .. import backend, kernel_table as kernels
from ..tensor import Tensor


def assert_allclose(actual, expected, rtol=1e-7, atol=0.0, err_msg=""):
    """np.testing.assert_allclose that accepts Tensors and CuPy arrays."""
    actual = actual.asnumpy() if isinstance(actual, Tensor) else backend.to_numpy(actual)
    expected = expected.asnumpy() if isinstance(expected, Tensor) else backend.to_numpy(expected)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=err_msg)


def _is_float(a):
    return np.issubdtype(np.asarray(a).dtype, np.floating)


def _normalise(inputs):
    """NumPy scalars (what 0-d arithmetic returns) become 0-d arrays; float arrays float64."""
    out = []
    for a in inputs:
        if isinstance(a, np.generic):
            a = np.asarray(a)
        if isinstance(a, np.ndarray) and _is_float(a):
            a = a.astype(np.float64)
        out.append(a)
    return out


def _to_tensors(inputs, dtype, requires_grad):
    out = []
    for a in inputs:
        if isinstance(a, np.ndarray) and _is_float(a):
            out.append(Tensor(a.astype(dtype), requires_grad=requires_grad))
        elif isinstance(a, np.ndarray):
            out.append(Tensor(a))
        else:
            out.append(a)  # attribute (axis, shape...) passed as is
    return out


def check_forward(fn, inputs, reference, rtol=1e-10, atol=1e-12, dtype=np.float64):
    """Runs fn on Tensors of ``dtype`` and compares with ``reference`` on float64 NumPy inputs."""
    ts = _to_tensors(inputs, dtype, requires_grad=False)
    y = fn(*ts)
    expected = np.asarray(reference(*inputs))
    assert y.shape == expected.shape, f"forward shape {y.shape}, reference shape {expected.shape}"
    assert_allclose(y, expected, rtol=rtol, atol=atol, err_msg="forward differs from the reference")
    return y


def numerical_grad(f, inputs, position, gy, eps=1e-6):
    """Central difference of sum(f(*inputs) * gy) with respect to inputs[position]."""
    x = inputs[position]
    grad = np.zeros_like(x)
    flat = x.reshape(-1)
    g = grad.reshape(-1)
    for i in range(flat.size):
        orig = flat[i]
        flat[i] = orig + eps
        plus = np.sum(f(*inputs) * gy)
        flat[i] = orig - eps
        minus = np.sum(f(*inputs) * gy)
        flat[i] = orig
        g[i] = (plus - minus) / (2 * eps)
    return grad


def check_backward(fn, inputs, gy=None, positions=None, eps=1e-6, rtol=1e-5, atol=1e-7, seed=0):
    """Compares the analytic gradients of fn with central finite differences in float64.

    Args:
        positions: which inputs to check (default: every float ndarray input).
        gy: upstream gradient (default: random normal of the output's shape).
    """
    inputs = _normalise(inputs)
    if positions is None:
        positions = [i for i, a in enumerate(inputs) if isinstance(a, np.ndarray) and _is_float(a)]
    ts = _to_tensors(inputs, np.float64, requires_grad=True)
    y = fn(*ts)
    if gy is None:
        gy = np.random.default_rng(seed).standard_normal(y.shape)
    y.backward(Tensor(gy))

    def f(*arrays):
        with_grad_off = _to_tensors(list(arrays), np.float64, requires_grad=False)
        return fn(*with_grad_off).asnumpy().astype(np.float64)

    for p in positions:
        expected = numerical_grad(f, [a.copy() if isinstance(a, np.ndarray) else a for a in inputs], p, gy, eps)
        got = ts[p].grad
        got = np.zeros_like(expected) if got is None else got.asnumpy()
        assert got.shape == expected.shape, f"gradient of input {p}: shape {got.shape}, expected {expected.shape}"
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol,
                                   err_msg=f"gradient of input {p} differs from finite differences")


def check_op(fn, inputs, reference=None, positions=None, eps=1e-6, rtol=1e-5, atol=1e-7,
             fwd_rtol=1e-10, fwd_atol=1e-12, check_float32=True):
    """Forward vs reference, backward vs finite differences (float64), and the float32 path."""
    inputs = _normalise(inputs)
    if reference is not None:
        check_forward(fn, inputs, reference, rtol=fwd_rtol, atol=fwd_atol)
    check_backward(fn, inputs, positions=positions, eps=eps, rtol=rtol, atol=atol)
    check_kernels(fn, inputs)
    if check_float32:
        check_kernels(fn, inputs, np.float32)
        ts = _to_tensors(inputs, np.float32, requires_grad=False)
        y = fn(*ts)
        if any(isinstance(a, np.ndarray) and _is_float(a) for a in inputs) and np.issubdtype(y.dtype, np.floating):
            assert y.dtype == np.float32, f"float32 inputs gave a {y.dtype} output"
        if reference is not None:
            expected = np.asarray(reference(*inputs))
            scale = max(1.0, float(np.max(np.abs(expected))) if expected.size else 1.0)
            assert_allclose(y, expected, rtol=1e-4, atol=1e-4 * scale, err_msg="float32 forward differs")


def _forward_backward(fn, inputs, dtype, seed=0):
    ts = _to_tensors(inputs, dtype, requires_grad=True)
    y = fn(*ts)
    gy = np.random.default_rng(seed).standard_normal(y.shape).astype(y.dtype)
    if y.dtype.kind == "f" and y.grad_fn is not None:  # (an in-place update records nothing to differentiate)
        y.backward(Tensor(gy))
    grads = [t.grad.asnumpy() if isinstance(t, Tensor) and t.grad is not None else None for t in ts]
    return y.asnumpy(), grads


def check_kernels(fn, inputs, dtype=np.float64):
    """When a fast kernel ran in ``fn``, its forward and gradients against the reference bodies'
    (kernels.reference_only): equal bit for bit, or within the loosest stated bound of the kernels
    that ran. Returns the kernels that ran."""
    inputs = _normalise(inputs)
    with kernels.tracking() as used:
        fast = _forward_backward(fn, inputs, dtype)
    if not used:
        return used
    if fast[0].dtype.kind == "f" and all(g is None for g in fast[1]) and any(k.op.differentiable for k in used):
        raise AssertionError(f"kernels {', '.join(sorted(k.name for k in used))}: a differentiable op's float output "
                             "was not recorded for backward")
    with kernels.reference_only():
        ref = _forward_backward(fn, inputs, dtype)
    bounds = [b for b in (k.bound_for(np.dtype(dtype)) for k in used) if b is not None]
    rtol, atol = (max(b[0] for b in bounds), max(b[1] for b in bounds)) if bounds else (0.0, 0.0)
    names = ", ".join(sorted(k.name for k in used))
    pairs = [(fast[0], ref[0], "forward")] + [(g, r, f"gradient of input {i}")
                                             for i, (g, r) in enumerate(zip(fast[1], ref[1])) if r is not None]
    for got, want, what in pairs:
        if rtol == atol == 0.0:
            np.testing.assert_array_equal(got, want, err_msg=f"kernels {names}: {what} differs from the reference")
        else:
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol,
                                       err_msg=f"kernels {names}: {what} beyond the stated bound")
    return used
