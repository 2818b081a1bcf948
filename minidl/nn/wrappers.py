"""Cells that wrap a network, with MindSpore's names: ``WithLossCell`` joins a backbone and its loss.

``Model(nn.WithLossCell(net, loss_fn), None, optimizer)`` trains as ``Model(net, loss_fn,
optimizer)`` does, which is how MindSpore's tutorials that write their own loop or pass no
loss_fn build the network they differentiate.
"""
from .cell import Cell

__all__ = ["WithLossCell"]


class WithLossCell(Cell):
    """``construct(data, label)`` returns ``loss_fn(backbone(data), label)``.

    The wrapper adds no prefix (``auto_prefix=False``): the backbone's parameters keep their
    names, so a checkpoint of either loads into the other.

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
