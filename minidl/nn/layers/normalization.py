"""BatchNorm2d and BatchNorm1d, with MindSpore's momentum convention; LayerNorm and GroupNorm.

MindSpore's layer ``momentum`` is the weight of the OLD moving statistic
(moving = momentum * moving + (1 - momentum) * batch, default 0.9), while the primitive
``ops.BatchNorm`` takes the weight of the NEW batch statistic (PyTorch's convention), so the
layer passes ``1 - momentum`` down.

LayerNorm and GroupNorm normalise each sample by its own statistics: no moving statistics, the
same computation in training and inference.
"""
from ... import ops
from ...tensor import float32
from ..cell import Cell
from .basic import check_positive_int, make_parameter


class _BatchNorm(Cell):
    """Shared body: parameters gamma, beta (trainable), moving_mean, moving_variance (not)."""

    _ranks = (4,)
    _layout = "(N, C, H, W)"

    def __init__(self, num_features, eps=1e-5, momentum=0.9, affine=True, gamma_init="ones",
                 beta_init="zeros", moving_mean_init="zeros", moving_var_init="ones",
                 use_batch_statistics=None, data_format="NCHW", dtype=float32):
        super().__init__()
        who = type(self).__name__
        self.num_features = check_positive_int(who, "num_features", num_features)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
            raise ValueError(f"{who}: eps must be a positive number, got {eps!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum <= 1:
            raise ValueError(f"{who}: momentum must be in [0, 1] (the weight of the old moving statistic), "
                             f"got {momentum!r}")
        if use_batch_statistics not in (None, True, False):
            raise ValueError(f"{who}: use_batch_statistics must be None, True or False, got {use_batch_statistics!r}")
        if data_format != "NCHW":
            raise ValueError(f"{who}: only data_format='NCHW' is supported, got {data_format!r}")
        self.eps = float(eps)
        self.momentum = float(momentum)
        self.affine = bool(affine)
        self.use_batch_statistics = use_batch_statistics
        shape = (num_features,)
        self.moving_mean = make_parameter(who, "moving_mean_init", moving_mean_init, shape, dtype, requires_grad=False)
        self.moving_variance = make_parameter(who, "moving_var_init", moving_var_init, shape, dtype,
                                              requires_grad=False)
        self.gamma = make_parameter(who, "gamma_init", gamma_init, shape, dtype, requires_grad=self.affine)
        self.beta = make_parameter(who, "beta_init", beta_init, shape, dtype, requires_grad=self.affine)
        self.bn_train = ops.BatchNorm(is_training=True, epsilon=self.eps, momentum=1.0 - self.momentum,
                                      data_format=data_format)
        self.bn_infer = ops.BatchNorm(is_training=False, epsilon=self.eps, momentum=1.0 - self.momentum,
                                      data_format=data_format)

    def construct(self, x):
        return self._op(x)(x, self.gamma, self.beta, self.moving_mean, self.moving_variance)

    def with_relu(self, x, residual=None):
        """``relu(self(x) + residual)`` (residual optional), fused into one op (ops.BatchNormReLU).

        The ResNet blocks call it: the fused op keeps no intermediate activation and makes fewer
        passes over it than BatchNorm, Add and ReLU one after another. Subclasses with their own BatchNorm
        op (SyncBatchNorm) get the separate ops, with the same result. Under tensor parallelism the
        fused op's sharding rule runs it on each rank's block, or, in training with the batch cut,
        as the separate ops, so that BatchNorm's statistics cover the whole batch.

        Example:
            >>> out = self.bn2.with_relu(self.conv2(out), identity)   # end of a residual block
        """
        bn = self._op(x)
        if type(bn) is not ops.BatchNorm:
            y = bn(x, self.gamma, self.beta, self.moving_mean, self.moving_variance)
            return ops.relu(y if residual is None else y + residual)
        fused = ops.BatchNormReLU(bn.is_training, bn.epsilon, bn.momentum)
        args = (x, self.gamma, self.beta, self.moving_mean, self.moving_variance)
        return fused(*args) if residual is None else fused(*args, residual)

    def _op(self, x):
        """The BatchNorm primitive for x (training or inference statistics), once x is checked.

        A value without a shape (a pipeline's stand-in for another stage's output) is left for the
        op to check where it runs."""
        shape = getattr(x, "shape", None)
        if shape is not None and (len(shape) not in self._ranks or shape[1] != self.num_features):
            raise ValueError(f"{type(self).__name__}: input of shape {tuple(shape)} must be {self._layout} "
                             f"with C = num_features = {self.num_features}")
        batch_stats = self.training if self.use_batch_statistics is None else self.use_batch_statistics
        return self.bn_train if batch_stats else self.bn_infer

    def extend_repr(self):
        return f"num_features={self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}"


class BatchNorm2d(_BatchNorm):
    """Batch normalization over the channel axis of (N, C, H, W) inputs.

    In training mode the batch's mean and (biased) variance normalise the input and update
    the moving statistics; in inference mode the moving statistics are used.

    Args:
        num_features: channels C.
        eps: added to the variance.
        momentum: weight of the old moving statistic:
            ``moving = momentum * moving + (1 - momentum) * batch`` (MindSpore; PyTorch's 0.1
            is MindSpore's 0.9).
        affine: learn gamma and beta (False keeps them at their initial values).
        gamma_init, beta_init, moving_mean_init, moving_var_init: initializers.
        use_batch_statistics: None follows the training mode; True always uses (and tracks)
            batch statistics; False always uses the moving ones.
    """


class BatchNorm1d(_BatchNorm):
    """Batch normalization over the feature axis of (N, C) or (N, C, L) inputs; Args as BatchNorm2d."""

    _ranks = (2, 3)
    _layout = "(N, C) or (N, C, L)"


class LayerNorm(Cell):
    """Layer normalisation: each sample normalised over its trailing axes, then scaled and shifted.

    Args:
        normalized_shape: the shape of gamma and beta, a tuple or list of ints (an int is taken
            as a 1-tuple): the trailing part of the input's shape from begin_params_axis.
        begin_norm_axis: the first normalised axis of the input (default -1: the last).
        begin_params_axis: the first axis gamma and beta cover (default -1).
        gamma_init, beta_init: initializers of the Parameters ``gamma`` and ``beta`` (MindSpore's
            names; PyTorch's weight and bias).
        epsilon: added to the variance (default 1e-7, MindSpore's; PyTorch's eps is 1e-5).
        dtype: parameter dtype.

    Example:
        >>> ln = nn.LayerNorm((768,))
        >>> ln(x).shape                     # x (N, T, 768): each (n, t) row has mean 0, variance 1
    """

    def __init__(self, normalized_shape, begin_norm_axis=-1, begin_params_axis=-1, gamma_init="ones",
                 beta_init="zeros", epsilon=1e-7, dtype=float32):
        super().__init__()
        if isinstance(normalized_shape, int) and not isinstance(normalized_shape, bool):
            normalized_shape = (normalized_shape,)
        if not isinstance(normalized_shape, (tuple, list)) or not normalized_shape:
            raise TypeError(f"LayerNorm: normalized_shape must be a non-empty tuple or list of ints, got "
                            f"{normalized_shape!r}")
        for n in normalized_shape:
            check_positive_int("LayerNorm", "every entry of normalized_shape", n)
        self.normalized_shape = tuple(normalized_shape)
        self.layer_norm = ops.LayerNorm(begin_norm_axis, begin_params_axis, epsilon)
        self.begin_norm_axis, self.begin_params_axis = begin_norm_axis, begin_params_axis
        self.epsilon = self.layer_norm.epsilon
        self.gamma = make_parameter("LayerNorm", "gamma_init", gamma_init, self.normalized_shape, dtype)
        self.beta = make_parameter("LayerNorm", "beta_init", beta_init, self.normalized_shape, dtype)

    def construct(self, x):
        return self.layer_norm(x, self.gamma, self.beta)

    def shard(self, strategy):
        """Tensor parallelism: x's cuts (the normalised axes must stay whole); gamma and beta are cut
        as the trailing axes of x they cover. Returns self.

        Example:
            >>> nn.LayerNorm((64,)).shard(((2, 4, 1),))     # x (N, T, 64): batch in 2, sequence in 4
        """
        (s_x,) = strategy
        s_x = tuple(s_x)
        s_p = s_x[len(s_x) - len(self.normalized_shape):]
        self.layer_norm.shard((s_x, s_p, s_p))
        return self

    def extend_repr(self):
        return (f"normalized_shape={self.normalized_shape}, begin_norm_axis={self.begin_norm_axis}, "
                f"begin_params_axis={self.begin_params_axis}, epsilon={self.epsilon}")


class GroupNorm(Cell):
    """Group normalisation: the channels of each sample in num_groups groups, each group (with the
    spatial axes) normalised by its own statistics, then a per-channel scale and shift.

    Args:
        num_groups: G, which must divide num_channels.
        num_channels: C of inputs (N, C, *).
        eps: added to the variance (default 1e-5).
        affine: learn gamma and beta (False keeps them at their initial values).
        gamma_init, beta_init: initializers of the Parameters ``gamma`` and ``beta`` (C,).
        dtype: parameter dtype.

    Example:
        >>> gn = nn.GroupNorm(2, 4)
        >>> gn(x)                           # x (N, 4, H, W): channels {0, 1} and {2, 3} normalised
    """

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, gamma_init="ones", beta_init="zeros",
                 dtype=float32):
        super().__init__()
        self.num_groups = check_positive_int("GroupNorm", "num_groups", num_groups)
        self.num_channels = check_positive_int("GroupNorm", "num_channels", num_channels)
        if num_channels % num_groups:
            raise ValueError(f"GroupNorm: num_channels={num_channels} must be divisible by num_groups={num_groups}")
        self.group_norm = ops.GroupNorm(num_groups, eps)
        self.eps = self.group_norm.eps
        self.affine = bool(affine)
        shape = (num_channels,)
        self.gamma = make_parameter("GroupNorm", "gamma_init", gamma_init, shape, dtype, requires_grad=self.affine)
        self.beta = make_parameter("GroupNorm", "beta_init", beta_init, shape, dtype, requires_grad=self.affine)

    def construct(self, x):
        shape = tuple(x.shape)
        if len(shape) < 2 or shape[1] != self.num_channels:
            raise ValueError(f"GroupNorm: input of shape {shape} must be (N, C, ...) with C = num_channels = "
                             f"{self.num_channels}")
        return self.group_norm(x, self.gamma, self.beta)

    def extend_repr(self):
        return (f"num_groups={self.num_groups}, num_channels={self.num_channels}, eps={self.eps}, "
                f"affine={self.affine}")
