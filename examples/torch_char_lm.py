"""A small character-level Transformer LM in PyTorch whose attention is racecpu's RACE op (or SDPA).

It trains on the CPU on the stdlib-docstring characters
(:func:`racecpu.apps.tasks.char_corpus`: the docstrings and comments of the
Python standard library's own sources; nothing is downloaded)::

    PYTHONPATH=. python3 examples/torch_char_lm.py --attention race --seq-len 1024 --seconds 120
    PYTHONPATH=. python3 examples/torch_char_lm.py --attention sdpa --seq-len 1024 --seconds 120
    PYTHONPATH=. python3 examples/torch_char_lm.py --steps 200 --seq-len 256    # a short run

The model: token and learned position embeddings, ``n_layers`` pre-LayerNorm
blocks (causal multi-head attention, then a GELU MLP), a final LayerNorm and
a linear head; AdamW with gradient clipping.  The attention is the one
switch:

* ``race``: :class:`racecpu.torch.RaceAttention` (P = 3 hyperplanes per table,
  L = 3 tables, planes fixed, the temperature ``beta`` trained, one per layer);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)``.

``benchmarks/framework_train.py`` imports :func:`build_model`,
:func:`make_step`, :func:`train` and :func:`evaluate` from here to time a
training step and to train for a fixed wall-clock budget;
``examples/jax_char_lm.py`` is the same model in JAX.
"""

import argparse
import math
import time

import numba
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import racecpu
from racecpu.apps.tasks import CHARS, char_batch, char_corpus, char_eval_windows
from racecpu.torch import RaceAttention

ATTENTIONS = ("race", "sdpa")
VOCAB = len(CHARS)


class Block(nn.Module):
    """Pre-LN block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, d_model, n_heads, attention, num_planes=3, num_tables=3, seed=0):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)
        # RaceAttention holds the planes (a buffer) and beta (a parameter); SDPA needs nothing
        self.race = (RaceAttention(d_model // n_heads, num_planes, num_tables, seed=seed)
                     if attention == "race" else None)

    def attend(self, q, k, v):
        if self.race is not None:
            return self.race(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x):
        B, N, D = x.shape
        H = self.n_heads
        # (B, N, 3D) -> three (B, H, N, D/H) views (RACE takes them without a copy)
        q, k, v = self.qkv(self.ln1(x)).view(B, N, 3, H, D // H).permute(2, 0, 3, 1, 4)
        y = self.attend(q, k, v).transpose(1, 2).reshape(B, N, D)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharLM(nn.Module):
    """tokens (B, N) int64 -> logits (B, N, vocab)."""

    def __init__(self, attention, vocab=VOCAB, d_model=128, n_heads=4, n_layers=2, seq_len=1024,
                 num_planes=3, num_tables=3, seed=0):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        self.attention, self.seq_len = attention, seq_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, attention, num_planes, num_tables, seed=seed * 1000 + i)
                                    for i in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        # GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layers)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens):
        N = tokens.shape[1]
        if N > self.seq_len:
            raise ValueError(f"sequence of {N} tokens, the model has {self.seq_len} positions")
        x = self.tok(tokens) + self.pos.weight[:N]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def build_model(attention, vocab=VOCAB, d_model=128, n_heads=4, n_layers=2, seq_len=1024, seed=0,
                num_planes=3, num_tables=3):
    """A :class:`CharLM` with weights drawn from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return CharLM(attention, vocab, d_model, n_heads, n_layers, seq_len, num_planes, num_tables, seed)


