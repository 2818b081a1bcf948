"""The reverse-mode engine: topological sort, a reversed loop, gradients summed per tensor.

A recorded op node (a Primitive instance, see ops/primitive.py) carries
``inputs``: a tuple of (argument position, Tensor) for the arguments that need a gradient,
and ``backward(gy)``, which returns one gradient (or None) per positional argument.

As in PyTorch, a backward pass frees the graph it went through unless ``retain_graph=True``:
each node drops what it saved for backward (arrays, ``inputs``, an instance ``backward``)
once it has run, so activations go back to the allocator during backward and a loss kept
for logging holds no more than its own value. A second backward through a freed node raises.
"""
import functools

import numpy

from .runtime import get_runtime
from .tensor import Tensor, Parameter

_FREED_MESSAGE = ("Trying to backward through the graph a second time (or directly access saved tensors after "
                  "they have already been freed). Saved intermediate values of the graph are freed when you call "
                  ".backward(), value_and_grad or grad. Specify retain_graph=True if you need to backward through "
                  "the graph a second time.")
# What a freed node keeps: its configuration (axis, transpose_b, dtype, strategies...), so that
# it still prints. Anything else (arrays, tensors, closures, lists) was saved for backward.
_CONFIG_TYPES = (bool, int, float, complex, str, bytes, type, numpy.dtype)
_PLAIN_CONFIG = frozenset((type(None), bool, int, float, str))  # the exact types most values have: no isinstance
# The exact types of what forward saves (never configuration): dropped without _is_config's checks.
_SAVED_TYPES = frozenset((numpy.ndarray, list, dict, functools.partial, Tensor, Parameter))


class _FreedInputs(tuple):
    """The ``inputs`` of a freed node: empty, and recognisable (a node called again as an op
    gets fresh ``inputs`` from ``Primitive.apply``, so the mark cannot outlive the graph)."""

    __slots__ = ()


_FREED = _FreedInputs()


def _is_config(value):
    if value is None or isinstance(value, _CONFIG_TYPES):
        return True
    return type(value) is tuple and all(_is_config(v) for v in value)


def _release(node):
    """Frees what node saved for backward; later backward passes through it raise RuntimeError."""
    d = node.__dict__
    # (inputs is replaced below; checked first: it is the one tuple every node has, and long.)
    for key in [k for k, v in d.items() if k != "inputs" and type(v) not in _PLAIN_CONFIG
                and (type(v) in _SAVED_TYPES or not _is_config(v))]:
        del d[key]  # also an instance ``backward`` (minidl_parallel wraps nodes' backward so)
    d["inputs"] = _FREED


def _toposort(root):
    """Tensors that lead to root, producers before consumers (iterative: deep nets are fine)."""
    order, seen = [], set()
    stack = [(root, False)]
    while stack:
        t, expanded = stack.pop()
        if expanded:
            order.append(t)
            continue
        if id(t) in seen:
            continue
        seen.add(id(t))
        stack.append((t, True))
        node = t._node
        if node is not None:
            if node.inputs is _FREED:
                raise RuntimeError(f"backward: {_FREED_MESSAGE} (the freed node: {type(node).__name__})")
            # Leaves go under the op parents on the stack, so each is appended after every
            # chain below it: in the reversed loop it comes right after its last consumer,
            # and on_leaf_ready fires while the rest of backward still runs.
            parents = [p for _, p in node.inputs if id(p) not in seen]
            for parent in sorted(parents, key=lambda p: p._node is not None):
                stack.append((parent, False))
    return order


