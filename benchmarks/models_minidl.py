"""The minidl side of the benchmarks (imports minidl only): a user-written ResNet-20, the training step.

``minidl.models.resnet20`` calls ``BatchNorm2d.with_relu(x, residual)``, the fused
BatchNorm(+Add)+ReLU op, which only the project's own model definition knows about. A user
(or a port of a MindSpore or PyTorch script) writes separate ``nn.Conv2d``, ``nn.BatchNorm2d``
and ``nn.ReLU`` cells and a ``+`` for the residual; issue 19 asks that this model be fast too,
so the benchmarks time it beside the project's own.

The architecture, the layer order and the initialisers are those of ``minidl.models.resnet20``
(and of the PyTorch twin in models_torch.py), so under the same seed both minidl models start
from the same weights and compute the same loss (to float32 rounding).
"""
import minidl
from minidl import nn, ops
from minidl.models import MLP, resnet18, resnet20


def conv3x3(cin, cout, stride=1):
    return nn.Conv2d(cin, cout, 3, stride=stride, pad_mode="pad", padding=1, weight_init="he_normal")


class BasicBlock(nn.Cell):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.down_sample = None
        if stride != 1 or cin != cout:
            self.down_sample = nn.SequentialCell(
                nn.Conv2d(cin, cout, 1, stride=stride, pad_mode="valid", weight_init="he_normal"),
                nn.BatchNorm2d(cout))

    def construct(self, x):
        identity = x if self.down_sample is None else self.down_sample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet20(nn.Cell):
    """3x3 stem, three stages of three basic blocks (16, 32, 64 channels), mean pool, Dense."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = conv3x3(3, 16)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        blocks, cin = [], 16
        for i, width in enumerate((16, 32, 64)):
            for j in range(3):
                blocks.append(BasicBlock(cin, width, 2 if i > 0 and j == 0 else 1))
                cin = width
        self.layers = nn.SequentialCell(blocks)
        self.mean = ops.ReduceMean(keep_dims=False)
        self.fc = nn.Dense(64, num_classes)

    def construct(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layers(x)
        return self.fc(self.mean(x, (2, 3)))


def resnet20_user(num_classes=10):
    return ResNet20(num_classes)


MODELS = {"resnet20": resnet20, "resnet20_user": resnet20_user, "resnet18": resnet18,
          "mlp": lambda: MLP((784, 512, 512, 10))}


def training_parts(model):
    """(net, grad_fn, opt) of ``model`` (a name in MODELS): Momentum 0.9 and softmax cross-entropy
    in a custom loop, ``grad_fn(x, y) -> (loss, grads)`` from ``value_and_grad``, then ``opt(grads)``."""
    minidl.set_seed(0)
    net = MODELS[model]()
    net.set_train(True)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    return net, minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters), opt


def step_fn(model):
    """A training step ``step(x, y) -> loss`` of ``model`` (see training_parts)."""
    _, grad_fn, opt = training_parts(model)

    def step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grads)
        return loss
    return step
