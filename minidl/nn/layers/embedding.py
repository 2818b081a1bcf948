"""Embedding: a lookup table of vectors, one row per token id (``ops.Gather`` on its rows)."""
from ... import ops
from ...tensor import float32
from ..cell import Cell
from .basic import check_positive_int, make_parameter


class Embedding(Cell):
    """Maps integer ids of any shape to rows of the table ``embedding_table`` (vocab_size, embedding_size).

    Args:
        vocab_size: number of rows (ids in [0, vocab_size); MindSpore's CPU Gather also takes
            -vocab_size <= id < 0, counted from the end; an id outside raises on the host).
        embedding_size: length of each row.
        use_one_hot: look up by ``one_hot(ids) @ table`` instead of a gather (MindSpore's option;
            the same result, more work).
        embedding_table: initializer of the table (default 'normal': N(0, 0.01 ** 2), MindSpore's;
            PyTorch's nn.Embedding draws N(0, 1)).
        dtype: the table's dtype (MindSpore's ``dtype`` is that of its one-hot values, its table
            always float32).
        padding_idx: None, or an id in [0, vocab_size) whose row starts at zero, whose output is a
            zero vector and which gets no gradient (so it stays zero), as PyTorch's padding_idx.
            (MindSpore 2.10's nn.Embedding only zeroes the row at initialisation and still trains
            it; its ops.embedding, like PyTorch, does not update it.)

    Inputs: integer ids of shape S. Output: (*S, embedding_size).

    Example:
        >>> emb = nn.Embedding(1000, 64)
        >>> emb(minidl.Tensor(np.array([[1, 5, 5]], np.int32))).shape
        (1, 3, 64)
    """

    def __init__(self, vocab_size, embedding_size, use_one_hot=False, embedding_table="normal", dtype=float32,
                 padding_idx=None):
        super().__init__()
        self.vocab_size = check_positive_int("Embedding", "vocab_size", vocab_size)
        self.embedding_size = check_positive_int("Embedding", "embedding_size", embedding_size)
        if not isinstance(use_one_hot, bool):
            raise TypeError(f"Embedding: use_one_hot must be a bool, got {use_one_hot!r}")
        if padding_idx is not None and (isinstance(padding_idx, bool) or not isinstance(padding_idx, int)
                                        or not 0 <= padding_idx < vocab_size):
            raise ValueError(f"Embedding: padding_idx must be None or an int in [0, {vocab_size}), got "
                             f"{padding_idx!r}")
        self.use_one_hot, self.padding_idx, self.dtype = use_one_hot, padding_idx, dtype
        table = make_parameter("Embedding", "embedding_table", embedding_table, (vocab_size, embedding_size), dtype)
        if padding_idx is not None:
            table.data[padding_idx] = 0
        self.embedding_table = table
        self.gather = ops.Gather()
        self.one_hot, self.cast, self.matmul, self.reshape = ops.OneHot(), ops.Cast(), ops.MatMul(), ops.Reshape()
        self.not_equal, self.expand_dims, self.mul = ops.NotEqual(), ops.ExpandDims(), ops.Mul()

    def construct(self, ids):
        if ids.dtype.kind not in "iu":
            raise TypeError(f"Embedding: ids must be integers, got dtype {ids.dtype}")
        table = self.embedding_table
        if self.use_one_hot:
            flat = self.reshape(ids, (-1,))
            rows = self.cast(self.one_hot(flat, self.vocab_size, 1.0, 0.0), table.dtype)
            y = self.reshape(self.matmul(rows, table), tuple(ids.shape) + (self.embedding_size,))
        else:
            y = self.gather(table, ids, 0)
        if self.padding_idx is not None:
            # Zeroing the padding ids' outputs also zeroes the gradient their row receives.
            keep = self.cast(self.not_equal(ids, self.padding_idx), table.dtype)
            y = self.mul(y, self.expand_dims(keep, -1))
        return y

    def shard(self, strategy):
        """Tensor parallelism: the Gather's strategy ``((vocab cut, embedding cut), ids' cuts)``. Returns self.

        ``((1, 1), (dp, 1))`` replicates the table and cuts the ids' batch; ``((mp, 1), (dp, 1))``
        is Megatron's vocabulary-parallel embedding: each rank holds vocab_size / mp rows, looks
        up the ids in its block (zero elsewhere), and the outputs are summed.

        Example:
            >>> nn.Embedding(32000, 512).shard(((4, 1), (2, 1)))     # 8 ranks: vocabulary in 4, batch in 2
        """
        self.gather.shard(strategy)
        return self

    def extend_repr(self):
        return (f"vocab_size={self.vocab_size}, embedding_size={self.embedding_size}, use_one_hot={self.use_one_hot}, "
                f"padding_idx={self.padding_idx}")
