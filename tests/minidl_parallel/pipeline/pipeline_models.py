"""Networks cut into pipeline stages, and the single-device run a pipeline must equal.

Each builder makes the same network, with the same weights, whatever the stage count: ``stages``
only sets ``pipeline_stage`` on its cells (1: every cell on stage 0, as a plain network). The
reference trains one device with gradient accumulation over the same micro-batches: one
``value_and_grad`` per micro-batch, the gradients added in micro-batch order, one optimizer step.
"""
import numpy as np

from minidl import backend, nn, Tensor
from minidl.autograd import value_and_grad
from minidl.models.gpt import GPT
from minidl.models.resnet import BasicBlock, ResNet
from minidl.optim import Momentum

__all__ = ["mlp", "mlp_cut", "resnet", "gpt", "gpt64", "gpt_tied", "reference", "batches", "stage_of"]


def stage_of(k, n, stages):
    """The stage of item k of n when n items are cut into ``stages`` runs of nearly equal length."""
    return k * stages // n


def _set_weights(net, seed):
    rng = np.random.default_rng(seed)
    for p in net.trainable_params():
        p.set_data(Tensor((0.5 * rng.standard_normal(p.shape)).astype(p.dtype)))


def mlp(stages, widths=(6, 8, 8, 5), classes=3):
    """Dense layers (ReLU between), each its own stage run; a softmax cross-entropy loss."""
    layers = [nn.Dense(a, b, activation="relu") for a, b in zip(widths[:-1], widths[1:])]
    layers.append(nn.Dense(widths[-1], classes))
    body = nn.SequentialCell(layers)
    _set_weights(body, 11)
    for k, layer in enumerate(layers):
        layer.pipeline_stage = stage_of(k, len(layers), stages)
    return nn.WithLossCell(body, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))


def mlp_cut(stages, strategies, widths=(6, 8, 8, 4), classes=4):
    """The MLP in float64 with ``shard()`` strategies on its Dense layers (``strategies[k]`` for layer k,
    None: none), for tensor parallelism inside the stages; layers cut into stages as ``mlp``'s."""
    layers = [nn.Dense(a, b, activation="relu", dtype=np.float64) for a, b in zip(widths[:-1], widths[1:])]
    layers.append(nn.Dense(widths[-1], classes, dtype=np.float64))
    body = nn.SequentialCell(layers)
    _set_weights(body, 15)
    for k, layer in enumerate(layers):
        layer.pipeline_stage = stage_of(k, len(layers), stages)
        if strategies[k] is not None:
            layer.shard(strategies[k])
    return nn.WithLossCell(body, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))


def resnet(stages):
    """A small CIFAR ResNet (BatchNorm, residual blocks, its stem's with_relu and global mean as
    glue): the stem on stage 0, the residual stages cut in order, the classifier on the last."""
    net = ResNet(BasicBlock, (1, 1, 1), (4, 8, 8), num_classes=3)
    _set_weights(net, 12)
    units = [net.conv1, net.bn1] + list(net.layers) + [net.fc]
    for k, unit in enumerate(units):
        unit.pipeline_stage = stage_of(k, len(units), stages)
    return nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))


class _TokenLoss(nn.Cell):
    """Cross-entropy of (batch, time, vocab) logits against (batch, time) ids."""

    def __init__(self):
        super().__init__()
        self.ce = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

    def construct(self, logits, labels):
        n, t, v = logits.shape
        return self.ce(logits.reshape(n * t, v), labels.reshape(n * t))


def gpt(stages, n_layer=4, vocab=11, dtype=np.float32):
    """A small GPT with its own head (untied): embeddings on stage 0, the blocks cut in order, the
    final LayerNorm and the head on the last stage."""
    net = GPT(vocab_size=vocab, block_size=8, n_layer=n_layer, n_head=2, n_embd=8, tie_weights=False, dtype=dtype)
    _set_weights(net, 13)
    net.wte.pipeline_stage = net.wpe.pipeline_stage = 0
    for k, block in enumerate(net.blocks):
        block.pipeline_stage = stage_of(k, len(net.blocks), stages)
    net.ln_f.pipeline_stage = net.lm_head.pipeline_stage = stages - 1
    return nn.WithLossCell(net, _TokenLoss())


