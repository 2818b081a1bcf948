"""Conv2D and Conv2DTranspose: 2-D cross-correlation over NCHW inputs, by im2col and one GEMM.

The bodies here are the reference: readable, xp-generic (NumPy and CuPy), whole-batch.

    Conv2D forward     cols = im2col(x)                  (C*kh*kw, N*OH*OW)
                       y    = W @ cols                   W: (O, C*kh*kw), per group
    Conv2D backward    gW   = gY @ cols^T                gY: (O, N*OH*OW), dy as rows
                       gx   = col2im(W^T @ gY)           the adjoint of im2col: a scatter-add

Conv2DTranspose is the adjoint of Conv2D's forward in x: ``y = col2im(W^T @ dout)``; its
backward is a Conv2D forward of gy (``gdout = W @ im2col(gy)``) and, from the same columns,
``gW = dout @ im2col(gy)^T``.

The fast routes (flat rows for stride 1, stride phases, 1x1 GEMMs, cache-sized chunks on the
intra-op threads; memory-bounded chunks on the GPU) are kernels: minidl/kernels/cpu/conv.py and
minidl/kernels/cuda/conv.py, checked against these bodies (tests/minidl/kernels).
"""
import numbers

from ..backend import get_array_module
from ..tensor import is_grad_enabled
from .primitive import Primitive
from .manipulation import pad
from .linalg import BiasAdd
from .im2col import _PAD_MODES, _is_int, _pair, _pad_mode, _window_axis, col2im, im2col


