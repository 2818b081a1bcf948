"""Cells that wrap a network, with MindSpore's names: ``WithLossCell`` joins a backbone and its
loss, ``TrainOneStepCell`` makes one training step (forward, backward, gradient reduction,
optimizer) a Cell call.

``Model(nn.WithLossCell(net, loss_fn), None, optimizer)`` trains as ``Model(net, loss_fn,
optimizer)`` does, which is how MindSpore's tutorials that write their own loop or pass no
loss_fn build the network they differentiate. ``Model(nn.TrainOneStepCell(with_loss, optimizer))``
trains with the step cell as the whole training network, as MindSpore's Model does when given
neither loss_fn nor optimizer.

Gradient reduction uses the seam ``Model.train`` uses (minidl/runtime.py): the step cell asks
the active runtime for ``grad_reducer(weights)``, so under minidl_parallel's DATA_PARALLEL the
gradients are all-reduced with no user code, and minidl never imports minidl_parallel. The
question is asked at a step, not at construction (MindSpore decides in ``__init__``), so a cell
built before ``init()`` or before the mode is set reduces once they are.
"""
import math
import numbers
import os
import sys
import warnings
import weakref

from ..autograd import value_and_grad
from ..runtime import get_runtime
from ..tensor import Tensor
from .cell import Cell

__all__ = ["WithLossCell", "TrainOneStepCell"]


class WithLossCell(Cell):
    """``construct(data, label)`` returns ``loss_fn(backbone(data), label)``.

    The wrapper adds no prefix to the parameters' names (``auto_prefix=False``), as MindSpore's.
    A checkpoint stores the path from the saved cell, though (io/parameter_names.py), so one of
    the wrapper has ``_backbone.``-prefixed keys: save and load the backbone (MindSpore's keys are
    the names, interchangeable between the two).

    Args:
        backbone: the network, called with the data.
        loss_fn: called with the backbone's output and the label.

    Example:
        >>> net = nn.Dense(4, 3)
        >>> with_loss = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))
        >>> [p.name for p in with_loss.trainable_params()]
        ['weight', 'bias']
    """

    def __init__(self, backbone, loss_fn):
        super().__init__(auto_prefix=False)
        for name, value in (("backbone", backbone), ("loss_fn", loss_fn)):
            if not callable(value):
                raise TypeError(f"WithLossCell: {name} must be a Cell or a callable, got {type(value).__name__}")
        self._backbone = backbone
        self._loss_fn = loss_fn

    def construct(self, data, label):
        return self._loss_fn(self._backbone(data), label)

    @property
    def backbone_network(self):
        """The wrapped network (MindSpore's name)."""
        return self._backbone


# The folders of minidl and minidl_parallel (a path test: minidl never imports minidl_parallel).
_PACKAGES = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), name)
                  + os.sep for name in ("minidl", "minidl_parallel"))


def _stacklevel_outside_minidl():
    """The ``stacklevel`` that makes a warning our caller issues name the first frame outside minidl.

    A fixed count is wrong under any runtime but the local one: its ``call_cell`` adds frames
    between a Cell call and the user's line (minidl_parallel's, where the step's warning fires).
    """
    frame, level = sys._getframe(1), 1  # our caller: stacklevel 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGES):
        frame, level = frame.f_back, level + 1
    return level


def _no_reduction(grads):
    """The reducer of a step that has none (MindSpore's ``nn.Identity()`` in that place)."""
    return grads


