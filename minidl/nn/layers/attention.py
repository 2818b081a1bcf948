"""MultiheadAttention: softmax attention over several heads, with MindSpore's signature.

    attn = nn.MultiheadAttention(64, 4)                     # inputs (L, N, E): batch_first=False
    out, weights = attn(x, x, x, attn_mask=causal_mask)     # self-attention of a decoder

Composed of primitives (Dense, Reshape, Transpose, BatchMatMul, Softmax, Dropout), so its
gradient comes from theirs and each can be sharded: ``shard(model_parallel)`` gives the Megatron
layout (heads cut over the ranks: q/k/v column-parallel, the output projection row-parallel).

One difference from MindSpore and PyTorch, on purpose: the q, k and v projections are three
``Dense`` cells (``q_proj``, ``k_proj``, ``v_proj``) rather than one fused ``in_proj_weight`` of
shape (3E, E). A cut of the fused weight's rows over t ranks would give rank 0 all of q and half of
k; three weights cut by rows give every rank whole heads of all three, with no communication.
"""
import math

import numpy

from ... import ops
from ...backend import get_array_module
from ...common.initializer import Uniform, XavierUniform
from ...tensor import Tensor, float32
from ..cell import Cell
from .basic import Dense, Dropout, check_positive_int


class MultiheadAttention(Cell):
    """Multi-head scaled dot-product attention (Vaswani et al.), as ``mindspore.nn.MultiheadAttention``.

    Args:
        embed_dim: the model dimension E (query size and output size).
        num_heads: number of heads H; E must be divisible by H.
        dropout: drop probability of the attention weights, in training (default 0.0).
        has_bias: biases on the projections (default True).
        add_bias_kv, add_zero_attn: not supported (must be False).
        kdim, vdim: sizes of key and value features (default E).
        batch_first: inputs (N, L, E) when True; (L, N, E) when False (the default, as MindSpore).
        dtype: parameter dtype (default float32).

    Inputs:
        query (L, N, E), key (S, N, kdim), value (S, N, vdim) (batch first when ``batch_first``;
        unbatched (L, E) inputs are accepted too); ``key_padding_mask`` (N, S) and ``attn_mask``
        (L, S) or (N * H, L, S), each bool (True: may not attend) or float (added to the scores);
        ``need_weights``, ``average_attn_weights``.

    Returns:
        ``(output, weights)`` with weights (N, L, S) averaged over heads, or (N, H, L, S) when
        ``average_attn_weights=False``; ``(output,)`` when ``need_weights=False`` (MindSpore's
        convention; PyTorch returns ``(output, None)``).

    Example:
        >>> attn = nn.MultiheadAttention(8, 2, batch_first=True)
        >>> x = minidl.Tensor(np.ones((2, 5, 8), np.float32))
        >>> attn(x, x, x)[0].shape
        (2, 5, 8)
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, has_bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, dtype=float32):
        super().__init__()
        who = "MultiheadAttention"
        self.embed_dim = check_positive_int(who, "embed_dim", embed_dim)
        self.num_heads = check_positive_int(who, "num_heads", num_heads)
        if embed_dim % num_heads:
            raise ValueError(f"{who}: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if add_bias_kv or add_zero_attn:
            raise NotImplementedError(f"{who}: add_bias_kv and add_zero_attn are not supported (got "
                                      f"add_bias_kv={add_bias_kv}, add_zero_attn={add_zero_attn})")
        self.kdim = embed_dim if kdim is None else check_positive_int(who, "kdim", kdim)
        self.vdim = embed_dim if vdim is None else check_positive_int(who, "vdim", vdim)
        self.head_dim = embed_dim // num_heads
        self.batch_first = bool(batch_first)
        e = embed_dim
        # MindSpore draws its fused (3E, E) in_proj_weight from XavierUniform: bound sqrt(6 / 4E).
        # The three blocks of it keep that distribution; separate k/v sizes get their own Xavier.
        same = self.kdim == e and self.vdim == e
        proj_init = Uniform(math.sqrt(6.0 / (4 * e))) if same else XavierUniform()
        self.q_proj = Dense(e, e, weight_init=proj_init, bias_init="zeros", has_bias=has_bias, dtype=dtype)
        self.k_proj = Dense(self.kdim, e, weight_init=proj_init, bias_init="zeros", has_bias=has_bias, dtype=dtype)
        self.v_proj = Dense(self.vdim, e, weight_init=proj_init, bias_init="zeros", has_bias=has_bias, dtype=dtype)
        self.out_proj = Dense(e, e, has_bias=has_bias, dtype=dtype)
        self.attn_dropout = Dropout(p=dropout)
        self.split_heads = ops.Reshape()
        self.heads_first = ops.Transpose()
        self.scores = ops.BatchMatMul(transpose_b=True)
        self.scale = ops.Mul()
        self.add_mask = ops.Add()
        self.softmax = ops.Softmax(-1)
        self.mix = ops.BatchMatMul()
        self.heads_last = ops.Transpose()
        self.merge_heads = ops.Reshape()
        self.swap_batch = ops.Transpose()
        self.mean_heads = ops.ReduceMean()

    def construct(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                  average_attn_weights=True):
        batched = query.ndim == 3
        if query.ndim not in (2, 3) or key.ndim != query.ndim or value.ndim != query.ndim:
            raise ValueError(f"MultiheadAttention: query, key and value must all be 3-D (batched) or all 2-D, got "
                             f"shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        if not batched:  # one sequence: a batch of one, in the batch-first layout
            query, key, value = (x.reshape((1,) + tuple(x.shape)) for x in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.reshape((1,) + tuple(key_padding_mask.shape))
        elif not self.batch_first:
            query, key, value = (self.swap_batch(x, (1, 0, 2)) for x in (query, key, value))
        n, tgt, src = query.shape[0], query.shape[1], key.shape[1]
        self._check_inputs(query, key, value)
        q, k, v = self._heads(self.q_proj(query)), self._heads(self.k_proj(key)), self._heads(self.v_proj(value))
        scores = self.scale(self.scores(q, k), 1.0 / math.sqrt(self.head_dim))  # (N, H, L, S)
        mask = self._mask(attn_mask, key_padding_mask, n, tgt, src, scores.dtype)
        if mask is not None:
            scores = self.add_mask(scores, mask)
        weights = self.attn_dropout(self.softmax(scores))
        out = self.heads_last(self.mix(weights, v), (0, 2, 1, 3))  # (N, L, H, D)
        out = self.out_proj(self.merge_heads(out, (n, tgt, self.embed_dim)))
        if not batched:
            out = out.reshape(tuple(out.shape[1:]))
        elif not self.batch_first:
            out = self.swap_batch(out, (1, 0, 2))
        if not need_weights:
            return (out,)
        if average_attn_weights:
            weights = self.mean_heads(weights, 1)
        return out, (weights.reshape(tuple(weights.shape[1:])) if not batched else weights)

    def _heads(self, x):
        """(N, L, E) -> (N, H, L, D)."""
        n, length = x.shape[0], x.shape[1]
        return self.heads_first(self.split_heads(x, (n, length, self.num_heads, self.head_dim)), (0, 2, 1, 3))

    def _check_inputs(self, query, key, value):
        for name, x, size in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if x.shape[-1] != size:
                raise ValueError(f"MultiheadAttention: {name} has {x.shape[-1]} features, expected {size} "
                                 f"(shape {tuple(x.shape)}, batch_first={self.batch_first})")
        if key.shape[:2] != value.shape[:2] or key.shape[0] != query.shape[0]:
            raise ValueError(f"MultiheadAttention: key {tuple(key.shape)} and value {tuple(value.shape)} must share "
                             f"their batch and length, and the batch must be the query's "
                             f"{tuple(query.shape)} (batch first)")

    def _mask(self, attn_mask, key_padding_mask, n, tgt, src, dtype):
        """The additive mask (broadcastable to (N, H, L, S)) of both masks, or None.

        Masks are constants (no gradient flows to them), so a bool mask becomes its additive form
        (-inf where True) directly on its array.
        """
        total = None
        if attn_mask is not None:
            m = _additive("attn_mask", attn_mask, dtype)
            if m.ndim == 2 and tuple(m.shape) == (tgt, src):
                m = m.reshape((1, 1, tgt, src))
            elif m.ndim == 3 and tuple(m.shape) == (n * self.num_heads, tgt, src):
                m = m.reshape((n, self.num_heads, tgt, src))
            else:
                raise ValueError(f"MultiheadAttention: attn_mask must have shape {(tgt, src)} or "
                                 f"{(n * self.num_heads, tgt, src)}, got {tuple(m.shape)}")
            total = m
        if key_padding_mask is not None:
            m = _additive("key_padding_mask", key_padding_mask, dtype)
            if tuple(m.shape) != (n, src):
                raise ValueError(f"MultiheadAttention: key_padding_mask must have shape {(n, src)}, "
                                 f"got {tuple(m.shape)}")
            m = m.reshape((n, 1, 1, src))
            total = m if total is None else total + m
        return total

    def shard(self, model_parallel, data_parallel=1):
        """Megatron's layout over ``data_parallel * model_parallel`` ranks: heads cut in
        ``model_parallel`` (q/k/v column-parallel, attention per head, the output projection
        row-parallel: one all-reduce of its partial sums), the batch cut in ``data_parallel``.
        Returns self.

        Example:
            >>> attn = nn.MultiheadAttention(64, 8, batch_first=True).shard(4)   # 4 ranks, 2 heads each
        """
        mp, dp = model_parallel, data_parallel
        if self.num_heads % mp:
            raise ValueError(f"MultiheadAttention.shard: num_heads ({self.num_heads}) must be divisible by "
                             f"model_parallel ({mp})")
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            proj.shard(((dp, 1), (mp, 1)))
        self.split_heads.shard(((dp, 1, mp),))
        self.heads_first.shard(((dp, 1, mp, 1),))
        self.scores.shard(((dp, mp, 1, 1), (dp, mp, 1, 1)))
        self.softmax.shard(((dp, mp, 1, 1),))
        self.mix.shard(((dp, mp, 1, 1), (dp, mp, 1, 1)))
        self.heads_last.shard(((dp, mp, 1, 1),))
        self.merge_heads.shard(((dp, 1, mp, 1),))
        self.out_proj.shard(((dp, mp), (1, mp)))
        return self

    def extend_repr(self):
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, kdim={self.kdim}, vdim={self.vdim}, "
                f"batch_first={self.batch_first}")


def _additive(name, mask, dtype):
    """A mask as a constant float Tensor to add to the scores: a bool mask gives -inf where True."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"MultiheadAttention: {name} must be a Tensor, got {type(mask).__name__}")
    data = mask.data
    if data.dtype == numpy.bool_ or data.dtype == numpy.uint8:
        xp = get_array_module(data)
        return Tensor(xp.where(data.astype(bool), -numpy.inf, 0.0).astype(dtype))
    if data.dtype.kind != "f":
        raise TypeError(f"MultiheadAttention: {name} must be bool or float, got dtype {data.dtype}")
    return Tensor(data.astype(dtype, copy=False))


__all__ = ["MultiheadAttention"]
