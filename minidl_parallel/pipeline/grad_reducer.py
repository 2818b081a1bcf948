"""``nn.PipelineGradReducer``: MindSpore's last step of a pipeline's gradients before the optimizer.

In MindSpore the micro-batches' gradients are accumulated in the compiled graph, and this cell hands
them to the optimizer divided by the loss scale (``scale_sense``). In minidl the pipeline step
(PipelineCell) has already summed them over the micro-batches, so this divides by ``scale_sense``
and nothing else: a script written for MindSpore's functional training loop runs unchanged.
"""
import math

from minidl.nn import Cell
from minidl.tensor import Parameter, Tensor

__all__ = ["PipelineGradReducer"]


class PipelineGradReducer(Cell):
    """The pipeline's gradients for the optimizer: ``grads`` divided by ``scale_sense``.

    Args:
        parameters: the optimizer's parameters (one gradient each is expected).
        scale_sense: the loss scale the gradients carry (a finite number > 0, or a one-element
            Tensor); default 1.0, which returns the gradients as they are.
        opt_shard: optimizer parallelism with a pipeline; only None or False (not built in minidl).
    """

    def __init__(self, parameters, scale_sense=1.0, opt_shard=None):
        super().__init__(auto_prefix=False)
        params = tuple(parameters)
        bad = [type(p).__name__ for p in params if not isinstance(p, Parameter)]
        if bad:
            raise TypeError(f"PipelineGradReducer: parameters must be Parameters (optimizer.parameters), got {bad}")
        if opt_shard:
            raise NotImplementedError("PipelineGradReducer: opt_shard=True (optimizer parallelism inside a pipeline) "
                                      "is not built in minidl; pass opt_shard=None or False")
        self._count = len(params)
        self.scale_sense = _scale(scale_sense)

    def construct(self, grads):
        grads = tuple(grads)
        if len(grads) != self._count:
            raise ValueError(f"PipelineGradReducer: got {len(grads)} gradients for its {self._count} parameters")
        if self.scale_sense == 1.0:
            return grads
        return tuple(g / self.scale_sense for g in grads)


def _scale(value):
    if isinstance(value, Tensor):
        if value.size != 1:
            raise ValueError(f"PipelineGradReducer: scale_sense must be one number, got a Tensor of shape "
                             f"{tuple(value.shape)}")
        value = float(value.asnumpy().reshape(()))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"PipelineGradReducer: scale_sense must be a finite number > 0, got {value!r}")
    return float(value)
