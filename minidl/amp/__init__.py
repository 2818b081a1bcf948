"""Mixed precision, as MindSpore 2.10's ``mindspore.amp``: loss scale managers (loss_scale.py) and
``auto_mixed_precision`` (auto.py).

    from minidl import amp, nn
    manager = amp.DynamicLossScaleManager()
    net = amp.auto_mixed_precision(net, "O2")       # float16 compute, float32 master weights
    step = nn.TrainOneStepWithLossScaleCell(nn.WithLossCell(net, loss_fn), opt, manager.get_update_cell())
"""
from .loss_scale import LossScaleManager, FixedLossScaleManager, DynamicLossScaleManager
from .auto import auto_mixed_precision, get_black_list

__all__ = ["LossScaleManager", "FixedLossScaleManager", "DynamicLossScaleManager", "auto_mixed_precision",
           "get_black_list"]
