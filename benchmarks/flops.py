"""The multiply-adds of a training step, counted from the model's layers (no framework imported).

Only convolutions and linear layers are counted: they are the GEMM-shaped work a BLAS can run
near the machine's peak, so ``step FLOPs / sgemm rate`` is the least time the step can take,
and ``that / measured step time`` the fraction of the machine's limit the step reaches.
BatchNorm, ReLU, pooling, the loss and the optimizer are memory passes and are left out.

Per layer, with F the forward FLOPs (2 per multiply-add):
    forward F, weight gradient F, input gradient F (skipped for the network's first layer,
    whose input needs no gradient, as in PyTorch and minidl),
so a step is about 3F. ResNet-20 at batch 64: 5.22 GFLOP forward, 15.62 GFLOP a step (15.67 = 3F
with the stem's input gradient, which no one computes: issue 19's "about 15.7").

    python benchmarks/flops.py          # prints the per-layer table of ResNet-20 and the MLP
"""
import collections

Layer = collections.namedtuple("Layer", "name kind cin cout k stride out_h out_w")


def resnet_cifar_layers(blocks=(3, 3, 3), widths=(16, 32, 64), in_channels=3, size=32, classes=10):
    """The convolutions and the classifier of a CIFAR ResNet with basic blocks (ResNet-20 by default).

    3x3 stem; per stage, blocks of two 3x3 convolutions, the first of a later stage with stride 2
    and a 1x1 stride-2 shortcut convolution (option B); global average pool; one linear layer.
    """
    layers = [Layer("stem", "conv", in_channels, widths[0], 3, 1, size, size)]
    cin, hw = widths[0], size
    for i, (n, width) in enumerate(zip(blocks, widths)):
        for j in range(n):
            stride = 2 if i > 0 and j == 0 else 1
            hw //= stride
            name = f"stage{i + 1}.block{j + 1}"
            layers.append(Layer(f"{name}.conv1", "conv", cin, width, 3, stride, hw, hw))
            layers.append(Layer(f"{name}.conv2", "conv", width, width, 3, 1, hw, hw))
            if stride != 1 or cin != width:
                layers.append(Layer(f"{name}.shortcut", "conv", cin, width, 1, stride, hw, hw))
            cin = width
    layers.append(Layer("fc", "linear", cin, classes, 1, 1, 1, 1))
    return layers


def mlp_layers(sizes=(784, 512, 512, 10)):
    return [Layer(f"fc{i + 1}", "linear", a, b, 1, 1, 1, 1) for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))]


ARCHITECTURES = {"resnet20": resnet_cifar_layers, "mlp": mlp_layers}


def forward_flops(layer, batch):
    """2 x the multiply-adds of one layer's forward over a batch."""
    return 2 * batch * layer.cout * layer.cin * layer.k * layer.k * layer.out_h * layer.out_w


def step_flops(layers, batch):
    """(forward FLOPs, forward + backward FLOPs) of a training step over ``layers``."""
    fwd = sum(forward_flops(layer, batch) for layer in layers)
    # weight gradients for every layer, input gradients for all but the first
    return fwd, 3 * fwd - forward_flops(layers[0], batch)


def main():
    for arch, batch in (("resnet20", 64), ("mlp", 256)):
        layers = ARCHITECTURES[arch]()
        print(f"{arch}, batch {batch}")
        for layer in layers:
            shape = f"{layer.cin:4d}->{layer.cout:<4d} {layer.k}x{layer.k}/{layer.stride} out {layer.out_h:2d}x{layer.out_w:<2d}"
            print(f"  {layer.name:24s} {layer.kind:6s} {shape} {forward_flops(layer, batch) / 1e6:9.1f} MFLOP forward")
        fwd, total = step_flops(layers, batch)
        print(f"  forward {fwd / 1e9:.3f} GFLOP; step (forward + backward) {total / 1e9:.3f} GFLOP")


if __name__ == "__main__":
    main()
