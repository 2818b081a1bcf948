"""Mixed precision, as MindSpore 2.10's ``mindspore.amp``: loss scale managers (loss_scale.py).

    from minidl import amp, nn
    manager = amp.DynamicLossScaleManager()
    step = nn.TrainOneStepWithLossScaleCell(nn.WithLossCell(net, loss_fn), opt, manager.get_update_cell())
"""
from .loss_scale import LossScaleManager, FixedLossScaleManager, DynamicLossScaleManager

__all__ = ["LossScaleManager", "FixedLossScaleManager", "DynamicLossScaleManager"]