class TrainOneStepCell(Cell):
    """One training step as a Cell: ``construct(*inputs)`` runs ``network(*inputs)`` (the loss),
    its gradients with respect to ``optimizer.parameters``, the gradient reducer and the
    optimizer, and returns the loss, as MindSpore's ``nn.TrainOneStepCell``.

    Args:
        network: a Cell returning the loss as a one-element Tensor (e.g. ``nn.WithLossCell``);
            it is called with every input of the step.
        optimizer: the Optimizer updating the network's parameters.
        sens: the gradient of the loss that backward starts from (a nonzero finite number):
            the gradients are ``sens`` times the loss's. None (default) means 1.0.
        return_grad: also return the gradients the optimizer received, as a dict parameter
            name -> Tensor: ``(loss, grads)``.

    Returns (of a call): the loss (a detached Tensor, computed before the update), or
    ``(loss, grads)`` with ``return_grad``; ``grads`` is None on a step whose reducer only
    accumulated gradients (``grad_accumulation_step`` > 1), where the optimizer did not run.

    Gradient reducer: asked of the active runtime (``get_runtime().grad_reducer(weights)``,
    the seam ``Model.train`` uses) at the first step, and again whenever the runtime that places
    the work, its world size, or whether its steps communicate or intercept ops changes (a cell
    built before ``init()``, then trained in the world, reduces from its first step there).
    Under minidl_parallel's DATA_PARALLEL it is a ``DistributedGradReducer`` with the context's
    ``gradients_mean``; on one device and in the tensor-parallel modes (whose ops communicate
    themselves) there is none. A reducer asking for ``parameter_broadcast`` broadcasts rank 0's
    parameters and optimizer state at the first step it is used, as ``Model.train`` does at its
    start. ``grad_reducer = reducer`` sets one explicitly (None: the runtime's again).

    The network runs once per step: the returned loss is the value backward started from.

    Example:
        >>> train_net = nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), nn.Momentum(net.trainable_params(), 0.1, 0.9))
        >>> train_net.set_train()
        >>> loss = train_net(data, label)
    """

    def __init__(self, network, optimizer, sens=None, return_grad=False):
        super().__init__(auto_prefix=False)
        if not isinstance(network, Cell):
            raise TypeError(f"TrainOneStepCell: network must be a Cell returning the loss (e.g. "
                            f"nn.WithLossCell(net, loss_fn)), got {type(network).__name__}")
        if not (callable(optimizer) and isinstance(getattr(optimizer, "parameters", None), tuple)):
            raise TypeError(f"TrainOneStepCell: optimizer must be an Optimizer (e.g. nn.Momentum(net.trainable_params(), "
                            f"0.1, 0.9)), got {type(optimizer).__name__}")
        if sens is not None:
            if isinstance(sens, bool) or not isinstance(sens, numbers.Real):
                raise TypeError(f"TrainOneStepCell: sens must be a number (the gradient of the loss backward starts "
                                f"from) or None (1.0), got {type(sens).__name__} {sens!r}")
            if sens == 0:
                raise ValueError(f"TrainOneStepCell: sens must not be 0 (every gradient would be 0), got {sens!r}")
            if not math.isfinite(sens):
                raise ValueError(f"TrainOneStepCell: sens must be finite, got {sens!r}")
        if not isinstance(return_grad, bool):
            raise TypeError(f"TrainOneStepCell: return_grad must be a bool, got {return_grad!r}")
        self._given_reducer = None
        self._resolved = None  # [weakref to the placing runtime, its shape, reducer, broadcast still due]
        self.network = network
        self.optimizer = optimizer  # not a Cell in minidl: its state is not among this cell's parameters
        self.weights = optimizer.parameters
        self.sense_flag = sens is not None  # MindSpore's name: whether a sens was given
        self.sens = 1.0 if sens is None else sens
        self.return_grad = return_grad
        self.weights_name = [p.name for p in self.weights]

    # ---- the gradient reducer ----------------------------------------------------------------

    @property
    def grad_reducer(self):
        """The reducer the next step uses: ``grads -> grads`` (an identity when there is none)."""
        reducer = self._reducer()
        return _no_reduction if reducer is None else reducer

    @grad_reducer.setter
    def grad_reducer(self, reducer):
        if reducer is not None and not callable(reducer):
            raise TypeError(f"TrainOneStepCell: grad_reducer must be callable (grads -> grads) or None (the "
                            f"runtime's), got {type(reducer).__name__}")
        self._given_reducer = reducer

    @property
    def reducer_flag(self):
        """Whether the next step reduces gradients across ranks (MindSpore's name)."""
        return self._reducer() is not None

    def _reducer(self):
        """The given reducer, else the active runtime's for the weights (asked again when the runtime changes)."""
        if self._given_reducer is not None:
            return self._given_reducer
        runtime = get_runtime()
        placing = runtime.placing
        # What a runtime can change between two steps without being replaced. Asking for a new
        # reducer every step would cost an agreement check per step and drop what a reducer
        # keeps between steps (accumulated gradients).
        shape = (placing.group_size(), placing.trains_in_lockstep(), bool(placing.intercepts_ops))
        resolved = self._resolved
        if resolved is not None and resolved[0]() is placing and resolved[1] == shape:
            return resolved[2]
        reducer = runtime.grad_reducer(self.weights)
        if reducer is not None and not callable(reducer):
            raise TypeError(f"TrainOneStepCell: the runtime's grad reducer must be callable (grads -> grads), got "
                            f"{type(reducer).__name__}")
        self._resolved = [weakref.ref(placing), shape, reducer, bool(getattr(reducer, "parameter_broadcast", False))]
        return reducer

    def _broadcast_if_due(self):
        """Rank 0's parameters and optimizer state on every rank, once per reducer asking for it."""
        resolved = self._resolved
        if self._given_reducer is not None or resolved is None or not resolved[3]:
            return
        reducer = resolved[2]
        broadcast = getattr(reducer, "broadcast_parameters", None)
        if not callable(broadcast):
            raise TypeError(f"TrainOneStepCell: the grad reducer asks for parameter_broadcast but has no "
                            f"broadcast_parameters(tensors) method ({type(reducer).__name__})")
        broadcast([p for _, p in self.network.parameters_and_names()]
                  + [p for _, p in self.optimizer.parameters_and_names()])
        resolved[3] = False

    # ---- the step ----------------------------------------------------------------------------

    def _loss_of(self, out):
        if not isinstance(out, Tensor) or out.size != 1:
            what = (f"{type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list))
                    else f"shape {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__)
            raise ValueError(f"TrainOneStepCell: the network must return the loss as a one-element Tensor, got "
                             f"{what}; wrap the backbone with nn.WithLossCell(net, loss_fn) (reduction 'mean' or 'sum')")
        return out

    def _forward(self, *inputs):
        return self._loss_of(self.network(*inputs))

    def _scaled_forward(self, *inputs):
        # Backward of loss * sens starts the network's backward from sens, exactly MindSpore's
        # fill(sens) (the product's gradient is 1 * sens); the unscaled loss rides as aux.
        loss = self._loss_of(self.network(*inputs))
        return loss * self.sens, loss

    def _gradients(self, inputs, reducer, scaled_forward=None, unscale=None):
        """(loss, reduced gradients or None): backward, with the reducer fed gradient by gradient
        when it can overlap (``ready``/``finish``, as Model.train does), else called once after.

        ``scaled_forward`` (returning (scaled loss, loss)) replaces the sens path, and ``unscale``
        (array -> array) is applied to each gradient before the reducer sees it (the loss-scale step).
        """
        with_aux = self.sense_flag or scaled_forward is not None
        forward = scaled_forward or (self._scaled_forward if self.sense_flag else self._forward)
        prepare = unscale or (lambda grad: grad)
        overlaps = callable(getattr(reducer, "ready", None)) and callable(getattr(reducer, "finish", None))
        fired = []

        def on_grad_ready(index, grad):
            fired.append(index)
            reducer.ready(index, None if grad is None else prepare(grad))

        grad_fn = value_and_grad(forward, None, self.weights, has_aux=with_aux,
                                 on_grad_ready=on_grad_ready if overlaps else None)
        value, grads = grad_fn(*inputs)
        loss = value[1] if with_aux else value
        if overlaps:
            # A loss that reaches no parameter fires nothing: reduce the (zero) gradients as a
            # whole so every rank still runs the same collectives.
            grads = reducer.finish() if fired else reducer(tuple(map(prepare, grads)))
        else:
            grads = tuple(map(prepare, grads)) if unscale is not None else grads
            if reducer is not None:
                grads = reducer(grads)
        return loss.detach(), grads

    def construct(self, *inputs):
        reducer = self._reducer()
        self._broadcast_if_due()
        loss, grads = self._gradients(inputs, reducer)
        if grads is not None:  # None: the reducer only accumulated; the optimizer waits
            overflowed = getattr(reducer, "overflowed", None)
            if overflowed is not None and overflowed():
                warnings.warn("TrainOneStepCell: the reduced gradients hold inf or NaN (a compressed 16-bit sum out "
                              "of range, or a non-finite gradient on some rank); the optimizer skips this step",
                              RuntimeWarning, stacklevel=_stacklevel_outside_minidl())
            else:
                self.optimizer(grads)
        if self.return_grad:
            return loss, None if grads is None else dict(zip(self.weights_name, grads))
        return loss
