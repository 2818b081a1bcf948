"""A small decoder-only Transformer (GPT): token and position embeddings, pre-LayerNorm blocks of
causal self-attention and a GELU MLP, a final LayerNorm and a head tied to the token embedding
(or not).

    net = GPT(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=64)
    logits = net(tokens)                     # tokens (N, T) int -> logits (N, T, vocab_size)
    more = net.generate(tokens, 100)         # sampling, one token at a time

``shard(model_parallel)`` lays it out the Megatron way (see its docstring and
examples/megatron_gpt.py).
"""
import numpy

from .. import backend, nn, ops
from ..common.initializer import Normal
from ..tensor import Tensor, float32, no_grad


class MLP(nn.Cell):
    """Dense(E, 4E) -> GELU -> Dense(4E, E) -> Dropout."""

    def __init__(self, n_embd, dropout=0.0, dtype=float32):
        super().__init__()
        self.fc = nn.Dense(n_embd, 4 * n_embd, weight_init=Normal(0.02), bias_init="zeros", dtype=dtype)
        self.gelu = nn.GELU()
        self.proj = nn.Dense(4 * n_embd, n_embd, weight_init=Normal(0.02), bias_init="zeros", dtype=dtype)
        self.dropout = nn.Dropout(p=dropout)

    def construct(self, x):
        return self.dropout(self.proj(self.gelu(self.fc(x))))

    def shard(self, model_parallel, data_parallel=1):
        """Column-parallel fc (each rank 1/mp of the hidden units), row-parallel proj (partial sums)."""
        self.fc.shard(((data_parallel, 1), (model_parallel, 1)))
        self.proj.shard(((data_parallel, model_parallel), (1, model_parallel)))
        return self


class Block(nn.Cell):
    """x + attn(ln_1(x)), then x + mlp(ln_2(x)): the pre-LayerNorm Transformer block (GPT-2)."""

    def __init__(self, n_embd, n_head, dropout=0.0, dtype=float32):
        super().__init__()
        self.ln_1 = nn.LayerNorm((n_embd,), dtype=dtype)
        self.attn = nn.MultiheadAttention(n_embd, n_head, dropout=dropout, batch_first=True, dtype=dtype)
        self.ln_2 = nn.LayerNorm((n_embd,), dtype=dtype)
        self.mlp = MLP(n_embd, dropout, dtype)
        self.residual_attn = ops.Add()
        self.residual_mlp = ops.Add()

    def construct(self, x, causal_mask):
        h = self.ln_1(x)
        x = self.residual_attn(x, self.attn(h, h, h, attn_mask=causal_mask, need_weights=False)[0])
        return self.residual_mlp(x, self.mlp(self.ln_2(x)))