def loss_fn(model, x, y):
    """Mean next-character cross-entropy (nats)."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def make_step(model, lr=3e-3, weight_decay=0.01, clip=1.0):
    """A training step ``step(x, y, lr=None) -> loss`` (forward, backward, clip, AdamW) on int64 arrays.

    Weight decay goes to the matrices only (not to LayerNorm, biases or beta).
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=lr)
    params = list(model.parameters())
    model.train()

    def step(x, y, lr=None):
        if lr is not None:
            for g in opt.param_groups:
                g["lr"] = lr
        loss = loss_fn(model, torch.as_tensor(x), torch.as_tensor(y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        return loss.item()

    step.optimizer = opt
    return step


def lr_at(step, progress, lr, warmup=20, final=0.1):
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``final * lr`` as ``progress`` goes 0 -> 1."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (final + (1 - final) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def train(model, train_ids, *, seq_len, batch_size=8, steps=None, seconds=None, lr=3e-3, warmup=20, seed=0,
          log_every=10.0, log=print):
    """Train on random windows of ``train_ids`` for ``steps`` steps or ``seconds`` of wall clock.

    The learning rate follows :func:`lr_at`, its progress being the larger of
    the step and the time fractions.  The first step (Numba's and the
    allocator's warm-up) is not counted in ``seconds``.  ``log`` gets a line
    every ``log_every`` seconds (``None``: no lines).  Returns a dict:
    ``losses`` (per step), ``steps``, ``seconds`` (training time, first step
    included) and ``step_ms`` (median per step).
    """
    if steps is None and seconds is None:
        raise ValueError("give steps or seconds")
    rng = np.random.default_rng([seed, 1])
    step = make_step(model, lr)
    losses, times = [], []
    t_start = t_budget = time.perf_counter()
    t_log = t_start
    i = 0
    while True:
        now = time.perf_counter()
        progress = max(i / steps if steps else 0.0, (now - t_budget) / seconds if seconds else 0.0)
        if (steps is not None and i >= steps) or (seconds is not None and i > 0 and now - t_budget >= seconds):
            break
        x, y = char_batch(rng, train_ids, batch_size, seq_len)
        t0 = time.perf_counter()
        losses.append(step(x, y, lr_at(i, progress, lr, warmup)))
        t1 = time.perf_counter()
        times.append(t1 - t0)
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"training diverged at step {i} (loss {losses[-1]})")
        if i == 0:
            t_budget = t1  # the budget starts after the first step
        i += 1
        if log is not None and t1 - t_log >= log_every:
            t_log = t1
            log(f"  step {i:5d}  loss {np.mean(losses[-10:]):.4f}  {1e3 * np.median(times[-10:]):.1f} ms/step")
    return {"losses": losses, "steps": i, "seconds": time.perf_counter() - t_start,
            "step_ms": 1e3 * float(np.median(times))}


@torch.no_grad()
def evaluate(model, windows, batch_size=8):
    """Validation loss in bits per character over ``windows`` (inputs, targets), e.g. from ``char_eval_windows``."""
    x, y = windows
    model.eval()
    nll, count = 0.0, 0
    for s in range(0, len(x), batch_size):
        logits = model(torch.as_tensor(x[s:s + batch_size])).double()
        t = torch.as_tensor(y[s:s + batch_size])
        nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1), reduction="sum"))
        count += t.numel()
    model.train()
    return nll / count / math.log(2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attention", choices=ATTENTIONS, default="race")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=None, help="training steps (default 200 unless --seconds)")
    p.add_argument("--seconds", type=float, default=None, help="wall-clock budget instead of --steps")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads and racecpu.set_threads (default: theirs, all cores)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.steps is None and a.seconds is None:
        a.steps = 200
    if a.threads:
        # racecpu's Numba kernels share torch's OpenMP runtime when torch is imported first, and their
        # parallel calls set its thread count to Numba's: give both the same count
        torch.set_num_threads(a.threads)
        racecpu.set_threads(min(a.threads, numba.config.NUMBA_NUM_THREADS))
    train_ids, val_ids = char_corpus()
    model = build_model(a.attention, VOCAB, a.d_model, a.n_heads, a.n_layers, a.seq_len, a.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{a.attention}: {n_params} parameters, {len(train_ids)} training characters, "
          f"torch threads {torch.get_num_threads()}")
    res = train(model, train_ids, seq_len=a.seq_len, batch_size=a.batch_size, steps=a.steps, seconds=a.seconds,
                lr=a.lr, seed=a.seed, log_every=5.0)
    bpc = evaluate(model, char_eval_windows(val_ids, a.eval_windows, a.seq_len))
    betas = [f"{b.race.beta.item():.2f}" for b in model.blocks if b.race is not None]
    print(f"{a.attention}: {res['steps']} steps in {res['seconds']:.1f} s ({res['step_ms']:.1f} ms/step), "
          f"train loss {np.mean(res['losses'][-10:]):.4f} nats, validation {bpc:.4f} bits/char"
          + (f", beta {' '.join(betas)}" if betas else ""))
    return bpc


if __name__ == "__main__":
    main()
