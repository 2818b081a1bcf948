"""ApplyMomentum (and MultiApplyMomentum) in one pass, compiled by Numba (optional: ``minidl[numba]``).

The reference (minidl/ops/updates.py) makes four NumPy passes over a parameter (accumulation
scaled, gradient added, the step, the subtraction) and a temporary; for the MLP's 670k
parameters that was 14% of its training step (benchmarks/profile_step.py --model mlp). One loop
(updates_loops.py's ``momentum``) reads each element of the variable, accumulation and gradient
once and writes the first two, in the reference's order of operations per element (no FMA
contraction): bit for bit the reference. MultiApplyMomentum's kernel runs that loop over each
parameter in turn, on the calling thread. Numba is imported at the first call, not with minidl.
"""
import importlib.util

import numpy

from ...ops.updates import ApplyMomentum, MultiApplyMomentum, arrays_of
from ...tensor import Tensor
from .. import Kernel, register

__all__ = ["ApplyMomentumLoop", "MultiApplyMomentumLoop"]


@register
class ApplyMomentumLoop(Kernel):
    op, backend = ApplyMomentum, "numpy"
    available = importlib.util.find_spec("numba") is not None  # else the reference runs (the tests skip its cases)
    extra = "numba"

    def applies(self, node, variable, accumulation, learning_rate, gradient, momentum, scratch=None):
        arrays = (variable, accumulation, gradient)
        return (self.available and node.gradient_scale == 1.0
                and all(isinstance(a, numpy.ndarray) and a.flags.c_contiguous for a in arrays)
                and variable.dtype == accumulation.dtype == gradient.dtype and variable.dtype.char in "fd"
                and variable.shape == accumulation.shape == gradient.shape)

    def forward(self, node, variable, accumulation, learning_rate, gradient, momentum, scratch=None):
        from . import updates_loops  # imports Numba: at the first call, not with minidl
        scalar = variable.dtype.type  # NumPy takes a Python number as the arrays' dtype (NEP 50)
        updates_loops.momentum(variable.reshape(-1), accumulation.reshape(-1), gradient.reshape(-1),
                               scalar(learning_rate), scalar(momentum), node.use_nesterov)
        return variable

    def cases(self):
        rng = numpy.random.default_rng(4)
        out = []
        for dtype in (numpy.float32, numpy.float64):
            for nesterov in (False, True):
                arrays = [rng.standard_normal((33, 17)).astype(dtype) for _ in range(2)]
                arrays[2:2] = [0.05]
                arrays += [rng.standard_normal((33, 17)).astype(dtype), 0.9]
                out.append(((lambda n: lambda: ApplyMomentum(use_nesterov=n))(nesterov), arrays))
        return out


def _plain(a, w, dtype):
    """Whether a is a C-contiguous NumPy array of ``dtype`` and w's shape."""
    return isinstance(a, numpy.ndarray) and a.flags.c_contiguous and a.dtype == dtype and a.shape == w.shape


@register
class MultiApplyMomentumLoop(Kernel):
    op, backend = MultiApplyMomentum, "numpy"
    available, extra = ApplyMomentumLoop.available, ApplyMomentumLoop.extra

    def applies(self, node, variables, accumulations, learning_rate, gradients, momentum):
        variables, accumulations, gradients = arrays_of(variables), arrays_of(accumulations), arrays_of(gradients)
        if not (self.available and variables and len(variables) == len(accumulations) == len(gradients)):
            return False
        dtype = getattr(variables[0], "dtype", None)
        if dtype is None or dtype.char not in "fd":
            return False
        for w, v, g in zip(variables, accumulations, gradients):  # (a loop, not all() of a generator: per step)
            if not (_plain(w, w, dtype) and _plain(v, w, dtype) and _plain(g, w, dtype)):
                return False
        return True

    def forward(self, node, variables, accumulations, learning_rate, gradients, momentum):
        from . import updates_loops  # imports Numba: at the first call, not with minidl
        ws, vs, gs = arrays_of(variables), arrays_of(accumulations), arrays_of(gradients)
        scalar = ws[0].dtype.type
        lr, m = scalar(learning_rate), scalar(momentum)
        for w, v, g in zip(ws, vs, gs):
            updates_loops.momentum(w.reshape(-1), v.reshape(-1), g.reshape(-1), lr, m, node.use_nesterov)
        return variables

    def cases(self):
        # As flat argument lists (what the differential harness hands over): w1..wn, v1..vn, g1..gn,
        # compared through the updated w's and v's, end to end.
        rng = numpy.random.default_rng(5)
        shapes = [(33, 17), (7,), (300, 41)]
        out = []
        for dtype in (numpy.float32, numpy.float64):
            for nesterov in (False, True):
                arrays = [rng.standard_normal(s).astype(dtype) for _ in range(3) for s in shapes]
                out.append(((lambda n: lambda: _updated_state(n, len(shapes)))(nesterov), arrays))
        return out


def _updated_state(nesterov, n):
    """fn(w1..wn, v1..vn, g1..gn) -> the w's and v's after one MultiApplyMomentum, raveled end to end."""
    def run(*tensors):
        ws, vs, gs = tensors[:n], tensors[n:2 * n], tensors[2 * n:]
        MultiApplyMomentum(use_nesterov=nesterov)(ws, vs, 0.05, gs, 0.9)
        return Tensor(numpy.concatenate([t.asnumpy().ravel() for t in ws + vs]))
    return run