def gpt64(stages, n_layer=4, vocab=11):
    """``gpt`` in float64 (for runs whose sums are added in another order: compared within 1e-10)."""
    return gpt(stages, n_layer, vocab, np.float64)


def gpt_tied(stages, n_layer=4, vocab=11):
    """The GPT with its head tied to the token embedding table (GPT-2's), in float64: the table is
    used on stage 0 (the lookup) and on the last stage (the head), so the two stages share it."""
    import numpy
    net = GPT(vocab_size=vocab, block_size=8, n_layer=n_layer, n_head=2, n_embd=8, dtype=numpy.float64)
    _set_weights(net, 14)
    net.wte.pipeline_stage = net.wpe.pipeline_stage = 0
    for k, block in enumerate(net.blocks):
        block.pipeline_stage = stage_of(k, len(net.blocks), stages)
    net.ln_f.pipeline_stage = stages - 1
    return nn.WithLossCell(net, _TokenLoss())


def batches(kind, steps, batch, seed=3):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        if kind == "mlp_cut":
            x = rng.standard_normal((batch, 6))
            y = rng.integers(0, 3, batch).astype(np.int32)
        elif kind == "mlp":
            x = rng.standard_normal((batch, 6)).astype(np.float32)
            y = rng.integers(0, 3, batch).astype(np.int32)
        elif kind == "resnet":
            x = rng.standard_normal((batch, 3, 8, 8)).astype(np.float32)
            y = rng.integers(0, 3, batch).astype(np.int32)
        else:  # gpt, gpt_tied
            x = rng.integers(0, 11, (batch, 8)).astype(np.int32)
            y = rng.integers(0, 11, (batch, 8)).astype(np.int32)
        out.append((Tensor(x), Tensor(y)))
    return out


def optimizer(net):
    return Momentum(net.trainable_params(), 0.05, 0.9)


def reference(build, data, micro_batches, replicas=1, mean=False):
    """One device: per step, each micro-batch's gradients added in order, then one Momentum step.

    With ``replicas`` > 1 the step's batch is cut into that many blocks along axis 0 (the data-parallel
    replicas' shards); each block's micro-batch gradients are added in order, then the blocks' sums
    in block order (as the threads all-reduce adds the ranks'), times 1/replicas with ``mean``.

    Returns (per step, the summed losses of block 0, {name: every parameter, BatchNorm statistics
    included}), as NumPy.
    """
    net = build(1)
    params = net.trainable_params()
    opt = optimizer(net)
    fn = value_and_grad(net, None, params)
    losses = []
    for x, y in data:
        sums, first_loss = [], None
        rows = x.shape[0] // replicas
        for r in range(replicas):
            total, acc = None, None
            n = rows // micro_batches
            for k in range(micro_batches):
                lo = r * rows + k * n
                loss, grads = fn(Tensor(x.data[lo:lo + n]), Tensor(y.data[lo:lo + n]))
                acc = list(grads) if acc is None else [a + g for a, g in zip(acc, grads)]
                total = loss.data.copy() if total is None else total + loss.data
            sums.append(acc)
            first_loss = total if first_loss is None else first_loss
        acc = [g.data.copy() for g in sums[0]]
        for other in sums[1:]:
            for a, g in zip(acc, other):
                a += g.data
        if mean and replicas > 1:
            for a in acc:
                a *= a.dtype.type(1.0 / replicas)
        opt(tuple(Tensor(a) for a in acc))
        losses.append(backend.to_numpy(first_loss))
    return losses, {name: backend.to_numpy(p.data) for name, p in net.parameters_and_names()}
