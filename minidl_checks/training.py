"""The training runs the GPU check compares: ResNet-20 from one seed on either device (the
resnet20 stage's worker, judged by judging.judge_training), and the small float64 MLP trained
with Model.train that the data-parallel stages (parallel_workers.py) compare with one process."""
import numpy

from .judging import TRAIN_LR, TRAIN_TOL64, judge_training
from .stages import emit_result


def resnet_data(steps, batch, seed=0):
    rng = numpy.random.default_rng(seed)
    images = rng.standard_normal((steps * batch, 3, 32, 32)).astype(numpy.float32)
    labels = rng.integers(0, 10, steps * batch).astype(numpy.int32)
    return images, labels


def train_resnet(device, dtype, images, labels, steps, batch, lr=TRAIN_LR):
    """k Momentum steps of ResNet-20 from seed 0 on ``device``; returns {name: value} (losses too)."""
    import minidl
    previous = minidl.backend.get_device_target()
    minidl.set_context(device_target=device)
    try:
        return _train_resnet(device, dtype, images, labels, steps, batch, lr)
    finally:
        minidl.set_context(device_target=previous)  # a caller's (a test's) device stays as it was


def _train_resnet(device, dtype, images, labels, steps, batch, lr):
    import minidl
    from minidl import nn, Tensor
    from minidl.models import resnet20
    minidl.set_seed(0)  # parameters are drawn on the host (backend.rng()), so both devices start equal
    net = resnet20()
    net.set_train(True)
    for p in net.get_parameters():  # moving statistics too: they are Parameters without gradients
        p.data = p.data.astype(dtype)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), learning_rate=lr, momentum=0.9)
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    out = {}
    for i in range(steps):
        x = Tensor(images[i * batch:(i + 1) * batch].astype(dtype))
        y = Tensor(labels[i * batch:(i + 1) * batch])
        loss, grads = grad_fn(x, y)
        opt(grads)
        out[f"loss/{i}"] = float(loss.asnumpy())
    for name, p in net.parameters_and_names():
        out[name] = minidl.backend.to_numpy(p.data).astype(numpy.float64)
    return out


def worker_resnet20(args):
    images, labels = resnet_data(args.steps, args.batch)
    runs = {(dev, dt): train_resnet(dev, dt, images, labels, args.steps, args.batch)
            for dev in ("CPU", "GPU") for dt in ("float32", "float64")}
    ok, lines, numbers = judge_training(runs)
    head = f"ResNet-20, {args.steps} Momentum steps (lr {TRAIN_LR}), batch {args.batch}, seed 0"
    print(head + "\n  " + "\n  ".join(lines), flush=True)
    summary = (f"{head}: GPU vs CPU per-tensor max rel diff float32 {numbers['gpu_vs_cpu_float32_max_rel']:.2g} "
               f"(tolerance {numbers['tol_float32_max_rel']:.2g}), float64 "
               f"{numbers['gpu_vs_cpu_float64_max_rel']:.2g} (tolerance {TRAIN_TOL64:g})")
    emit_result("passed" if ok else "failed", summary, **numbers)


def float64_mlp(seed):
    """The small float64 MLP of the data-parallel equivalence stages, from ``seed``."""
    import minidl
    from minidl import nn
    minidl.set_seed(seed)
    f64 = minidl.float64
    return nn.SequentialCell(nn.Dense(4, 6, dtype=f64), nn.Tanh(), nn.Dense(6, 5, dtype=f64), nn.ReLU(),
                             nn.Dense(5, 2, dtype=f64))


def train_mlp(net, data, label, batch, **shards):
    """One epoch of Model.train on (data, label); returns (losses, parameters as NumPy)."""
    from minidl import nn
    from minidl.dataset import NumpySlicesDataset
    from minidl.train import Callback, Model

    class Losses(Callback):
        def __init__(self):
            self.values = []

        def on_train_step_end(self, run_context):
            self.values.append(float(run_context.original_args().net_outputs.asnumpy()))

    opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    model = Model(net, nn.MSELoss(reduction="mean"), opt)
    ds = NumpySlicesDataset({"data": data, "label": label}, shuffle=False, **shards).batch(batch)
    losses = Losses()
    model.train(1, ds, callbacks=[losses], progress=False)
    import minidl
    return losses.values, {name: minidl.backend.to_numpy(p.data) for name, p in net.parameters_and_names()}
