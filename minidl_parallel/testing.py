"""Checking tensor parallelism against one device: a chain-of-operators network and its two runs.

The central property of operator-level parallelism is that, for any valid strategies, the
sharded run computes what one device computes. This module builds a network from a plain
description (a list of layer dicts, so hypothesis can draw it and an mpirun script can
receive it), runs it on one device, and runs it as one rank of a (semi-)auto parallel world,
gathering every result to full arrays so the two runs can be compared.

Layers (``h`` is the running activation, 2-d ``(batch, features)``):
    {"op": "matmul", "out": m, "transpose_b": bool, "strategy": ((b, k), (k, n)) or None}
    {"op": "bias", "strategy": ((b, d), (d,)) or None}
    {"op": "unary", "fn": "relu" | "tanh" | "sigmoid" | "exp" | "neg" | "square" | "gelu" | "gelu_tanh" | "silu"
           | "leaky_relu", "strategy": ((b, d),) or None}
    {"op": "layernorm", "strategy": ((b, 1), (1,), (1,)) or None}   over the features, with gamma and beta
    {"op": "clamp", "strategy": ((b, d),) or None}                   clamped to [-0.5, 0.5]
    {"op": "cumsum", "reverse": bool, "strategy": ((b, 1),) or None} along the features
    {"op": "mul", "strategy": ((b, d), (b, d)) or None}              h * h
    {"op": "softmax", "log": bool, "strategy": ((b, d),) or None}
    {"op": "transpose", "strategy": ((b, d),) or None}               transposed and back
    {"op": "reshape", "strategy": ((b, d),) or None}                 (B, D) -> (B, D/2, 2) -> (B, D)
    {"op": "dropout", "keep": p, "strategy": ((b, d),) or None}      masks from the framework seed
Loss: {"loss": "mse" | "sum" | "ce", "strategy": strategy of its main op or None}.

Example:
    >>> layers = [{"op": "matmul", "out": 8, "strategy": ((2, 2), (2, 1))}, {"op": "unary", "fn": "relu"}]
    >>> ref = run_single(layers, {"loss": "mse"}, data)
    >>> got = run_threads(4, run_rank, layers, {"loss": "mse"}, data, "auto_parallel")
"""
import numpy as np

import minidl
from minidl import nn, ops, Parameter, Tensor

__all__ = ["ChainNet", "ChainLoss", "init_arrays", "run_single", "run_rank", "compare_runs"]

_UNARY = {"relu": ops.ReLU, "tanh": ops.Tanh, "sigmoid": ops.Sigmoid, "exp": ops.Exp, "neg": ops.Neg,
          "square": ops.Square, "gelu": lambda: ops.GeLU(approximate="none"), "gelu_tanh": ops.GeLU,
          "silu": ops.SiLU, "leaky_relu": lambda: ops.LeakyReLU(0.1)}


def _shard(prim, strategy):
    return prim.shard(strategy) if strategy is not None else prim