def run_backward(root, gy, targets=None, on_leaf_ready=None, retain_graph=False):
    """Propagates gy from root and returns {id(tensor): gradient array}.

    Args:
        root: the Tensor whose gradient is gy.
        gy: ndarray of root's shape.
        targets: tensors whose gradients are wanted; None means every leaf that requires
            grad (those are returned). Gradients of intermediates are dropped once used.
        on_leaf_ready: optional ``fn(tensor, grad)`` called as soon as a wanted leaf's
            gradient is final, while the rest of backward still runs (data-parallel
            reducers start their all-reduce buckets from here).
        retain_graph: keep every node's saved state, so that the graph can be differentiated
            again; by default each node is freed once its backward has run.

    Raises:
        RuntimeError: the graph was freed by an earlier backward pass (nothing is computed).
    """
    root.data  # noqa: B018 - a pending root (GRAPH_MODE) is computed first: its op makes its node
    grads = {id(root): gy}
    owned = set()  # ids whose gradient array we allocated, so += may write into it
    wanted = None if targets is None else {id(t) for t in targets}
    leaves = {}
    for t in reversed(_toposort(root)):
        g = grads.get(id(t))
        node = t._node
        if g is None:
            if node is not None and not retain_graph:
                _release(node)  # part of the graph, though no gradient reached it
            continue
        if node is None:
            if t.requires_grad and (wanted is None or id(t) in wanted):
                # Reversed topological order visits a leaf after every op that uses it,
                # so its gradient is complete here.
                g = _owned_array(g)
                leaves[id(t)] = (t, g)
                if on_leaf_ready is not None:
                    on_leaf_ready(t, g)
            continue
        if wanted is None or id(t) not in wanted:
            del grads[id(t)]
        in_grads = node.backward(g)
        inputs = node.inputs
        if not retain_graph:
            _release(node)
        for position, parent in inputs:
            gx = in_grads[position]
            if gx is None:
                continue
            # (A parameter held as one rank's rows between uses, optimizer parallelism's level3,
            # gets the gradient of what the rows were cut from: its placement's ``block``, or the
            # whole tensor; the reducer cuts it.)
            if gx.shape != parent.data.shape and (parent.placement is None or gx.shape != getattr(
                    parent.placement, "block", parent.shape)):
                raise RuntimeError(f"{type(node).__name__}.backward returned a gradient of shape "
                                   f"{tuple(gx.shape)} for an input of shape {parent.shape}")
            key = id(parent)
            prev = grads.get(key)
            if prev is None:
                grads[key] = gx
            elif key in owned:
                prev += gx  # in-place accumulation: this buffer is ours
                grads[key] = prev  # (0-d numpy arithmetic gives scalars, which += rebinds)
            else:
                grads[key] = prev + gx
                owned.add(key)
    result = {k: g for k, (t, g) in leaves.items()}
    if wanted is not None:
        for k in wanted:
            if k in grads and k not in result:
                result[k] = _owned_array(grads[k])
    return result, leaves


def _owned_array(g):
    """A gradient users may keep and write: an ndarray, contiguous and writeable.

    Backward rules may return broadcast views of gy (sum, mean) or NumPy scalars (0-d
    arithmetic); optimizers, reducers and MPI buffers need real, writeable memory.
    """
    if type(g) is numpy.ndarray and g.flags.c_contiguous and g.flags.writeable:
        return g  # the common case, checked first: this runs for every parameter on every step
    from .backend import get_array_module
    xp = get_array_module(g)
    if not isinstance(g, xp.ndarray):
        return xp.asarray(g)
    if not g.flags.c_contiguous or not getattr(g.flags, "writeable", True):
        return xp.ascontiguousarray(g) if g.flags.c_contiguous is False else g.copy()
    return g


def _root_gradient(root, gradient, who):
    xp_data = root.data
    if gradient is None:
        if xp_data.size != 1:
            raise RuntimeError(f"{who}: a gradient can be created implicitly only for a one-element "
                               f"output, got shape {root.shape}; pass gradient=")
        return _ones_like(xp_data)
    g = gradient.data if isinstance(gradient, Tensor) else gradient
    from . import backend
    g = backend.to_device(g, backend.get_array_module(xp_data)).astype(xp_data.dtype, copy=False)
    # The array's own shape: under tensor parallelism root.shape is the logical shape, and a
    # rank passes the gradient of its block.
    if tuple(g.shape) != tuple(xp_data.shape):
        raise ValueError(f"{who}: gradient of shape {tuple(g.shape)} does not match the output shape "
                         f"{tuple(xp_data.shape)}")
    return g


def _ones_like(a):
    from .backend import get_array_module
    return get_array_module(a).ones_like(a)


def backward(root, gradient=None, retain_graph=False):
    """Tensor.backward: accumulates into ``.grad`` of the leaves that require grad.

    The graph is freed on the way unless ``retain_graph`` (see ``run_backward``).
    """
    if not root.requires_grad:
        raise RuntimeError("backward: the tensor does not require grad and has no recorded graph; "
                           "did you compute it under no_grad() or from inputs with requires_grad=False?")
    gy = _root_gradient(root, gradient, "backward")
    _, leaves = run_backward(root, gy, retain_graph=retain_graph)
    for t, g in leaves.values():
        if t.grad is None:
            t.grad = Tensor._wrap(g if g is not gy else g.copy())
        else:
            t.grad = Tensor._wrap(t.grad.data + g)


