"""A character-level GPT on a few Shakespeare sonnets (public domain, examples/data/sonnets.txt).

    python examples/gpt_char.py                  # about 2 minutes on a 2-core laptop CPU, then a sample
    python examples/gpt_char.py --steps 50       # a quick look

A small decoder-only Transformer (minidl.models.gpt: token + position embeddings, pre-LayerNorm
blocks of causal self-attention and a GELU MLP, the head tied to the embedding) learns to predict
the next character. AdamWeightDecay, a custom loop with value_and_grad; the training and held-out
losses are printed as they fall from ln(vocabulary) (about 4.1), and text is sampled at the end.
"""
import argparse
import os
import time

import numpy as np

import minidl
from minidl import nn, Tensor
from minidl.models.gpt import GPT

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sonnets.txt")


class CharData:
    """The text as integer ids, split 90/10 into training and held-out parts."""

    def __init__(self, text):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        ids = np.array([self.index[c] for c in text], dtype=np.int32)
        cut = int(0.9 * len(ids))
        self.train, self.val = ids[:cut], ids[cut:]

    def batch(self, part, size, block, rng):
        """``size`` random windows of ``block`` characters and, shifted by one, their next characters."""
        ids = self.train if part == "train" else self.val
        starts = rng.integers(0, len(ids) - block - 1, size)
        x = np.stack([ids[s:s + block] for s in starts])
        y = np.stack([ids[s + 1:s + block + 1] for s in starts])
        return Tensor(x), Tensor(y)

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--block", type=int, default=32, help="context length (characters)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--sample", type=int, default=300, help="characters to sample at the end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text", default=TEXT)
    args = parser.parse_args()

    minidl.set_seed(args.seed)
    with open(args.text, encoding="utf-8") as f:
        data = CharData(f.read())
    rng = np.random.default_rng(args.seed)
    net = GPT(len(data.chars), block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    loss_fn = nn.CrossEntropyLoss()
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=args.lr, weight_decay=0.01)
    vocab = len(data.chars)

    def forward(x, y):
        logits = net(x)
        return loss_fn(logits.reshape(-1, vocab), y.reshape(-1))

    grad_fn = minidl.value_and_grad(forward, None, opt.parameters)
    print(f"{len(data.train) + len(data.val)} characters, vocabulary {vocab}; "
          f"{sum(p.size for p in net.trainable_params())} parameters; ln(vocabulary) = {np.log(vocab):.2f}")
    net.set_train(True)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss, grads = grad_fn(*data.batch("train", args.batch, args.block, rng))
        opt(grads)
        if step % args.eval_every == 0 or step == 1 or step == args.steps:
            net.set_train(False)
            with minidl.no_grad():
                val = np.mean([float(forward(*data.batch("val", args.batch, args.block, rng)).asnumpy())
                               for _ in range(4)])
            net.set_train(True)
            print(f"step {step:4d}  train loss {float(loss.asnumpy()):.3f}  held-out loss {val:.3f}  "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    if args.sample:
        prompt = data.train[:args.block // 2][None]
        out = net.generate(Tensor(prompt), args.sample, temperature=0.8, top_k=10)
        print("--- sample ---")
        print(data.decode(out[0]))


if __name__ == "__main__":
    main()
