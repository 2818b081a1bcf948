"""nn.Conv2dTranspose, and nn.MaxPool2d / nn.AvgPool2d with padding, ceil_mode and the rest."""
import numpy as np
import pytest

import minidl
from minidl import nn, ops, Tensor

F64 = minidl.float64


def conv_input_grad(dout, w, size, **conv_args):
    """The transposed convolution the long way: the input gradient of a Conv2D, by autograd."""
    x = Tensor(np.zeros(size), requires_grad=True)
    conv = ops.Conv2D(w.shape[0], w.shape[2:], **conv_args)
    conv(x, Tensor(w)).backward(Tensor(dout))
    return x.grad.asnumpy()


# ---- Conv2dTranspose ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, out_hw", [  # output sizes read from MindSpore 2.10's nn.Conv2dTranspose
    (dict(kernel_size=3, stride=2), (10, 12)),                                   # 'same': H * stride
    (dict(kernel_size=4, stride=2), (10, 12)),
    (dict(kernel_size=4, stride=1), (5, 6)),
    (dict(kernel_size=3, stride=2, pad_mode="valid"), (11, 13)),                 # H * s + k - s
    (dict(kernel_size=2, stride=3, pad_mode="valid"), (15, 18)),                 # k < s: H * s
    (dict(kernel_size=3, stride=2, pad_mode="valid", dilation=2), (13, 15)),
    (dict(kernel_size=3, stride=2, pad_mode="pad", padding=1, output_padding=1), (10, 12)),
    (dict(kernel_size=3, stride=2, pad_mode="pad", padding=2, output_padding=1), (8, 10)),
    (dict(kernel_size=3, stride=2, pad_mode="pad", padding=(1, 0, 2, 1), group=2), (10, 10)),
])
def test_conv2d_transpose_output_sizes_and_values(kwargs, out_hw):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 5, 6))
    net = nn.Conv2dTranspose(4, 6, dtype=F64, **kwargs)
    g = kwargs.get("group", 1)
    assert net.weight.shape == (4, 6 // g) + (kwargs["kernel_size"],) * 2
    y = net(Tensor(x)).asnumpy()
    assert y.shape == (2, 6) + out_hw
    pad_mode = kwargs.get("pad_mode", "same")
    conv_args = dict(pad_mode=pad_mode, pad=kwargs.get("padding", 0) if pad_mode == "pad" else 0,
                     stride=kwargs["stride"], dilation=kwargs.get("dilation", 1), group=g)
    np.testing.assert_allclose(y, conv_input_grad(x, net.weight.asnumpy(), y.shape, **conv_args), rtol=1e-12,
                               atol=1e-12)


def test_conv2d_transpose_bias_gradients_and_float32():
    net = nn.Conv2dTranspose(3, 4, 3, stride=2, pad_mode="pad", padding=1, output_padding=1, has_bias=True)
    x = Tensor(np.random.default_rng(1).random((2, 3, 4, 4)).astype(np.float32), requires_grad=True)
    y = net(x)
    assert y.shape == (2, 4, 8, 8) and y.dtype == np.float32
    no_bias = ops.conv_transpose2d(x, net.weight, stride=2, padding=1, output_padding=1)
    np.testing.assert_allclose((y - no_bias).asnumpy(), np.broadcast_to(net.bias.asnumpy()[:, None, None], y.shape),
                               rtol=1e-6)
    y.sum().backward()
    assert net.weight.grad.shape == (3, 4, 3, 3) and net.bias.grad.shape == (4,)
    np.testing.assert_allclose(net.bias.grad.asnumpy(), np.full(4, 2 * 8 * 8))
    assert x.grad.dtype == np.float32


def test_conv2d_transpose_shard_and_repr():
    net = nn.Conv2dTranspose(4, 8, 3, pad_mode="pad", padding=1, has_bias=True).shard(((2, 1, 1, 1), (1, 4, 1, 1)))
    assert net.conv2d_transpose.in_strategy == ((2, 1, 1, 1), (1, 4, 1, 1))
    assert net.bias_add.in_strategy == ((2, 4, 1, 1), (4,))
    assert "input_channels=4, output_channels=8, kernel_size=(3, 3)" in repr(net) and "padding=1" in repr(net)


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(stride=2, pad_mode="pad", output_padding=2), ValueError,
     r"Conv2dTranspose: output_padding=2 must be smaller than stride=\(2, 2\) or dilation=\(1, 1\)"),
    (dict(stride=2, output_padding=1), ValueError, r"output_padding=1 needs pad_mode='pad', got 'same'"),
    (dict(group=3), ValueError, "in_channels=4 and out_channels=6 must both be divisible by group=3"),
    (dict(padding=1), ValueError, r"padding=1 needs pad_mode='pad', got pad_mode='same'"),
    (dict(pad_mode="full"), ValueError, r"pad_mode must be one of \('same', 'valid', 'pad'\)"),
    (dict(output_padding=(1, 2, 3), pad_mode="pad"), ValueError, "output_padding must be a non-negative int or a pair"),
])
def test_conv2d_transpose_errors(kwargs, err, match):
    with pytest.raises(err, match=match):
        nn.Conv2dTranspose(4, 6, 3, **kwargs)


