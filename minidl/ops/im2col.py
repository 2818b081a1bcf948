"""Sliding windows for Conv2D, Conv2DTranspose and the pooling ops: argument parsing, output
geometry, and the reference im2col / col2im.

``im2col`` lays every window of a (padded) image out as one column, channel-major: row
``(c, i, j)`` holds input channel c at kernel offset (i, j), column ``(n, oh, ow)`` the window
of output pixel (oh, ow) of image n. A convolution is then one GEMM of the weights, seen as an
(out_channel, C*kh*kw) matrix, with these columns. ``col2im`` is its adjoint: each column's
entries are added back onto the pixels they were read from.

These are readable and xp-generic (NumPy and CuPy); the fast, chunked and cache-aware versions
are the conv kernels' (minidl/kernels/cpu/im2col.py).
"""
_PAD_MODES = ("valid", "same", "pad")


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _pair(op, arg, value, allow_nchw4=False):
    """An int, a pair, or (MindSpore style) a (1, 1, h, w) 4-tuple, as a pair of positive ints."""
    v = value
    if _is_int(v):
        v = (v, v)
    elif isinstance(v, (tuple, list)) and len(v) == 4 and allow_nchw4 and tuple(v[:2]) == (1, 1):
        v = tuple(v[2:])
    if not isinstance(v, (tuple, list)) or len(v) != 2 or not all(_is_int(e) and e >= 1 for e in v):
        what = ("a positive int, a pair of positive ints or a (1, 1, h, w) tuple" if allow_nchw4
                else "a positive int or a pair of positive ints")
        raise ValueError(f"{op}: {arg} must be {what}, got {value!r}")
    return tuple(v)


def _pad_mode(op, pad_mode, allowed):
    mode = pad_mode.lower() if isinstance(pad_mode, str) else pad_mode
    if mode not in allowed:
        raise ValueError(f"{op}: pad_mode must be one of {allowed} (case-insensitive), got {pad_mode!r}")
    return mode


def _window_axis(op, size, k, s, d, mode, pad_lo, pad_hi, what):
    """(out, pad_lo, pad_hi) along one spatial axis; 'same' pads TF-style (extra at the end)."""
    ek = (k - 1) * d + 1  # extent of a dilated kernel
    if mode == "same":
        out = -(-size // s)
        total = max((out - 1) * s + ek - size, 0)
        pad_lo, pad_hi = total // 2, total - total // 2
    else:
        out = (size + pad_lo + pad_hi - ek) // s + 1
    if out < 1:
        raise ValueError(f"{op}: {what}: the input is too small for the window (kernel {k}, dilation {d}, "
                         f"stride {s}, padding ({pad_lo}, {pad_hi}) along an axis of size {size}); "
                         f"the output would have size {max(out, 0)}")
    return out, pad_lo, pad_hi


def im2col(xp, x, kernel, stride, dilation, pads, out_hw):
    """The windows of x (N, C, H, W) as columns: a (C*kh*kw, N*OH*OW) matrix.

    ``pads`` (top, bottom, left, right) of zeros surround x; a negative bottom/right pad only
    says the windows stop short of x's end (Conv2DTranspose's geometry). The windows are a
    strided view of the padded image, (N, C, kh, kw, OH, OW); one copy lays them out.
    """
    (kh, kw), (sh, sw), (dh, dw), (oh, ow) = kernel, stride, dilation, out_hw
    pt, pb, pl, pr = pads
    n, c = x.shape[:2]
    xpad = xp.pad(x, ((0, 0), (0, 0), (pt, max(pb, 0)), (pl, max(pr, 0))))
    s_n, s_c, s_h, s_w = xpad.strides
    windows = xp.lib.stride_tricks.as_strided(
        xpad, shape=(n, c, kh, kw, oh, ow), strides=(s_n, s_c, dh * s_h, dw * s_w, sh * s_h, sw * s_w))
    return windows.transpose(1, 2, 3, 0, 4, 5).reshape(c * kh * kw, n * oh * ow)


def col2im(xp, cols, x_shape, kernel, stride, dilation, pads, out_hw):
    """The adjoint of im2col: columns (C*kh*kw, N*OH*OW) summed back onto an image of x_shape."""
    (kh, kw), (sh, sw), (dh, dw), (oh, ow) = kernel, stride, dilation, out_hw
    pt, pb, pl, pr = pads
    n, c, h, w = x_shape
    cols = cols.reshape(c, kh, kw, n, oh, ow)
    gpad = xp.zeros((n, c, h + pt + max(pb, 0), w + pl + max(pr, 0)), dtype=cols.dtype)
    for i in range(kh):
        for j in range(kw):  # offset (i, j) of every window: a strided slice of the padded image
            rows = slice(i * dh, i * dh + sh * (oh - 1) + 1, sh)
            columns = slice(j * dw, j * dw + sw * (ow - 1) + 1, sw)
            gpad[:, :, rows, columns] += cols[:, i, j].transpose(1, 0, 2, 3)
    return gpad[:, :, pt:pt + h, pl:pl + w]
