"""The training loop, as mindspore.train: Model, callbacks, metrics, checkpoints.

    from minidl.train import Model, LossMonitor, TimeMonitor, ModelCheckpoint, CheckpointConfig
    model = Model(net, loss_fn, optimizer, metrics={"accuracy"})
    model.train(10, train_ds, callbacks=[LossMonitor(), ModelCheckpoint("net", "ckpt")], log_file="train.jsonl")
    model.train(10, train_ds, resume_from=latest_checkpoint("ckpt", "net"))     # continue after a stop
    model.eval(test_ds)                                                         # {'accuracy': 0.91}
"""
from .callbacks import Callback, RunContext, CallbackParam, CallbackList, LossMonitor, TimeMonitor
from .checkpoint import CheckpointConfig, ModelCheckpoint, latest_checkpoint, save_train_state, restore_train_state
from .metrics import (Metric, Accuracy, Loss, TopKCategoricalAccuracy, Top1CategoricalAccuracy,
                      Top5CategoricalAccuracy, get_metric_fn, get_metrics)
from .model import Model
from .progress import ProgressBar, MetricsLogger
from .restart import restart_count, resume_after_restart

__all__ = ["Model",
           "Callback", "RunContext", "CallbackParam", "CallbackList", "LossMonitor", "TimeMonitor",
           "CheckpointConfig", "ModelCheckpoint", "latest_checkpoint", "save_train_state", "restore_train_state",
           "Metric", "Accuracy", "Loss", "TopKCategoricalAccuracy", "Top1CategoricalAccuracy",
           "Top5CategoricalAccuracy",
           "get_metric_fn", "get_metrics", "ProgressBar", "MetricsLogger", "restart_count", "resume_after_restart"]