def test_conv2d_transpose_input_check():
    with pytest.raises(ValueError, match=r"input of shape \(1, 3, 4, 4\) must be \(N, C, H, W\) with C = "
                                         r"in_channels = 4"):
        nn.Conv2dTranspose(4, 6, 3)(Tensor(np.ones((1, 3, 4, 4), np.float32)))


@pytest.mark.cpu_only
@pytest.mark.parametrize("stride, padding, output_padding, dilation, group", [
    (2, 1, 1, 1, 1), (3, 0, 2, 1, 2), (1, 2, 0, 2, 1), ((2, 1), (1, 0), (1, 0), 1, 2), (1, 1, 2, 3, 2),
])
def test_conv2d_transpose_pad_mode_matches_torch(stride, padding, output_padding, dilation, group):
    """pad_mode='pad' is PyTorch's ConvTranspose2d: values and gradients of input, weight and bias."""
    torch = pytest.importorskip("torch", reason="the cross-check needs PyTorch: pip install -e '.[bench]'")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 5, 4))
    pad4 = padding if isinstance(padding, int) else (padding[0], padding[0], padding[1], padding[1])
    net = nn.Conv2dTranspose(4, 6, 3, stride, "pad", pad4, output_padding, dilation, group, has_bias=True,
                             dtype=F64)
    tnet = torch.nn.ConvTranspose2d(4, 6, 3, stride, padding, output_padding, group, True, dilation).double()
    with torch.no_grad():
        tnet.weight.copy_(torch.tensor(net.weight.asnumpy()))
        tnet.bias.copy_(torch.tensor(net.bias.asnumpy()))
    mx, tx = Tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
    y, ty = net(mx), tnet(tx)
    gy = rng.standard_normal(tuple(ty.shape))
    y.backward(Tensor(gy))
    ty.backward(torch.tensor(gy))
    np.testing.assert_allclose(y.asnumpy(), ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    for got, want in ((mx.grad, tx.grad), (net.weight.grad, tnet.weight.grad), (net.bias.grad, tnet.bias.grad)):
        np.testing.assert_allclose(got.asnumpy(), want.numpy(), rtol=1e-10, atol=1e-12)


# ---- pooling --------------------------------------------------------------------------------------

def test_max_pool2d_padding_dilation_ceil_and_indices():
    x = Tensor(np.random.default_rng(4).permutation(64).reshape(1, 1, 8, 8).astype(np.float64))
    stem = nn.MaxPool2d(3, 2, pad_mode="pad", padding=1)  # torchvision's ResNet stem
    np.testing.assert_array_equal(stem(x).asnumpy(), ops.max_pool2d(x, 3, 2, 1).asnumpy())
    assert stem(x).shape == (1, 1, 4, 4)
    y, where = nn.MaxPool2d(2, 1, pad_mode="pad", padding=1, dilation=2, return_indices=True, ceil_mode=True)(x)
    want, want_where = ops.max_pool2d(x, 2, 1, 1, 2, return_indices=True, ceil_mode=True)
    np.testing.assert_array_equal(y.asnumpy(), want.asnumpy())
    np.testing.assert_array_equal(where.asnumpy(), want_where.asnumpy())
    # The indices point at the maxima.
    np.testing.assert_array_equal(x.asnumpy().reshape(-1)[where.asnumpy()], y.asnumpy())
    assert nn.MaxPool2d(3, 2, pad_mode="pad", padding=(1,))(x).shape == (1, 1, 4, 4)


def test_avg_pool2d_arguments_reach_the_op():
    x = Tensor(np.random.default_rng(5).random((2, 3, 7, 6)))
    cases = [
        (dict(pad_mode="pad", padding=1), dict(padding=1)),
        (dict(pad_mode="pad", padding=(1, 0), ceil_mode=True, count_include_pad=False),
         dict(padding=(1, 0), ceil_mode=True, count_include_pad=False)),
        (dict(ceil_mode=True), dict(ceil_mode=True)),  # MindSpore allows ceil_mode with 'valid'
        (dict(pad_mode="pad", padding=1, divisor_override=5), dict(padding=1, divisor_override=5)),
    ]
    for layer_args, fn_args in cases:
        got = nn.AvgPool2d(3, 2, **layer_args)(x).asnumpy()
        np.testing.assert_allclose(got, ops.avg_pool2d(x, 3, 2, **fn_args).asnumpy(), rtol=1e-12)
    assert "padding=(1, 1), ceil_mode=True" in repr(nn.AvgPool2d(3, 2, pad_mode="pad", padding=1, ceil_mode=True))


@pytest.mark.parametrize("make, match", [
    (lambda: nn.MaxPool2d(3, 2, padding=1), r"MaxPool2d: padding=1 needs pad_mode='pad', got pad_mode='valid' "
                                            r"\(as MindSpore; PyTorch's MaxPool2d\(3, 2, padding=1\) is "
                                            r"MaxPool2d\(3, 2, pad_mode='pad', padding=1\) here\)"),
    (lambda: nn.MaxPool2d(3, 2, ceil_mode=True), r"MaxPool2d: dilation=1, return_indices=False and ceil_mode=True "
                                                 r"need pad_mode='pad' \(as MindSpore\), got 'valid'"),
    (lambda: nn.MaxPool2d(3, 2, pad_mode="same", return_indices=True), "need pad_mode='pad'"),
    (lambda: nn.AvgPool2d(3, 2, pad_mode="same", padding=1), r"AvgPool2d: padding=1 needs pad_mode='pad'"),
    (lambda: nn.AvgPool2d(3, 2, pad_mode="pad", padding=(1, 1, 1, 1)), "padding must be a non-negative int or a tuple"),
    (lambda: nn.AvgPool2d(3, 2, divisor_override=0), "AvgPool2d: divisor_override must be None or a positive int"),
    (lambda: nn.MaxPool2d(3, 2, pad_mode="pad", padding=2), r"MaxPool: pad=\(2, 2\) must be at most half"),
])
def test_pooling_layer_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.cpu_only
def test_pooling_layers_match_torch():
    torch = pytest.importorskip("torch", reason="the cross-check needs PyTorch: pip install -e '.[bench]'")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 9, 10))
    pairs = [
        (nn.MaxPool2d(3, 2, pad_mode="pad", padding=1, ceil_mode=True), torch.nn.MaxPool2d(3, 2, 1, ceil_mode=True)),
        (nn.MaxPool2d(2, 1, pad_mode="pad", padding=1, dilation=2), torch.nn.MaxPool2d(2, 1, 1, dilation=2)),
        (nn.AvgPool2d(3, 2, pad_mode="pad", padding=1, ceil_mode=True, count_include_pad=False),
         torch.nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False)),
        (nn.AvgPool2d(4, 3, pad_mode="pad", padding=2, divisor_override=5),
         torch.nn.AvgPool2d(4, 3, 2, divisor_override=5)),
    ]
    for ours, theirs in pairs:
        mx, tx = Tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
        y, ty = ours(mx), theirs(tx)
        gy = rng.standard_normal(tuple(ty.shape))
        y.backward(Tensor(gy))
        ty.backward(torch.tensor(gy))
        np.testing.assert_allclose(y.asnumpy(), ty.detach().numpy(), rtol=1e-12)
        np.testing.assert_allclose(mx.grad.asnumpy(), tx.grad.numpy(), rtol=1e-12, atol=1e-15)