class Conv2D(Primitive):
    """2-D convolution (cross-correlation) of x (N, C, H, W) with w (out_channel, C/group, kh, kw).

    Args:
        out_channel: output channels; must equal w.shape[0].
        kernel_size: int or (kh, kw); must match w.shape[2:].
        mode: 1 (cross-correlation), the only mode MindSpore defines.
        pad_mode: 'valid' (no padding), 'same' (output = ceil(input / stride); any odd pixel of
            padding goes to the bottom/right, as TensorFlow and MindSpore do) or 'pad' (``pad``).
        pad: int or (top, bottom, left, right); non-zero only with pad_mode='pad'.
        stride: int, (sh, sw) or (1, 1, sh, sw).
        dilation: int, (dh, dw) or (1, 1, dh, dw).
        group: input and output channels are split into this many independent groups.
        data_format: 'NCHW' only.

    Example:
        >>> conv = ops.Conv2D(8, 3, pad_mode="pad", pad=1)
        >>> conv(Tensor(np.ones((2, 3, 5, 5), np.float32)), Tensor(np.ones((8, 3, 3, 3), np.float32))).shape
        (2, 8, 5, 5)
    """

    n_inputs = 2

    def __init__(self, out_channel, kernel_size, mode=1, pad_mode="valid", pad=0, stride=1, dilation=1,
                 group=1, data_format="NCHW"):
        super().__init__()
        _set_conv_attrs(self, "Conv2D", out_channel, kernel_size, mode, pad_mode, pad, stride, dilation, group,
                        data_format)

    def _check(self, x, w):
        op, g = self.name, self.group
        if x.ndim != 4:
            raise ValueError(f"{op}: x must be 4-D (N, C, H, W), got shape {tuple(x.shape)}")
        if w.ndim != 4:
            raise ValueError(f"{op}: w must be 4-D (out_channel, C/group, kh, kw), got shape {tuple(w.shape)}")
        c = x.shape[1]
        if c % g:
            raise ValueError(f"{op}: x of shape {tuple(x.shape)} has {c} channels, not divisible by group={g}")
        want = (self.out_channel, c // g) + self.kernel_size
        if tuple(w.shape) != want:
            raise ValueError(f"{op}: w of shape {tuple(w.shape)} does not fit x of shape {tuple(x.shape)}: expected "
                             f"{want} (out_channel={self.out_channel}, C/group={c}/{g}, "
                             f"kernel_size={self.kernel_size})")
        if x.dtype != w.dtype:
            raise TypeError(f"{op}: x has dtype {x.dtype} but w has dtype {w.dtype}; cast one of them")

    def geometry(self, x_shape):
        """((OH, OW), (top, bottom, left, right) padding) of this conv on an input of x_shape."""
        (h, wd), (kh, kw), (sh, sw), (dh, dw) = x_shape[2:], self.kernel_size, self.stride, self.dilation
        pt, pb, pl, pr = self.pad
        where = f"x of shape {tuple(x_shape)}"
        oh, pt, pb = _window_axis(self.name, h, kh, sh, dh, self.pad_mode, pt, pb, where)
        ow, pl, pr = _window_axis(self.name, wd, kw, sw, dw, self.pad_mode, pl, pr, where)
        return (oh, ow), (pt, pb, pl, pr)

    def forward(self, x, w):
        self._check(x, w)
        xp = get_array_module(x, w)
        out_hw, self.pads = self.geometry(x.shape)
        g, o, n = self.group, self.out_channel, x.shape[0]
        cols = im2col(xp, x, self.kernel_size, self.stride, self.dilation, self.pads, out_hw)
        self.x, self.w = (x, w) if is_grad_enabled() else (None, None)  # backward rebuilds cols from x
        y = xp.matmul(w.reshape(g, o // g, -1), cols.reshape(g, -1, cols.shape[1]))  # (G, O/G, N*OH*OW)
        return xp.ascontiguousarray(y.reshape((o, n) + out_hw).transpose(1, 0, 2, 3))

    def backward(self, gy):
        xp = get_array_module(gy)
        x, w, g = self.x, self.w, self.group
        need_x, need_w = self.needs_grad
        geometry = (self.kernel_size, self.stride, self.dilation, self.pads, gy.shape[2:])
        rows = gy.transpose(1, 0, 2, 3).reshape(g, w.shape[0] // g, -1)  # (G, O/G, N*OH*OW)
        gx = gw = None
        if need_w:
            cols = im2col(xp, x, *geometry)
            gw = xp.matmul(rows, cols.reshape(g, -1, cols.shape[1]).swapaxes(1, 2)).reshape(w.shape)
        if need_x:
            gcols = xp.matmul(w.reshape(g, w.shape[0] // g, -1).swapaxes(1, 2), rows)  # (G, C/G*kh*kw, M)
            gx = xp.ascontiguousarray(col2im(xp, gcols.reshape(-1, rows.shape[2]), x.shape, *geometry))
        return gx, gw


def _set_conv_attrs(prim, op, out_channel, kernel_size, mode, pad_mode, pad, stride, dilation, group, data_format):
    """Checks and stores the attributes Conv2D and Conv2DTranspose share (MindSpore's names)."""
    if not _is_int(out_channel) or out_channel < 1:
        raise ValueError(f"{op}: out_channel must be a positive int, got {out_channel!r}")
    if mode != 1:
        raise ValueError(f"{op}: mode must be 1 (cross-correlation), got {mode!r}")
    if not _is_int(group) or group < 1:
        raise ValueError(f"{op}: group must be a positive int, got {group!r}")
    if out_channel % group:
        raise ValueError(f"{op}: out_channel={out_channel} must be divisible by group={group}")
    if data_format != "NCHW":
        raise ValueError(f"{op}: data_format={data_format!r} is not supported; only 'NCHW' is")
    prim.out_channel = out_channel
    prim.kernel_size = _pair(op, "kernel_size", kernel_size)
    prim.stride = _pair(op, "stride", stride, allow_nchw4=True)
    prim.dilation = _pair(op, "dilation", dilation, allow_nchw4=True)
    prim.pad_mode = _pad_mode(op, pad_mode, _PAD_MODES)
    if _is_int(pad):
        pads = (pad,) * 4
    elif isinstance(pad, (tuple, list)) and len(pad) == 4:
        pads = tuple(pad)
    else:
        raise ValueError(f"{op}: pad must be an int or a (top, bottom, left, right) tuple, got {pad!r}")
    if not all(_is_int(p) and p >= 0 for p in pads):
        raise ValueError(f"{op}: pad values must be non-negative ints, got {pad!r}")
    if prim.pad_mode != "pad" and any(pads):
        raise ValueError(f"{op}: pad={pad!r} needs pad_mode='pad', got pad_mode={pad_mode!r}")
    prim.pad = pads
    prim.group = group
    prim.mode = mode
    prim.data_format = data_format


class Conv2DTranspose(Primitive):
    """2-D transposed convolution: the gradient of a Conv2D with respect to its input, as an op.

    ``op(dout, w, input_size)`` spreads each pixel of dout, times w, over the window it came
    from in an image of shape ``input_size``: the adjoint of ``Conv2D(out_channel, kernel_size,
    ...)(x, w)`` for x of that shape. Upsampling layers (nn.Conv2dTranspose) use it. The
    attributes describe that Conv2D, as in MindSpore (which spells the same op
    Conv2DBackpropInput): out_channel is dout's channels, the output has w.shape[1] * group.

    Args:
        out_channel: the Conv2D's output channels: dout's channels and w.shape[0].
        kernel_size, pad_mode, pad, mode, stride, dilation, group, data_format: the Conv2D's,
            as ops.Conv2D takes them ('same' pads are computed from input_size).
        pad_list: (top, bottom, left, right), or None; replaces pad with pad_mode='pad'
            (MindSpore's primitive takes it; nn layers never need it).

    Inputs:
        dout: (N, out_channel, H, W).
        w: (out_channel, C / group, kh, kw).
        input_size: (N, C, Hi, Wi), the output's shape; the Conv2D must map (Hi, Wi) to (H, W).

    Example:
        >>> up = ops.Conv2DTranspose(out_channel=8, kernel_size=3, pad_mode="pad", pad=1, stride=2)
        >>> up(Tensor(np.ones((2, 8, 4, 4))), Tensor(np.ones((8, 3, 3, 3))), (2, 3, 8, 8)).shape
        (2, 3, 8, 8)
    """

    n_inputs = 3
    n_tensor_inputs = 2  # dout and w; input_size is a shape

    def __init__(self, out_channel, kernel_size, pad_mode="valid", pad=0, pad_list=None, mode=1, stride=1,
                 dilation=1, group=1, data_format="NCHW"):
        super().__init__()
        op = "Conv2DTranspose"
        _set_conv_attrs(self, op, out_channel, kernel_size, mode, pad_mode, pad, stride, dilation, group, data_format)
        if pad_list is not None:
            if (not isinstance(pad_list, (tuple, list)) or len(pad_list) != 4
                    or not all(_is_int(p) and p >= 0 for p in pad_list)):
                raise ValueError(f"{op}: pad_list must be None or (top, bottom, left, right) non-negative ints, "
                                 f"got {pad_list!r}")
            if self.pad_mode != "pad":
                raise ValueError(f"{op}: pad_list={pad_list!r} needs pad_mode='pad', got pad_mode={pad_mode!r}")
            self.pad = tuple(pad_list)

    def _check(self, dout, w, input_size):
        """input_size as a tuple, after checking that dout, w and it describe one Conv2D."""
        op, g = self.name, self.group
        if (not isinstance(input_size, (tuple, list))
                or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in input_size)):
            raise TypeError(f"{op}: input_size must be a tuple of 4 ints (N, C, H, W), got {input_size!r}")
        size = tuple(int(v) for v in input_size)
        if len(size) != 4 or min(size) < 1:
            raise ValueError(f"{op}: input_size must be 4 positive ints (N, C, H, W), got {input_size!r}")
        if dout.ndim != 4:
            raise ValueError(f"{op}: dout must be 4-D (N, out_channel, H, W), got shape {tuple(dout.shape)}")
        if w.ndim != 4:
            raise ValueError(f"{op}: w must be 4-D (out_channel, C/group, kh, kw), got shape {tuple(w.shape)}")
        n, c = size[:2]
        if c % g:
            raise ValueError(f"{op}: input_size={size} has {c} channels, not divisible by group={g}")
        want = (self.out_channel, c // g) + self.kernel_size
        if tuple(w.shape) != want:
            raise ValueError(f"{op}: w of shape {tuple(w.shape)} does not fit input_size={size}: expected {want} "
                             f"(out_channel={self.out_channel}, C/group={c}/{g}, kernel_size={self.kernel_size})")
        if tuple(dout.shape[:2]) != (n, self.out_channel):
            raise ValueError(f"{op}: dout of shape {tuple(dout.shape)} must have N={n} (input_size[0]) and "
                             f"out_channel={self.out_channel} channels")
        if dout.dtype != w.dtype:
            raise TypeError(f"{op}: dout has dtype {dout.dtype} but w has dtype {w.dtype}; cast one of them")
        return size

    def geometry(self, size, dout_shape):
        """The Conv2D's ((OH, OW), padding) for an input of ``size``, after checking that it maps
        size to dout's (H, W). The bottom/right padding is the one the windows really reach:
        less than the Conv2D's by the rows its stride left unread, negative where the windows
        stop short of the image's end (those rows of the output get nothing: zeros)."""
        (h, wd), (kh, kw), (sh, sw), (dh, dw) = size[2:], self.kernel_size, self.stride, self.dilation
        pt, pb, pl, pr = self.pad
        where = f"input_size {size}"
        oh, pt, pb = _window_axis(self.name, h, kh, sh, dh, self.pad_mode, pt, pb, where)
        ow, pl, pr = _window_axis(self.name, wd, kw, sw, dw, self.pad_mode, pl, pr, where)
        if (oh, ow) != tuple(dout_shape[2:]):
            raise ValueError(f"{self.name}: dout of shape {tuple(dout_shape)} does not fit input_size={size}: the "
                             f"Conv2D (kernel_size={self.kernel_size}, stride={self.stride}, dilation={self.dilation}, "
                             f"pad_mode={self.pad_mode!r}, pad={self.pad}) maps {(h, wd)} to {(oh, ow)}, "
                             f"not {tuple(dout_shape[2:])}")
        pb = (oh - 1) * sh + (kh - 1) * dh + 1 - pt - h
        pr = (ow - 1) * sw + (kw - 1) * dw + 1 - pl - wd
        return (oh, ow), (pt, pb, pl, pr)

    def forward(self, dout, w, input_size):
        size = self._check(dout, w, input_size)
        xp = get_array_module(dout, w)
        out_hw, self.pads = self.geometry(size, dout.shape)
        g, o = self.group, self.out_channel
        self.dout, self.w = (dout, w) if is_grad_enabled() else (None, None)
        rows = dout.transpose(1, 0, 2, 3).reshape(g, o // g, -1)  # (G, O/G, N*H*W)
        cols = xp.matmul(w.reshape(g, o // g, -1).swapaxes(1, 2), rows)  # W^T @ dout: (G, C/G*kh*kw, N*H*W)
        y = col2im(xp, cols.reshape(-1, rows.shape[2]), size, self.kernel_size, self.stride, self.dilation,
                   self.pads, out_hw)
        return xp.ascontiguousarray(y)

    def backward(self, gy):
        xp = get_array_module(gy)
        dout, w, g = self.dout, self.w, self.group
        need_dout, need_w = self.needs_grad[:2]
        cols = im2col(xp, gy, self.kernel_size, self.stride, self.dilation, self.pads, dout.shape[2:])
        cols = cols.reshape(g, -1, cols.shape[1])  # (G, C/G*kh*kw, N*H*W)
        o, n = w.shape[0], dout.shape[0]
        gdout = gw = None
        if need_dout:  # a Conv2D forward of gy
            gdout = xp.matmul(w.reshape(g, o // g, -1), cols).reshape((o, n) + dout.shape[2:])
            gdout = xp.ascontiguousarray(gdout.transpose(1, 0, 2, 3))
        if need_w:
            rows = dout.transpose(1, 0, 2, 3).reshape(g, o // g, -1)
            gw = xp.matmul(rows, cols.swapaxes(1, 2)).reshape(w.shape)
        return gdout, gw, None


def conv2d(x, w, stride=1, pad_mode="valid", padding=0, dilation=1, groups=1):
    """Functional Conv2D; the output channels and kernel size are read from w.

    Example:
        >>> ops.conv2d(x, w, stride=2, pad_mode="same")
    """
    shape = tuple(getattr(w, "shape", ()))
    if len(shape) != 4:
        raise ValueError(f"conv2d: w must be 4-D (out_channel, C/groups, kh, kw), got shape {shape}")
    return Conv2D(shape[0], shape[2:], pad_mode=pad_mode, pad=padding, stride=stride, dilation=dilation,
                  group=groups)(x, w)


def _two(op, arg, value, low):
    """An int or a pair of ints >= low, as a pair."""
    v = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(v) != 2 or not all(_is_int(e) and e >= low for e in v):
        raise ValueError(f"{op}: {arg} must be an int or a pair of ints >= {low}, got {value!r}")
    return v


def conv_transpose2d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """Functional transposed convolution with MindSpore 2.10's (and PyTorch's) signature.

    Output size per axis: ``(H - 1) * stride - 2 * padding + dilation * (k - 1) + output_padding + 1``,
    values as torch.nn.functional.conv_transpose2d.

    Args:
        input: (N, C_in, H, W).
        weight: (C_in, C_out / groups, kh, kw).
        bias: None or (C_out,).
        stride, padding, dilation: int or (h, w) pair.
        output_padding: int or pair, extra rows/columns at the bottom/right; less than stride
            or, where dilation > stride, than dilation (as PyTorch and MindSpore).
        groups: channel groups; C_in must be divisible by it.

    Example:
        >>> ops.conv_transpose2d(Tensor(np.ones((1, 4, 5, 5))), Tensor(np.ones((4, 8, 3, 3)))).shape
        (1, 8, 7, 7)
    """
    op = "conv_transpose2d"
    shape, wshape = tuple(getattr(input, "shape", ())), tuple(getattr(weight, "shape", ()))
    if len(shape) != 4:
        raise ValueError(f"{op}: input must be 4-D (N, C_in, H, W), got shape {shape}")
    if len(wshape) != 4:
        raise ValueError(f"{op}: weight must be 4-D (C_in, C_out/groups, kh, kw), got shape {wshape}")
    if not _is_int(groups) or groups < 1:
        raise ValueError(f"{op}: groups must be a positive int, got {groups!r}")
    s, d = _two(op, "stride", stride, 1), _two(op, "dilation", dilation, 1)
    p, extra = _two(op, "padding", padding, 0), _two(op, "output_padding", output_padding, 0)
    if shape[1] != wshape[0] or shape[1] % groups:
        raise ValueError(f"{op}: input of shape {shape} has {shape[1]} channels; weight of shape {wshape} needs "
                         f"C_in = weight.shape[0] = {wshape[0]}, divisible by groups={groups}")
    for a in range(2):
        if extra[a] >= max(s[a], d[a]):
            raise ValueError(f"{op}: output_padding={output_padding!r} must be smaller than stride={stride!r} or "
                             f"dilation={dilation!r}")
    size = [shape[0], wshape[1] * groups]
    for a in range(2):
        size.append((shape[2 + a] - 1) * s[a] - 2 * p[a] + d[a] * (wshape[2 + a] - 1) + extra[a] + 1)
    if min(size[2:]) < 1:
        raise ValueError(f"{op}: input of shape {shape} gives an empty output {tuple(size)}: padding={padding!r} "
                         f"is too large")
    prim = Conv2DTranspose(wshape[0], wshape[2:], pad_mode="pad", pad=(p[0], p[0], p[1], p[1]), stride=s,
                           dilation=d, group=groups)
    y = transpose_with_output_padding(prim, input, weight, tuple(size), extra)
    return y if bias is None else BiasAdd()(y, bias)


def transpose_with_output_padding(prim, x, w, size, extra):
    """``prim`` (a Conv2DTranspose in 'pad' mode) on x and w to an output of ``size`` that has ``extra``
    output padding rows / columns at the bottom / right.

    An output_padding below the stride is the primitive's own business (the Conv2D it is the
    adjoint of maps ``size`` back to x's size). From the stride up (allowed where dilation >
    stride) no Conv2D maps ``size`` back, so it runs as a composite: the whole transposed
    convolution (no padding), cropped by the padding, with zero rows appended where the output
    reaches past it (no input touches them). Gradients come from the two primitives.
    """
    (sh, sw), pads = prim.stride, prim.pad
    if extra[0] < sh and extra[1] < sw:
        return prim(x, w, size)
    pt, pb, pl, pr = pads
    (kh, kw), (dh, dw) = prim.kernel_size, prim.dilation
    n, _, h, wd = x.shape
    whole = (n, size[1], (h - 1) * sh + (kh - 1) * dh + 1, (wd - 1) * sw + (kw - 1) * dw + 1)
    y = Conv2DTranspose(prim.out_channel, prim.kernel_size, pad_mode="valid", stride=prim.stride,
                        dilation=prim.dilation, group=prim.group)(x, w, whole)
    return pad(y, (-pl, extra[1] - pr, -pt, extra[0] - pb))


__all__ = ["Conv2D", "conv2d", "Conv2DTranspose", "conv_transpose2d"]
