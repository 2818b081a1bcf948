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


def assert_data_parallel_equals_one_device(make_opt, n=2, b=3, steps=3, after_wrap=None):
    """``make_opt(params)`` under Horovod's DistributedOptimizer on n thread-ranks, each on its b
    rows of every global batch, ends with the parameters of one device on the n*b rows (float64)."""
    import minidl
    from minidl import nn
    from minidl_parallel import DistributedOptimizer, run_threads, get_rank

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((n * b * steps, 3)), rng.standard_normal((n * b * steps, 2))
    loss_fn = nn.MSELoss(reduction="mean")

    def mlp():
        minidl.set_seed(0)
        return nn.SequentialCell(nn.Dense(3, 4, dtype=minidl.float64), nn.Tanh(), nn.Dense(4, 2, dtype=minidl.float64))

    def train(net, opt, rows):
        grad_fn = minidl.value_and_grad(lambda a, c: loss_fn(net(a), c), None, opt.parameters)
        for r in rows:
            _, grads = grad_fn(Tensor(x[r]), Tensor(y[r]))
            opt(grads)
        return [p.asnumpy() for p in net.trainable_params()]

    ref = mlp()
    want = train(ref, make_opt(ref.trainable_params()), [slice(s * n * b, (s + 1) * n * b) for s in range(steps)])

    def rank():
        r = get_rank()
        net = mlp()
        opt = DistributedOptimizer(make_opt(net.trainable_params()))
        if after_wrap is not None:
            after_wrap(opt)
        return train(net, opt, [slice(s * n * b + r * b, s * n * b + (r + 1) * b) for s in range(steps)])

    for got in run_threads(n, rank):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
