"""ApplyMomentum in one pass, compiled by Numba (optional: ``minidl[numba]``).

The reference (minidl/ops/updates.py) makes four NumPy passes over a parameter (accumulation
scaled, gradient added, the step, the subtraction) and a temporary; for the MLP's 670k
parameters that was 14% of its training step (benchmarks/profile_step.py --model mlp). One loop
(team_jobs.py's ``_momentum``) reads each element of the variable, accumulation and gradient
once and writes the first two, in the reference's order of operations per element (no FMA
contraction): bit for bit the reference. A large parameter's pass runs on MKL's OpenMP team
(team.py), elementwise, so also bit for bit. Numba is imported at the first call, not with minidl.
"""
import importlib.util

import numpy

from ...ops.updates import ApplyMomentum
from .. import Kernel, register
from . import team

__all__ = ["ApplyMomentumLoop"]


@register
class ApplyMomentumLoop(Kernel):
    op, backend = ApplyMomentum, "numpy"
    available = importlib.util.find_spec("numba") is not None  # else the reference runs (the tests skip its cases)

    def applies(self, node, variable, accumulation, learning_rate, gradient, momentum, scratch=None):
        arrays = (variable, accumulation, gradient)
        return (self.available and node.gradient_scale == 1.0
                and all(isinstance(a, numpy.ndarray) and a.flags.c_contiguous for a in arrays)
                and variable.dtype == accumulation.dtype == gradient.dtype and variable.dtype.char in "fd"
                and variable.shape == accumulation.shape == gradient.shape)

    def forward(self, node, variable, accumulation, learning_rate, gradient, momentum, scratch=None):
        team_jobs = team.jobs()
        w, v, g = variable.reshape(-1), accumulation.reshape(-1), gradient.reshape(-1)
        threads = team.threads(w.nbytes)
        if threads > 1:
            team.run(team_jobs.momentum_job,
                     team_jobs.momentum_header(w, v, g, learning_rate, momentum, node.use_nesterov), threads)
        else:
            scalar = variable.dtype.type  # NumPy takes a Python number as the arrays' dtype (NEP 50)
            team_jobs.momentum(w, v, g, scalar(learning_rate), scalar(momentum), node.use_nesterov)
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