class _Layer(nn.Cell):
    def __init__(self, spec, features, arrays, index):
        super().__init__()
        self.kind = spec["op"]
        s = spec.get("strategy")
        if self.kind == "matmul":
            self.weight = Parameter(arrays[f"w{index}"].copy(), name=f"w{index}")  # updates are in place
            self.prim = _shard(ops.MatMul(transpose_b=spec.get("transpose_b", False)), s)
        elif self.kind == "bias":
            self.bias = Parameter(arrays[f"b{index}"].copy(), name=f"b{index}")
            self.prim = _shard(ops.Add(), s)
        elif self.kind == "unary":
            self.prim = _shard(_UNARY[spec["fn"]](), s)
        elif self.kind == "mul":
            self.prim = _shard(ops.Mul(), s)
        elif self.kind == "layernorm":
            self.gamma = Parameter(arrays[f"g{index}"].copy(), name=f"g{index}")
            self.beta = Parameter(arrays[f"be{index}"].copy(), name=f"be{index}")
            self.prim = _shard(ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=1e-5), s)
        elif self.kind == "clamp":
            self.prim = _shard(ops.Clamp(), s)
        elif self.kind == "cumsum":
            self.prim = _shard(ops.CumSum(reverse=spec.get("reverse", False)), s)
        elif self.kind == "softmax":
            self.prim = _shard((ops.LogSoftmax if spec.get("log") else ops.Softmax)(axis=-1), s)
        elif self.kind == "transpose":
            self.prim = _shard(ops.Transpose(), s)
            self.back = ops.Transpose()
        elif self.kind == "reshape":
            self.prim = _shard(ops.Reshape(), s)
            self.back = ops.Reshape()
        elif self.kind == "dropout":
            self.prim = _shard(ops.Dropout(keep_prob=spec.get("keep", 0.7)), s)
        else:
            raise ValueError(f"ChainNet: unknown layer op {self.kind!r}")

    def construct(self, h):
        if self.kind == "matmul":
            return self.prim(h, self.weight)
        if self.kind == "bias":
            return self.prim(h, self.bias)
        if self.kind == "mul":
            return self.prim(h, h)
        if self.kind == "layernorm":
            return self.prim(h, self.gamma, self.beta)
        if self.kind == "clamp":
            return self.prim(h, -0.5, 0.5)
        if self.kind == "cumsum":
            return self.prim(h, 1)
        if self.kind == "transpose":
            return self.back(self.prim(h, (1, 0)), (1, 0))
        if self.kind == "reshape":
            b, d = self.shape
            return self.back(self.prim(h, (b, d // 2, 2)), (b, d))
        return self.prim(h)


def layer_shapes(layers, batch, features):
    """(input features of each layer, output features of the chain)."""
    dims = []
    for spec in layers:
        dims.append(features)
        if spec["op"] == "matmul":
            features = spec["out"]
    return dims, features


def init_arrays(layers, features, seed=0, dtype=np.float64):
    """The parameters' initial values (the same for both runs)."""
    rng = np.random.default_rng(seed)
    arrays = {}
    dims, _ = layer_shapes(layers, 0, features)
    for i, (spec, d) in enumerate(zip(layers, dims)):
        if spec["op"] == "matmul":
            shape = (spec["out"], d) if spec.get("transpose_b") else (d, spec["out"])
            arrays[f"w{i}"] = (rng.standard_normal(shape) / np.sqrt(d)).astype(dtype)
        elif spec["op"] == "bias":
            arrays[f"b{i}"] = rng.standard_normal(d).astype(dtype)
        elif spec["op"] == "layernorm":
            arrays[f"g{i}"] = (1 + 0.1 * rng.standard_normal(d)).astype(dtype)
            arrays[f"be{i}"] = (0.1 * rng.standard_normal(d)).astype(dtype)
    return arrays


class ChainNet(nn.Cell):
    """The network a layer list describes."""

    def __init__(self, layers, batch, features, arrays):
        super().__init__()
        dims, _ = layer_shapes(layers, batch, features)
        self.layers = nn.CellList([_Layer(spec, d, arrays, i) for i, (spec, d) in enumerate(zip(layers, dims))])
        for layer, d in zip(self.layers, dims):
            layer.shape = (batch, d)

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class ChainLoss(nn.Cell):
    """net, then the loss; returns (loss, net output) so both can be compared."""

    def __init__(self, net, loss):
        super().__init__(auto_prefix=False)
        self.net = net
        self.kind = loss["loss"]
        s = loss.get("strategy")
        if self.kind == "mse":
            self.sub = _shard(ops.Sub(), s)
            self.square = ops.Square()
            self.mean = ops.ReduceMean()
        elif self.kind == "sum":
            self.mul = _shard(ops.Mul(), s)
            self.total = ops.ReduceSum()
        elif self.kind == "ce":
            self.ce = _shard(ops.SoftmaxCrossEntropyWithLogits(), s)
            self.mean = ops.ReduceMean()
        else:
            raise ValueError(f"ChainLoss: unknown loss {self.kind!r}")

    def construct(self, x, y):
        h = self.net(x)
        if self.kind == "mse":
            loss = self.mean(self.square(self.sub(h, y)))
        elif self.kind == "sum":
            loss = self.total(self.mul(h, y))
        else:
            loss = self.mean(self.ce(h, y))
        return loss, h


def _train(layers, loss, data, steps, lr, gather, x_layout_of):
    minidl.set_seed(data.get("seed", 0))  # the same dropout masks in both runs (the seed is per thread)
    x_np, y_np = data["x"], data["y"]
    net = ChainNet(layers, data["batch"], data["features"], data["arrays"])
    cell = ChainLoss(net, loss)
    params = net.trainable_params()
    opt = nn.Momentum(params, learning_rate=lr, momentum=0.9) if params else (lambda grads: None)
    grad_fn = minidl.value_and_grad(cell, grad_position=0, weights=params, has_aux=True)
    out = {}
    for step in range(steps):
        x = Tensor(x_np, requires_grad=True)
        (value, h), (gx, gparams) = grad_fn(x, Tensor(y_np))
        if step == 0:
            out["loss"] = float(gather(value))
            out["output"] = gather(h)
            out["grad_x"] = x_layout_of(x, gx)
            out["grads"] = {p.name: gather(g, like=p) for p, g in zip(params, gparams)}
        out.setdefault("losses", []).append(float(gather(value)))
        opt(gparams)
    out["params"] = {p.name: gather(p) for p in params}
    return out


def run_single(layers, loss, data, steps=2, lr=0.05):
    """One device: loss, output, input and parameter gradients of step 1, parameters after ``steps``."""
    def gather(t, like=None):
        return np.array(t.asnumpy())
    return _train(layers, loss, data, steps, lr, gather, lambda x, gx: np.array(gx.asnumpy()))


def run_rank(layers, loss, data, mode="auto_parallel", steps=2, lr=0.05, dataset_strategy="data_parallel"):
    """One rank of a parallel world (inside run_threads or mpirun, after init): the same results, gathered."""
    import minidl_parallel as mp
    from minidl_parallel.tensor_parallel.dispatch import full_value, gather_like
    from minidl_parallel.tensor_parallel.tensors import tag_input

    mp.set_auto_parallel_context(parallel_mode=mode, dataset_strategy=dataset_strategy)
    n, rank = mp.get_group_size(), mp.get_rank()
    local = dict(data)
    if dataset_strategy == "data_parallel":
        b = data["batch"] // n
        local["x"] = data["x"][rank * b:(rank + 1) * b]
        local["y"] = data["y"][rank * b:(rank + 1) * b]

    def gather(t, like=None):
        return np.array(minidl.backend.to_numpy(gather_like(t, like) if like is not None else full_value(t)))
    def grad_x(x, gx):
        tag_input(x, dataset_strategy, n)  # value_and_grad differentiated a copy of x: x may be untagged
        return gather(gx, like=x)
    out = _train(layers, loss, local, steps, lr, gather, grad_x)
    mp.reset_auto_parallel_context()
    return out


def compare_runs(got, ref, rtol=1e-10, atol=1e-12, relative_to_max=False):
    """Asserts that a rank's gathered results equal the single-device ones.

    With ``relative_to_max`` (float32) an element may also differ by ``rtol`` times the largest
    magnitude of its array: sums taken in another order round differently, by about the
    unit roundoff of the largest terms, not of each result.

    A reference that is not finite (an overflow, a NaN) proves nothing: an infinite reference
    would make that tolerance infinite, and ``assert_allclose`` counts matching infs and NaNs
    as equal. Such an example is rejected: ``hypothesis.assume(False)`` inside a hypothesis
    test (it draws another), a ValueError otherwise.
    """
    for name, value in (("rtol", rtol), ("atol", atol)):
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"compare_runs: {name} must be a finite number >= 0, got {value!r}")

    def close(a, b, what):
        b = np.asarray(b)
        _require_finite(b, what)
        tol = max(atol, rtol * float(np.abs(b).max())) if relative_to_max and b.size else atol
        if not np.isfinite(tol):  # a finite reference and rtol: only rtol * max|reference| can overflow
            raise ValueError(f"compare_runs: the tolerance of the {what}, rtol {rtol} times its largest magnitude, "
                             f"overflows")
        np.testing.assert_allclose(a, b, rtol=rtol, atol=tol, err_msg=what)
    close(got["losses"], ref["losses"], "losses")
    close(got["output"], ref["output"], "output")
    close(got["grad_x"], ref["grad_x"], "input gradient")
    for name in ref["grads"]:
        close(got["grads"][name], ref["grads"][name], f"gradient of {name}")
        close(got["params"][name], ref["params"][name], f"parameter {name} after the steps")


def _require_finite(ref, what):
    """Rejects a reference with an inf or a NaN (see compare_runs)."""
    if np.isfinite(ref).all():
        return
    bad = int(ref.size - np.count_nonzero(np.isfinite(ref)))
    message = (f"compare_runs: the single-device {what} is not finite ({bad} of {ref.size} values are inf or NaN); "
               f"a reference that overflowed cannot judge the parallel run")
    try:
        import hypothesis  # a test dependency: imported only here
    except ImportError:
        raise ValueError(message) from None
    if hypothesis.currently_in_test_context():
        hypothesis.assume(False)  # hypothesis drops this example and draws another
    raise ValueError(message)
