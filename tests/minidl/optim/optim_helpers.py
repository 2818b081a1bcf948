"""What the optimizer tests share: named parameters and gradient sequences drawn from a seed."""
import functools

import numpy as np

from minidl import Parameter, Tensor


def _params(seed, names, shapes, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [Parameter(rng.normal(size=s).astype(dtype), name=n) for n, s in zip(names, shapes)]


def _grads(seed, steps, shapes, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [[rng.normal(size=s).astype(dtype) for s in shapes] for _ in range(steps)]


def makers(names, shapes):
    """(make_params(seed, dtype=float64), make_grads(seed, steps, dtype=float64)) for these parameters."""
    return (functools.partial(_params, names=names, shapes=shapes),
            functools.partial(_grads, shapes=shapes))


def run(opt, grads):
    """One optimizer step per list of gradient arrays."""
    for gs in grads:
        opt(tuple(Tensor(g) for g in gs))  # Tensors: on the parameters' device when the suite is pinned
