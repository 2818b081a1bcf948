"""What ``Model(..., amp_level=..., **kwargs)`` builds: MindSpore's ``amp.build_train_network`` rules.

``check_amp_arguments`` applies MindSpore's checks of Model's amp_level, boost_level and kwargs;
``amp_networks`` casts the network (``auto_mixed_precision``) and, when a loss scale manager is in
effect, wraps it in the step cell the manager asks for (minidl/train/model.py's module doc).
"""
from .. import nn
from .auto import _OutputTo32, auto_mixed_precision
from .loss_scale import DynamicLossScaleManager, LossScaleManager

__all__ = ["check_amp_arguments", "amp_networks"]

_AMP_LEVELS = ("O0", "O1", "O2", "O3", "auto")
_BOOST_LEVELS = ("O0", "O1", "O2")
_AMP_KWARGS = ("loss_scale_manager", "keep_batchnorm_fp32", "boost_config_dict", "acc_level")


def check_amp_arguments(amp_level, boost_level, kwargs):
    """MindSpore's checks of Model's amp_level, boost_level and kwargs; returns the boost level
    (``acc_level`` is its older name, as in MindSpore)."""
    for name in kwargs:
        if name not in _AMP_KWARGS:
            # (ValueError, not Python's TypeError for an unknown keyword: MindSpore's Model raises this)
            raise ValueError(f"Model: the argument in 'kwargs' should be 'loss_scale_manager' or "
                             f"'keep_batchnorm_fp32' or 'boost_config_dict' or 'acc_level', but got {name!r}")
    boost_level = kwargs.get("acc_level", boost_level)
    if not isinstance(amp_level, str):
        raise TypeError(f"Model: amp_level must be a string in {list(_AMP_LEVELS)}, got {type(amp_level).__name__} "
                        f"{amp_level!r}")
    if amp_level not in _AMP_LEVELS:
        raise ValueError(f"Model: amp_level must be one of {list(_AMP_LEVELS)}, got {amp_level!r}")
    if boost_level not in _BOOST_LEVELS:
        raise ValueError(f"Model: boost_level must be one of {list(_BOOST_LEVELS)}, got {boost_level!r}")
    if boost_level != "O0":
        raise NotImplementedError(f"Model: boost_level {boost_level!r} (MindSpore's boost mode: gradient freezing, "
                                  f"adaptive summation, ...) is not built in minidl; use boost_level='O0'")
    if "keep_batchnorm_fp32" in kwargs and not isinstance(kwargs["keep_batchnorm_fp32"], bool):
        raise TypeError(f"Model: keep_batchnorm_fp32 must be a bool, got {kwargs['keep_batchnorm_fp32']!r}")
    manager = kwargs.get("loss_scale_manager")
    if manager is not None and not isinstance(manager, LossScaleManager):
        raise TypeError(f"Model: loss_scale_manager must be an amp.LossScaleManager (amp.DynamicLossScaleManager(), "
                        f"amp.FixedLossScaleManager()) or None, got {type(manager).__name__}")
    return boost_level


def amp_networks(network, loss_fn, optimizer, amp_level, kwargs):
    """(the network cast for ``amp_level``, the training network), as MindSpore's build_train_network.

    The training network is the cast network itself (Model's own step trains it) unless a loss
    scale manager is in effect; then it is the step cell the manager asks for.
    """
    level = amp_level
    if level in ("O2", "O3"):
        # MindSpore's _config_level: O2 keeps BatchNorm in float32 by default, O3 does not;
        # keep_batchnorm_fp32 overrides either (O2 without it casts as O3, and O3 with it as O2).
        level = "O2" if kwargs.get("keep_batchnorm_fp32", level == "O2") else "O3"
    network = auto_mixed_precision(network, level)  # ("O0": the network itself)
    if amp_level == "auto":
        # "auto" may leave the output float16; MindSpore's Model casts it to float32 before the loss
        # (_add_loss_network) and in its eval network: so does the network Model runs here.
        network = _OutputTo32(network)
    # O2's default scale is MindSpore's (whose CPU backend refuses it; minidl's step runs it anywhere).
    manager = kwargs.get("loss_scale_manager", DynamicLossScaleManager() if amp_level == "O2" else None)
    if manager is None:
        return network, network
    with_loss = network if loss_fn is None else nn.WithLossCell(network, loss_fn)
    update_cell = manager.get_update_cell()
    optimizer_scale = getattr(optimizer, "loss_scale", 1.0)
    if update_cell is not None:
        # The step cell divides the gradients by the scale: an optimizer dividing again would shrink every update.
        if optimizer_scale != 1.0:
            raise ValueError(f"Model: the optimizer's loss_scale must be 1.0 with {type(manager).__name__} (the step "
                             f"cell unscales the gradients itself), got {optimizer_scale}")
        return network, nn.TrainOneStepWithLossScaleCell(with_loss, optimizer, scale_sense=update_cell)
    # FixedLossScaleManager(drop_overflow_update=False): backward starts from the scale and the
    # optimizer divides it back (MindSpore: "the value of loss_scale in optimizer should be set to the same").
    loss_scale = manager.get_loss_scale()
    if optimizer_scale != loss_scale:
        raise ValueError(f"Model: with {type(manager).__name__}(loss_scale={loss_scale}, drop_overflow_update=False) "
                         f"the optimizer must divide the gradients by the same scale: build it with "
                         f"loss_scale={loss_scale}, got loss_scale={optimizer_scale}")
    return network, nn.TrainOneStepCell(with_loss, optimizer, sens=loss_scale)
