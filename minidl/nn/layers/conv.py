"""Conv2d and Conv2dTranspose: 2-D convolution and its transpose over NCHW inputs (MindSpore defaults:
pad_mode='same', no bias)."""
from ... import ops
from ...ops.conv import transpose_with_output_padding
from ...tensor import float32
from ..cell import Cell
from .basic import check_positive_int, default_bias_init, default_weight_init, make_parameter

_PAD_MODES = ("same", "valid", "pad")


def _pair(who, arg, value):
    """An int or a pair of positive ints, as a pair."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)):
        raise ValueError(f"{who}: {arg} must be a positive int or a pair of positive ints, got {value!r}")
    return tuple(value)


def _padding(who, padding, pad_mode):
    """An int or a (top, bottom, left, right) tuple of non-negative ints; non-zero only with 'pad'."""
    if isinstance(padding, int) and not isinstance(padding, bool):
        pads = (padding,) * 4
    elif isinstance(padding, (tuple, list)) and len(padding) == 4:
        pads = tuple(padding)
    else:
        raise ValueError(f"{who}: padding must be an int or a (top, bottom, left, right) tuple, got {padding!r}")
    if not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in pads):
        raise ValueError(f"{who}: padding values must be non-negative ints, got {padding!r}")
    if pad_mode != "pad" and any(pads):
        raise ValueError(f"{who}: padding={padding!r} needs pad_mode='pad', got pad_mode={pad_mode!r}")
    return padding if isinstance(padding, int) else pads


class Conv2d(Cell):
    """2-D convolution: ``y = conv(x, weight) (+ bias)`` over (N, C, H, W) inputs.

    Args:
        in_channels: input channels C.
        out_channels: output channels.
        kernel_size: int or (kh, kw).
        stride: int or (sh, sw).
        pad_mode: 'same' (output H = ceil(H / stride)), 'valid' (no padding) or 'pad'
            (explicit ``padding``).
        padding: int or (top, bottom, left, right); only with pad_mode='pad'.
        dilation: int or (dh, dw).
        group: number of groups; in_channels and out_channels must be divisible by it.
        has_bias: add a per-channel bias (MindSpore's default is False).
        weight_init: initializer of the (out, in/group, kh, kw) weight (default
            HeUniform(negative_slope=sqrt(5)), as MindSpore 2.x and PyTorch).
        bias_init: initializer of the bias (default U(-1/sqrt(fan_in), 1/sqrt(fan_in))).
        data_format: only 'NCHW'.

    Example:
        >>> conv = nn.Conv2d(3, 16, 3, pad_mode="pad", padding=1)
        >>> conv(minidl.Tensor(np.ones((2, 3, 8, 8), np.float32))).shape
        (2, 16, 8, 8)
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, pad_mode="same", padding=0,
                 dilation=1, group=1, has_bias=False, weight_init=None, bias_init=None, data_format="NCHW",
                 dtype=float32):
        super().__init__()
        who = "Conv2d"
        self.in_channels = check_positive_int(who, "in_channels", in_channels)
        self.out_channels = check_positive_int(who, "out_channels", out_channels)
        self.group = check_positive_int(who, "group", group)
        if in_channels % group or out_channels % group:
            raise ValueError(f"{who}: in_channels={in_channels} and out_channels={out_channels} must both be "
                             f"divisible by group={group}")
        self.kernel_size = _pair(who, "kernel_size", kernel_size)
        self.stride = _pair(who, "stride", stride)
        self.dilation = _pair(who, "dilation", dilation)
        if pad_mode not in _PAD_MODES:
            raise ValueError(f"{who}: pad_mode must be one of {_PAD_MODES}, got {pad_mode!r}")
        self.pad_mode = pad_mode
        self.padding = _padding(who, padding, pad_mode)
        if data_format != "NCHW":
            raise ValueError(f"{who}: only data_format='NCHW' is supported, got {data_format!r}")
        self.data_format = data_format
        self.has_bias = bool(has_bias)
        shape = (out_channels, in_channels // group) + self.kernel_size
        if weight_init is None:
            weight_init = default_weight_init()
        self.weight = make_parameter(who, "weight_init", weight_init, shape, dtype)
        self.bias = None
        if self.has_bias:
            if bias_init is None:
                bias_init = default_bias_init(shape[1] * shape[2] * shape[3])
            self.bias = make_parameter(who, "bias_init", bias_init, (out_channels,), dtype)
        self.conv2d = ops.Conv2D(out_channels, self.kernel_size, mode=1, pad_mode=pad_mode, pad=self.padding,
                                 stride=self.stride, dilation=self.dilation, group=group)
        self.bias_add = ops.BiasAdd()

    def construct(self, x):
        shape = x.shape
        if len(shape) != 4 or shape[1] != self.in_channels:
            raise ValueError(f"Conv2d: input of shape {tuple(shape)} must be (N, C, H, W) with "
                             f"C = in_channels = {self.in_channels}")
        y = self.conv2d(x, self.weight)
        if self.has_bias:
            y = self.bias_add(y, self.bias)
        return y

    def shard(self, strategy):
        """Tensor parallelism: the Conv2D's strategy, the bias following its output cut. Returns self.

        ``strategy`` is ``((n, c_in, 1, 1), (c_out, c_in, 1, 1))``: cuts of the batch, the input
        channels (partial sums over them) and the output channels; H and W cannot be cut.

        Example:
            >>> conv = nn.Conv2d(16, 32, 3).shard(((2, 1, 1, 1), (4, 1, 1, 1)))   # 8 ranks
        """
        self.conv2d.shard(strategy)
        batch, out = self.conv2d.in_strategy[0][0], self.conv2d.in_strategy[1][0]
        self.bias_add.shard(((batch, out, 1, 1), (out,)))
        return self

    def extend_repr(self):
        s = (f"input_channels={self.in_channels}, output_channels={self.out_channels}, "
             f"kernel_size={self.kernel_size}, stride={self.stride}, pad_mode={self.pad_mode}")
        if self.pad_mode == "pad":
            s += f", padding={self.padding}"
        if self.dilation != (1, 1):
            s += f", dilation={self.dilation}"
        if self.group != 1:
            s += f", group={self.group}"
        return s + f", has_bias={self.has_bias}"


def _deconv_length(pad_mode, size, k, s, d, pad_sum, extra):
    """Conv2dTranspose's output length along one axis (MindSpore's formulae; 'pad' is PyTorch's)."""
    ek = (k - 1) * d + 1
    if pad_mode == "same":
        return size * s
    if pad_mode == "valid":
        return size * s + max(ek - s, 0)
    return (size - 1) * s + ek - pad_sum + extra


class Conv2dTranspose(Cell):
    """2-D transposed convolution (upsampling): ``y = conv_transpose(x, weight) (+ bias)``.

    The gradient of a Conv2d with respect to its input, as a layer: each input pixel spreads
    ``x * weight`` over a kernel-sized window of the output, windows ``stride`` apart.

    Args:
        in_channels: input channels C.
        out_channels: output channels.
        kernel_size: int or (kh, kw).
        stride: int or (sh, sw).
        pad_mode: 'same' (output H = H * stride), 'valid' (H * stride + max(kh_eff - stride, 0),
            kh_eff = (kh - 1) * dilation + 1) or 'pad' ((H - 1) * stride + kh_eff - top - bottom
            + output_padding, as PyTorch's ConvTranspose2d).
        padding: int or (top, bottom, left, right): rows/columns cropped from the full output;
            only with pad_mode='pad'.
        output_padding: int or (h, w) pair, extra rows/columns at the bottom/right; only with
            pad_mode='pad', and less than stride.
        dilation: int or (dh, dw).
        group: groups; in_channels and out_channels must be divisible by it.
        has_bias: add a per-channel bias (MindSpore's default is False).
        weight_init: initializer of the (in_channels, out_channels / group, kh, kw) weight (default
            HeUniform(negative_slope=sqrt(5)), as MindSpore 2.x and PyTorch).
        bias_init: initializer of the bias (default U(-1/sqrt(fan_in), 1/sqrt(fan_in))).

    MindSpore and PyTorch differ on output_padding: MindSpore 2.10's layer appends zero rows,
    PyTorch computes them (they hold the windows' overlap where padding > 0). This layer
    computes them, as PyTorch and MindSpore's own ops.Conv2DTranspose given the larger size.

    Example:
        >>> up = nn.Conv2dTranspose(16, 8, 3, stride=2, pad_mode="pad", padding=1, output_padding=1)
        >>> up(minidl.Tensor(np.ones((2, 16, 8, 8), np.float32))).shape
        (2, 8, 16, 16)
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, pad_mode="same", padding=0, output_padding=0,
                 dilation=1, group=1, has_bias=False, weight_init=None, bias_init=None, dtype=float32):
        super().__init__()
        who = "Conv2dTranspose"
        self.in_channels = check_positive_int(who, "in_channels", in_channels)
        self.out_channels = check_positive_int(who, "out_channels", out_channels)
        self.group = check_positive_int(who, "group", group)
        if in_channels % group or out_channels % group:
            raise ValueError(f"{who}: in_channels={in_channels} and out_channels={out_channels} must both be "
                             f"divisible by group={group}")
        self.kernel_size = _pair(who, "kernel_size", kernel_size)
        self.stride = _pair(who, "stride", stride)
        self.dilation = _pair(who, "dilation", dilation)
        if pad_mode not in _PAD_MODES:
            raise ValueError(f"{who}: pad_mode must be one of {_PAD_MODES}, got {pad_mode!r}")
        self.pad_mode = pad_mode
        self.padding = _padding(who, padding, pad_mode)
        extra = (output_padding,) * 2 if isinstance(output_padding, int) and not isinstance(output_padding, bool) \
            else output_padding
        if (not isinstance(extra, (tuple, list)) or len(extra) != 2
                or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in extra)):
            raise ValueError(f"{who}: output_padding must be a non-negative int or a pair of them, got "
                             f"{output_padding!r}")
        if any(extra) and pad_mode != "pad":
            raise ValueError(f"{who}: output_padding={output_padding!r} needs pad_mode='pad', got {pad_mode!r}")
        for e, s, d in zip(extra, self.stride, self.dilation):
            if e >= max(s, d):
                raise ValueError(f"{who}: output_padding={output_padding!r} must be smaller than stride="
                                 f"{self.stride} or dilation={self.dilation}")
        self.output_padding = tuple(extra)
        self.has_bias = bool(has_bias)
        shape = (in_channels, out_channels // group) + self.kernel_size
        if weight_init is None:
            weight_init = default_weight_init()
        self.weight = make_parameter(who, "weight_init", weight_init, shape, dtype)
        self.bias = None
        if self.has_bias:
            if bias_init is None:
                bias_init = default_bias_init(shape[1] * shape[2] * shape[3])
            self.bias = make_parameter(who, "bias_init", bias_init, (out_channels,), dtype)
        # The op's attributes describe the Conv2d whose input gradient this is: its out_channel
        # is this layer's in_channels.
        self.conv2d_transpose = ops.Conv2DTranspose(in_channels, self.kernel_size, pad_mode=pad_mode,
                                                    pad=self.padding, stride=self.stride, dilation=self.dilation,
                                                    group=group)
        self.bias_add = ops.BiasAdd()

    def construct(self, x):
        shape = x.shape
        if len(shape) != 4 or shape[1] != self.in_channels:
            raise ValueError(f"Conv2dTranspose: input of shape {tuple(shape)} must be (N, C, H, W) with "
                             f"C = in_channels = {self.in_channels}")
        pads = self.conv2d_transpose.pad
        size = (shape[0], self.out_channels) + tuple(
            _deconv_length(self.pad_mode, shape[2 + a], self.kernel_size[a], self.stride[a], self.dilation[a],
                           pads[2 * a] + pads[2 * a + 1], self.output_padding[a]) for a in range(2))
        y = transpose_with_output_padding(self.conv2d_transpose, x, self.weight, size, self.output_padding)
        if self.has_bias:
            y = self.bias_add(y, self.bias)
        return y

    def shard(self, strategy):
        """Tensor parallelism: the Conv2DTranspose's strategy, the bias following its output cut. Returns self.

        ``strategy`` is ``((n, c_in, 1, 1), (c_in, c_out, 1, 1))``: cuts of the batch, the input
        channels (partial sums over them) and the output channels; H and W cannot be cut.

        Example:
            >>> up = nn.Conv2dTranspose(16, 32, 3).shard(((2, 1, 1, 1), (1, 4, 1, 1)))   # 8 ranks
        """
        self.conv2d_transpose.shard(strategy)
        batch, out = self.conv2d_transpose.in_strategy[0][0], self.conv2d_transpose.in_strategy[1][1]
        self.bias_add.shard(((batch, out, 1, 1), (out,)))
        return self

    def extend_repr(self):
        s = (f"input_channels={self.in_channels}, output_channels={self.out_channels}, "
             f"kernel_size={self.kernel_size}, stride={self.stride}, pad_mode={self.pad_mode}")
        if self.pad_mode == "pad":
            s += f", padding={self.padding}"
            if any(self.output_padding):
                s += f", output_padding={self.output_padding}"
        if self.dilation != (1, 1):
            s += f", dilation={self.dilation}"
        if self.group != 1:
            s += f", group={self.group}"
        return s + f", has_bias={self.has_bias}"