def _normalise_positions(grad_position, n_args, who):
    if isinstance(grad_position, int) and not isinstance(grad_position, bool):
        positions = (grad_position,)
    elif isinstance(grad_position, (tuple, list)) and all(isinstance(p, int) for p in grad_position):
        positions = tuple(grad_position)
    else:
        raise TypeError(f"{who}: grad_position must be an int or a tuple of ints, got {grad_position!r}")
    for p in positions:
        if not -n_args <= p < n_args:
            raise IndexError(f"{who}: grad_position {p} is out of range for {n_args} positional argument(s)")
    return tuple(p % n_args for p in positions)


def value_and_grad(fn, grad_position=None, weights=None, has_aux=False, on_grad_ready=None):
    """Returns a function computing ``fn(*args)`` and its gradients, as MindSpore's.

    Args:
        fn: a function returning a scalar Tensor, or (scalar, *aux) when has_aux.
        grad_position: int or tuple of ints, the positional inputs to differentiate;
            None means 0 when weights is None, else no inputs.
        weights: a Parameter, or a list/tuple of them (``net.trainable_params()``).
        has_aux: fn returns (loss, aux...); only loss is differentiated.
        on_grad_ready: optional ``fn(index, grad_tensor)`` called during backward as soon as
            the gradient of ``weights[index]`` is final (an extension over MindSpore: it lets
            a data-parallel reducer overlap communication with the rest of backward).

    Returns:
        ``grad_fn(*args) -> (value, grads)``; grads is for the inputs, the weights, or
        ``(input_grads, weight_grads)`` when both are asked for. A single position gives a
        Tensor, a tuple of positions a tuple. The graph behind value is freed (as after
        ``Tensor.backward()``): value and aux keep their data, not the activations.

    Example:
        >>> grad_fn = value_and_grad(forward_fn, None, net.trainable_params(), has_aux=True)
        >>> (loss, logits), grads = grad_fn(x, y)
    """
    single_weight = isinstance(weights, Parameter)
    weight_list = None if weights is None else ([weights] if single_weight else list(weights))
    if weight_list is not None:
        for w in weight_list:
            if not isinstance(w, Tensor):
                raise TypeError(f"value_and_grad: weights must be Parameters, got {type(w).__name__}")
    if grad_position is None and weight_list is None:
        grad_position = 0

    def grad_fn(*args):
        positions = () if grad_position is None else _normalise_positions(grad_position, len(args), "value_and_grad")
        args = list(args)
        for p in positions:
            a = args[p]
            data = a.data if isinstance(a, Tensor) else Tensor(a).data
            args[p] = Tensor._wrap(data)
            args[p].requires_grad = True
        out = fn(*args)
        get_runtime().settle()  # GRAPH_MODE: a BatchNorm still deferred updates its moving statistics now
        if has_aux:
            if not isinstance(out, (tuple, list)) or len(out) < 2:
                raise TypeError("value_and_grad: has_aux=True needs fn to return (loss, aux, ...)")
            loss = out[0]
        else:
            loss = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(loss, Tensor):
            raise TypeError(f"value_and_grad: fn must return a Tensor loss, got {type(loss).__name__}")
        targets = [args[p] for p in positions] + (weight_list or [])
        if loss.requires_grad:
            gy = _root_gradient(loss, None, "value_and_grad")
            ready = None
            if on_grad_ready is not None and weight_list:
                index_of = {id(w): i for i, w in enumerate(weight_list)}
                ready = lambda t, g: on_grad_ready(index_of[id(t)], Tensor._wrap(g)) if id(t) in index_of else None
            grads, _ = run_backward(loss, gy, targets=targets, on_leaf_ready=ready)
        else:
            grads = {}
        xp_of = lambda t: t.data
        def grad_of(t):
            g = grads.get(id(t))
            if g is None:
                g = xp_of(t) * 0  # not reached by the loss: MindSpore returns zeros
            return Tensor._wrap(g)
        input_grads = tuple(grad_of(args[p]) for p in positions)
        if isinstance(grad_position, int) and not isinstance(grad_position, bool):
            input_grads = input_grads[0]
        weight_grads = None if weight_list is None else tuple(grad_of(w) for w in weight_list)
        if single_weight:
            weight_grads = weight_grads[0]
        value = tuple(out) if has_aux else out
        if grad_position is None:
            return value, weight_grads
        if weight_list is None:
            return value, input_grads
        return value, (input_grads, weight_grads)

    return grad_fn


def grad(fn, grad_position=None, weights=None, has_aux=False):
    """Like value_and_grad but returns only the gradients (and aux, when has_aux)."""
    vg = value_and_grad(fn, grad_position, weights, has_aux)

    def grad_fn(*args):
        value, grads = vg(*args)
        return (grads, tuple(value[1:])) if has_aux else grads
    return grad_fn