class GPT(nn.Cell):
    """A GPT language model: ``logits = GPT(...)(tokens)``.

    Args:
        vocab_size: number of token ids.
        block_size: the longest context (positions) it can take.
        n_layer, n_head, n_embd: depth, heads per attention, model width (n_embd % n_head == 0).
        dropout: drop probability after the embeddings, in attention and after each MLP.
        tie_weights: the output head reuses the token embedding table (default True, as GPT-2);
            False gives the head its own ``Dense(n_embd, vocab_size, has_bias=False)``.
        dtype: parameter dtype.

    Weights start as GPT-2's: N(0, 0.02) for embeddings and projections, zero biases,
    LayerNorm at (1, 0).
    """

    def __init__(self, vocab_size, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.0, tie_weights=True,
                 dtype=float32):
        super().__init__()
        self.vocab_size, self.block_size, self.n_embd = vocab_size, block_size, n_embd
        self.wte = nn.Embedding(vocab_size, n_embd, embedding_table=Normal(0.02), dtype=dtype)
        self.wpe = nn.Embedding(block_size, n_embd, embedding_table=Normal(0.02), dtype=dtype)
        self.add_positions = ops.Add()
        self.drop = nn.Dropout(p=dropout)
        self.blocks = nn.CellList([Block(n_embd, n_head, dropout, dtype) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm((n_embd,), dtype=dtype)
        self.tie_weights = bool(tie_weights)
        self.flatten = ops.Reshape()
        if self.tie_weights:
            self.head = ops.MatMul(transpose_b=True)  # x @ embedding_table.T
        else:
            self.lm_head = nn.Dense(n_embd, vocab_size, has_bias=False, weight_init=Normal(0.02), dtype=dtype)
        self.unflatten = ops.Reshape()

    def construct(self, tokens):
        if tokens.ndim != 2:
            raise ValueError(f"GPT: tokens must be (batch, time), got shape {tuple(tokens.shape)}")
        n, t = tokens.shape
        if t > self.block_size:
            raise ValueError(f"GPT: a sequence of {t} tokens is longer than block_size={self.block_size}")
        xp = backend.get_array_module(tokens.data)
        positions = Tensor(xp.arange(t, dtype=numpy.int32))
        x = self.drop(self.add_positions(self.wte(tokens), self.wpe(positions)))
        causal = Tensor(xp.triu(xp.ones((t, t), dtype=bool), 1))  # True: may not attend (the future)
        for block in self.blocks:
            x = block(x, causal)
        x = self.flatten(self.ln_f(x), (n * t, self.n_embd))
        if self.tie_weights:
            table = self.wte.embedding_table
            # mixed precision: the head computes in x's type (O2 casts x, not the table); x has no dtype
            # here when it is a pipeline's stand-in for the last stage's output (minidl_parallel.pipeline)
            if table.dtype != getattr(x, "dtype", table.dtype):
                table = ops.cast(table, x.dtype)
            logits = self.head(x, table)
        else:
            logits = self.lm_head(x)
        return self.unflatten(logits, (n, t, self.vocab_size))

    def shard(self, model_parallel, data_parallel=1):
        """Megatron's tensor parallelism over ``data_parallel * model_parallel`` ranks. Returns self.

        - attention heads cut in ``model_parallel`` (q/k/v column-parallel, the output projection
          row-parallel) and the MLP column- then row-parallel: one all-reduce per sublayer forward;
        - the token embedding cut along the vocabulary (each rank looks up the ids in its rows: a
          partial sum, one all-reduce), and the tied head column-parallel over the vocabulary, so
          the logits stay cut by vocabulary into the loss (the cross-entropy rule reduces the max
          and the sum over ranks instead of gathering the logits);
        - LayerNorms, the position embedding and the residual stream replicated (the residual
          additions are sharded "whole" so that propagation never trades an all-reduce for a
          reduce-scatter and an all-gather).
        Run it under AUTO_PARALLEL so that the other operators follow these layouts.
        """
        mp, dp = model_parallel, data_parallel
        whole = ((dp, 1, 1), (dp, 1, 1))  # the residual stream stays whole on every rank
        self.wte.shard(((mp, 1), (dp, 1)))
        self.add_positions.shard(((dp, 1, 1), (1, 1)))  # the lookup's partial sums: one all-reduce
        for block in self.blocks:
            block.attn.shard(mp, dp)
            block.mlp.shard(mp, dp)
            block.residual_attn.shard(whole)
            block.residual_mlp.shard(whole)
        if self.tie_weights:
            self.head.shard(((dp, 1), (mp, 1)))
        else:
            self.lm_head.shard(((dp, 1), (mp, 1)))
        return self

    def generate(self, tokens, max_new_tokens, temperature=1.0, top_k=None):
        """Samples ``max_new_tokens`` tokens after ``tokens`` (N, T), each from the softmax of the last
        logits / temperature (only the ``top_k`` most likely when given), with the framework's
        generator (``minidl.set_seed`` repeats it). Returns a NumPy int array (N, T + max_new_tokens).
        """
        if temperature <= 0:
            raise ValueError(f"GPT.generate: temperature must be > 0, got {temperature}")
        out = numpy.array(backend.to_numpy(tokens.data if isinstance(tokens, Tensor) else tokens), dtype=numpy.int64)
        was_training = self.training
        self.set_train(False)
        try:
            with no_grad():
                for _ in range(max_new_tokens):
                    context = out[:, -self.block_size:]
                    logits = backend.to_numpy(self(Tensor(context.astype(numpy.int32))).data)[:, -1, :]
                    logits = logits.astype(numpy.float64) / temperature
                    if top_k is not None:
                        kth = numpy.sort(logits, axis=-1)[:, -min(top_k, logits.shape[-1])][:, None]
                        logits = numpy.where(logits < kth, -numpy.inf, logits)
                    p = numpy.exp(logits - logits.max(axis=-1, keepdims=True))
                    p /= p.sum(axis=-1, keepdims=True)
                    rng = backend.rng()
                    nxt = [rng.choice(p.shape[-1], p=row) for row in p]
                    out = numpy.concatenate([out, numpy.array(nxt, dtype=numpy.int64)[:, None]], axis=1)
        finally:
            self.set_train(was_training)
        return out


__all__ = ["GPT", "Block", "MLP"]
