"""Shared pieces of the training-loop tests: small datasets, networks and a stop callback."""
import numpy as np

from minidl import nn
from minidl.dataset import NumpySlicesDataset
from minidl.runtime import Runtime
from minidl.tensor import Tensor
from minidl.train import Callback


def slices(data, column_names, batch_size, shuffle=False):
    """A batched minidl.dataset.NumpySlicesDataset of in-memory arrays."""
    return NumpySlicesDataset(tuple(data), column_names=list(column_names), shuffle=shuffle).batch(batch_size)


class FakeSlices:
    """Stand-in with exactly the contract's methods (get_col_names, get_dataset_size,
    epoch_iterator), to show Model needs nothing else: (seed, epoch) shuffle, batches."""

    def __init__(self, data, column_names, batch_size, shuffle=False, seed=0):
        self.columns = [np.asarray(c) for c in data]
        self.names = list(column_names)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed

    def get_col_names(self):
        return list(self.names)

    def get_dataset_size(self):
        return -(-len(self.columns[0]) // self.batch_size)

    def epoch_iterator(self, epoch, skip_batches=0, output_numpy=False):
        n = len(self.columns[0])
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        for b in range(skip_batches, self.get_dataset_size()):
            idx = order[b * self.batch_size:(b + 1) * self.batch_size]
            row = tuple(c[idx] for c in self.columns)
            yield row if output_numpy else tuple(Tensor(x) for x in row)


def blobs(n=48, dim=4, classes=3, seed=0):
    """A learnable problem: Gaussian blobs around fixed class centres."""
    rng = np.random.default_rng(seed)
    centres = 3.0 * rng.standard_normal((classes, dim))
    y = rng.integers(0, classes, n)
    x = (centres[y] + 0.5 * rng.standard_normal((n, dim))).astype(np.float32)
    return x, y.astype(np.int32)


def mlp(dim=4, hidden=16, classes=3, dropout=0.0):
    layers = [nn.Dense(dim, hidden), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(p=dropout))
    layers.append(nn.Dense(hidden, classes))
    return nn.SequentialCell(layers)


def ce_loss():
    return nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")


def momentum(net, lr=0.05):
    return nn.Momentum(net.trainable_params(), learning_rate=lr, momentum=0.9)


class StopAt(Callback):
    """Requests a stop after global step ``step``."""

    def __init__(self, step):
        self.step = step

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num >= self.step:
            run_context.request_stop()


class Recorder(Callback):
    """Records (hook, epoch, step) for every hook, through the 1.x names too."""

    def __init__(self):
        self.events = []

    def _rec(self, name, run_context):
        cb = run_context.original_args()
        self.events.append((name, cb.get("cur_epoch_num"), cb.get("cur_step_num")))

    def begin(self, rc):
        self._rec("begin", rc)

    def epoch_begin(self, rc):
        self._rec("epoch_begin", rc)

    def step_begin(self, rc):
        self._rec("step_begin", rc)

    def step_end(self, rc):
        self._rec("step_end", rc)

    def epoch_end(self, rc):
        self._rec("epoch_end", rc)

    def end(self, rc):
        self._rec("end", rc)


class Rank(Runtime):
    """Rank ``r`` of a world of ``size``, installed with ``with Rank(r):``: what the callbacks and
    the metrics log ask (training without a reducer uses no collective)."""

    def __init__(self, r, size=2):
        self.r, self.size = r, size

    def rank(self):
        return self.r

    def group_size(self):
        return self.size
