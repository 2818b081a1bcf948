"""BatchNorm2d and BatchNorm1d, with MindSpore's momentum convention.

MindSpore's layer ``momentum`` is the weight of the OLD moving statistic
(moving = momentum * moving + (1 - momentum) * batch, default 0.9), while the primitive
``ops.BatchNorm`` takes the weight of the NEW batch statistic (PyTorch's convention), so the
layer passes ``1 - momentum`` down.
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
        """The BatchNorm primitive for x (training or inference statistics), once x is checked."""
        shape = x.shape
        if len(shape) not in self._ranks or shape[1] != self.num_features:
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
