"""A few Momentum steps of an MSE-trained network, gathered whole: the training loop that the
tensor-parallel equivalence tests run once on one device and once per rank."""
import numpy as np

import minidl
from minidl import Tensor, nn


def host(array):
    """A NumPy copy of a gathered value, from either array module (the suite also runs pinned to the GPU)."""
    return np.array(minidl.backend.to_numpy(array))


def momentum_steps(net, x, y, steps):
    """Trains ``net`` for ``steps`` Momentum steps on (x, y); returns (losses, output of step 1,
    every parameter and statistic by name), each gathered to its whole value."""
    from minidl_parallel.tensor_parallel.dispatch import full_value
    loss_fn = nn.MSELoss()
    params = net.trainable_params()
    opt = nn.Momentum(params, 0.05, 0.9)

    def forward(a, b):
        out = net(a)
        return loss_fn(out, b), out
    grad_fn = minidl.value_and_grad(forward, None, params, has_aux=True)
    losses, first = [], None
    for _ in range(steps):
        (loss, out), grads = grad_fn(Tensor(x), Tensor(y))
        losses.append(float(loss.asnumpy()))
        first = host(full_value(out)) if first is None else first
        opt(grads)
    return losses, first, {name: host(full_value(p)) for name, p in net.parameters_and_names()}
