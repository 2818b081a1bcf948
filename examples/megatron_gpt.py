"""A GPT sharded the Megatron way, on minidl.

    mpirun --oversubscribe -n 2 python examples/megatron_gpt.py     # 2-way tensor parallel
    mpirun --oversubscribe -n 4 python examples/megatron_gpt.py     # 4-way
    python examples/megatron_gpt.py                                 # one process: the reference

``GPT.shard(t)`` (minidl/models/gpt.py) cuts every attention's heads over the t ranks (q, k, v
column-parallel, the output projection row-parallel), every MLP column- then row-parallel, the
token embedding along the vocabulary (each rank looks up the ids in its rows) and the tied head
along the vocabulary, so the logits reach the cross-entropy cut by vocabulary; LayerNorms and the
position embedding are replicated. Under AUTO_PARALLEL every other operator follows those
layouts. Every rank feeds the same batch (dataset_strategy="full_batch") and prints the same
losses, equal to the one-process run's (up to float32 rounding). Rank 0 ends with the
collectives of one training step, counted by minidl_parallel.CommCounter, beside their
analytical numbers:

    forward:  1 (the vocabulary-parallel embedding's partial sums)
              + 2 per block (after the attention's and the MLP's row-parallel projections)
              + 3 in the cross-entropy over vocabulary-cut logits (the max, the sum of
                exponentials, the picked label's logit)
    backward: 4 per block (the input gradients of the column-parallel q, k, v and MLP fc,
              each a partial sum over the ranks) + 1 (the tied head's input gradient)
              + 1 (the log-softmax normaliser's gradient, summed over the vocabulary cut)

(Megatron fuses q, k and v into one column-parallel matrix, so its blocks need 2 in backward:
minidl keeps MindSpore's three projections; see docs/transformers.md.)
"""
import argparse

import numpy as np

import minidl
from minidl import nn, Tensor
from minidl.models.gpt import GPT
import minidl_parallel as mp


def batch(rng, size, block, vocab):
    """Random token windows of a fixed pattern (each next token = previous + 1, mod vocab) with noise."""
    start = rng.integers(0, vocab, (size, 1))
    ids = (start + np.arange(block + 1)) % vocab
    noise = rng.random(ids.shape) < 0.1
    ids = np.where(noise, rng.integers(0, vocab, ids.shape), ids).astype(np.int32)
    return Tensor(ids[:, :-1]), Tensor(ids[:, 1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--embd", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    t = 1
    if mp.launched_under_mpi():
        mp.init()
        t = mp.get_group_size()
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.AUTO_PARALLEL, dataset_strategy="full_batch")
    rank = mp.get_rank()
    minidl.set_seed(0)  # the same initial weights on every rank and in the one-process run
    net = GPT(args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    if t > 1:
        net.shard(t)
    # The sparse softmax cross-entropy has a rule for logits cut by class (nn.CrossEntropyLoss
    # builds arrays from local data and refuses blocks).
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Adam(net.trainable_params(), learning_rate=args.lr)

    def forward(x, y):
        return loss_fn(net(x).reshape(-1, args.vocab), y.reshape(-1))

    grad_fn = minidl.value_and_grad(forward, None, opt.parameters)
    rng = np.random.default_rng(1)
    for step in range(args.steps):
        x, y = batch(rng, args.batch, args.block, args.vocab)
        with mp.CommCounter() as comm:
            loss, grads = grad_fn(x, y)
            opt(grads)
        print(f"rank {rank}: step {step + 1}, loss is {float(loss.asnumpy()):.6f}", flush=True)
    if rank == 0 and t > 1:
        forward, backward = 1 + 2 * args.layers + 3, 4 * args.layers + 2
        print(f"collectives per step ({args.layers} blocks, {t}-way tensor parallel): "
              f"{comm.count(phase='forward')} in forward (analytical {forward}), "
              f"{comm.count(phase='backward')} in backward (analytical {backward})")
        print(comm.summary())

if __name__ == "__main__":
    main()
