"""``racecpu train``'s model and tasks in PyTorch, trained through racecpu.torch: the runs of a sweep.

    PYTHONPATH=. python benchmarks/torch_train.py --task mqar --attention race --num-planes 4 --num-tables 4 \\
        --tokens 256 --num-pairs 32 --vocab-size 256 --steps 1000 --json

The same model as :class:`racecpu.autograd.nn.TransformerLM` (learned token and
position embeddings, the previous token's embedding added ("token shift"), pre-LN
blocks with a GELU MLP, a final LayerNorm and a linear head; linear layers
initialised N(0, 1/in), embeddings N(0, 0.02^2)), the same tasks, batches and
evaluation set for a seed (:mod:`racecpu.apps.tasks`), the same schedule (AdamW with
weight decay on matrices only, linear warm-up then linear decay, global-norm clip),
and the same JSON fields as ``racecpu train --json``, so
``benchmarks/train_sweep.py --trainer torch`` runs and tabulates it.  The engine
differs: PyTorch's autograd around :func:`racecpu.torch.race_attention` (RACE),
``F.scaled_dot_product_attention`` (softmax) and elu+1 linear attention computed in
chunks (exact).  The initial weights for a seed differ from the NumPy model's
(torch's generator): compare runs of one trainer.

RACE as in the NumPy model: q and k scaled by ``head_dim ** -0.5`` before the hash,
``beta = exp(log_beta)`` trained (one per layer, or per head with
``--beta-per-head``, each head then one call), the planes fixed (seeded per layer).
``--softmax-layers 0`` makes layer 0 softmax attention in a RACE model (a hybrid).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from racecpu._memory import peak_rss
from racecpu.apps.tasks import CHARS, IGNORE
from racecpu.apps.train import _Data as _TaskData, validation_metrics
from racecpu.autograd.optim import warmup_linear_decay
from racecpu.hashing import LAYER_BETA, LAYER_NUM_PLANES, LAYER_NUM_TABLES, hyperplanes
from racecpu.torch import race_attention

ATTENTIONS = ("race", "softmax", "linear")

#: Per-task defaults, those of ``racecpu train`` (racecpu.apps.train.TASK_DEFAULTS).
TASK_DEFAULTS = {
    "mqar": dict(steps=1200, batch_size=32, seq_len=64, d_model=64, n_heads=2, n_layers=2, lr=3e-3, warmup=0.05,
                 vocab_size=32, num_pairs=8, eval_every=100, eval_size=256, conv_size=0),
    "chars": dict(steps=1000, batch_size=16, seq_len=128, d_model=64, n_heads=2, n_layers=2, lr=3e-3,
                  warmup=0.05, vocab_size=len(CHARS), num_pairs=None, eval_every=100, eval_size=64, conv_size=4),
}


def _linear(i, o, bias=True):
    lin = nn.Linear(i, o, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0.0, i ** -0.5)
        if bias:
            lin.bias.zero_()
    return lin


def linear_attention(q, k, v, chunk=64):
    """Causal elu+1 linear attention, ``(B, H, N, d) -> (B, H, N, dv)``: exact within chunks of
    ``chunk`` tokens, the state ``sum_j f(k_j) v_j^T`` (and ``sum_j f(k_j)``) carried across them."""
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    B, H, n, d = q.shape
    pad = -n % chunk
    if pad:  # zero keys and values add nothing; the padded queries' rows are dropped
        fq, fk, v = (F.pad(t, (0, 0, 0, pad)) for t in (fq, fk, v))
    C = (n + pad) // chunk
    fq, fk, vc = (t.reshape(B, H, C, chunk, t.shape[-1]) for t in (fq, fk, v))
    kv = fk.transpose(-1, -2) @ vc                                   # (B, H, C, d, dv)
    S = torch.cumsum(kv, 2) - kv                                     # the state before each chunk
    z = torch.cumsum(fk.sum(-2), 2) - fk.sum(-2)                     # (B, H, C, d)
    a = (fq @ fk.transpose(-1, -2)).masked_fill(~torch.ones(chunk, chunk, dtype=torch.bool).tril(), 0.0)
    num = a @ vc + fq @ S
    den = a.sum(-1) + (fq * z[..., None, :]).sum(-1)
    out = num / den.clamp_min(1e-30)[..., None]
    return out.reshape(B, H, C * chunk, -1)[:, :, :n]


class Attention(nn.Module):
    """Causal multi-head self-attention of one kind; RACE's settings as the NumPy model's."""

    def __init__(self, cfg, kind, layer):
        super().__init__()
        d, H = cfg["d_model"], cfg["n_heads"]
        self.kind, self.H, self.dh = kind, H, d // H
        self.q, self.k, self.v, self.proj = (_linear(d, d) for _ in range(4))
        self.conv_size = cfg["conv_size"]
        if self.conv_size:  # depthwise causal convolution on q, k, v, then SiLU
            self.conv = nn.Parameter(torch.empty(3, d, self.conv_size).uniform_(-1, 1) / self.conv_size ** 0.5)
        if kind == "race":
            planes = hyperplanes(self.dh, cfg["num_planes"], cfg["num_tables"], seed=[cfg["seed"], layer],
                                 dtype=np.float32)
            self.register_buffer("planes", torch.from_numpy(planes))
            shape = (H,) if cfg["beta_per_head"] else ()
            self.log_beta = nn.Parameter(torch.full(shape, math.log(cfg["beta"])),
                                         requires_grad=cfg["train_beta"])
            self.estimator = cfg["estimator"]

    def _short_conv(self, t, i):
        x = F.pad(t.transpose(1, 2), (self.conv_size - 1, 0))
        return F.silu(F.conv1d(x, self.conv[i][:, None, :], groups=t.shape[-1]).transpose(1, 2))

    def forward(self, x):
        B, N, D = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.conv_size:
            q, k, v = (self._short_conv(t, i) for i, t in enumerate((q, k, v)))
        q, k, v = (t.view(B, N, self.H, self.dh).transpose(1, 2) for t in (q, k, v))
        if self.kind == "softmax":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.kind == "linear":
            o = linear_attention(q, k, v)
        else:
            s = self.dh ** -0.5  # W q ~ N(0, 1): tanh unsaturated (as the NumPy model)
            beta = self.log_beta.exp()
            if beta.dim() == 0:
                o = race_attention(q * s, k * s, v, self.planes, beta, causal=True, estimator=self.estimator)
            else:  # one temperature per head: one call per head
                o = torch.cat([race_attention(q[:, h:h + 1] * s, k[:, h:h + 1] * s, v[:, h:h + 1], self.planes,
                                              beta[h], causal=True, estimator=self.estimator)
                               for h in range(self.H)], dim=1)
        return self.proj(o.transpose(1, 2).reshape(B, N, D))

    def betas(self):
        return [float(b) for b in self.log_beta.detach().exp().reshape(-1)] if self.kind == "race" else []


class Block(nn.Module):
    def __init__(self, cfg, kind, layer):
        super().__init__()
        d = cfg["d_model"]
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(cfg, kind, layer)
        self.fc1, self.fc2 = _linear(d, 4 * d), _linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LM(nn.Module):
    """tokens (B, N) int64 -> logits (B, N, vocab)."""

    def __init__(self, cfg):
        super().__init__()
        V, d, n = cfg["vocab_size"], cfg["d_model"], cfg["seq_len"]
        self.tok, self.pos, self.prev = nn.Embedding(V, d), nn.Embedding(n, d), nn.Embedding(V + 1, d)
        for e in (self.tok, self.pos, self.prev):
            nn.init.normal_(e.weight, 0.0, 0.02)
        soft = set(cfg["softmax_layers"])
        self.blocks = nn.ModuleList(Block(cfg, "softmax" if i in soft else cfg["attention"], i)
                                    for i in range(cfg["n_layers"]))
        self.ln_f, self.head = nn.LayerNorm(d), _linear(d, V)
        self.vocab = V

    def forward(self, tokens):
        n = tokens.shape[1]
        shifted = F.pad(tokens[:, :-1], (1, 0), value=self.vocab)
        x = self.tok(tokens) + self.pos(torch.arange(n)) + self.prev(shifted)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def make_optimizer(model, cfg):
    """AdamW; weight decay on matrices and embeddings only (``ndim >= 2``), as racecpu.autograd's."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=cfg["weight_decay"]),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=cfg["lr"])


class Data(_TaskData):
    """racecpu train's batches and evaluation set for a seed (the same draws), batches as tensors."""

    def batch(self):
        x, y = super().batch()
        return torch.from_numpy(x), torch.from_numpy(y)


@torch.no_grad()
def evaluate(model, cfg, data, batch=64):
    """MQAR accuracy at the query positions, or bits per character; and the loss."""
    x, y = (torch.from_numpy(a) for a in data.eval)
    model.eval()
    nll, n_tok, correct = 0.0, 0, 0
    for s in range(0, len(x), batch):
        logits, t = model(x[s:s + batch]).double(), y[s:s + batch]
        valid = t != IGNORE
        nll += float(F.cross_entropy(logits.flatten(0, 1), t.flatten(), ignore_index=IGNORE, reduction="sum"))
        correct += int(((logits.argmax(-1) == t) & valid).sum())
        n_tok += int(valid.sum())
    model.train()
    return validation_metrics(cfg["task"], nll, n_tok, correct)


def train(cfg, progress=False):
    """Train one model from ``cfg``; returns ``racecpu train --json``'s dict (plus ``trainer: torch``)."""
    torch.manual_seed(cfg["seed"])
    data, model = Data(cfg), LM(cfg)
    opt = make_optimizer(model, cfg)
    steps, times, losses, evals = cfg["steps"], [], [], []
    t_start = time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = warmup_linear_decay(step, steps, cfg["lr"], cfg["warmup"])
        x, y = data.batch()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        opt.step()
        times.append(time.perf_counter() - t0)
        loss = loss.item()
        if not math.isfinite(loss):
            raise FloatingPointError(f"training diverged at step {step} (loss {loss})")
        losses.append(loss)
        if (step + 1) % cfg["eval_every"] == 0 or step + 1 == steps:
            evals.append(evaluate(model, cfg, data))
            if progress:
                shown = " ".join(f"{k} {v:.4f}" for k, v in evals[-1].items())
                print(f"step {step + 1}/{steps}: loss {np.mean(losses[-20:]):.4f}, {shown}", file=sys.stderr,
                      flush=True)
    total = time.perf_counter() - t_start
    betas = [b for blk in model.blocks for b in blk.attn.betas()] or None
    return {"task": cfg["task"], "attention": cfg["attention"], "steps": steps, **evals[-1],
            "train_loss": float(np.mean(losses[-max(1, steps // 20):])),
            "time_per_step_ms": 1e3 * float(np.median(times)), "train_seconds": total,
            "num_parameters": sum(p.numel() for p in model.parameters()), "beta": betas,
            "peak_rss_mib": None if peak_rss() is None else peak_rss() / 2 ** 20, "numba_threads": None, "torch_threads": torch.get_num_threads(),
            "trainer": "torch", "config": cfg,
            "history": {"loss": losses, "eval": evals}}


def config_from_args(a):
    cfg = dict(TASK_DEFAULTS[a.task])
    for key in cfg:
        if getattr(a, key, None) is not None:
            cfg[key] = getattr(a, key)
    if a.task == "chars":
        cfg["vocab_size"] = len(CHARS)
    cfg.update(task=a.task, attention=a.attention, weight_decay=a.weight_decay, clip=a.clip, seed=a.seed,
               num_planes=a.num_planes, num_tables=a.num_tables, beta=a.beta, train_beta=not a.fixed_beta,
               beta_per_head=a.beta_per_head, estimator=a.estimator, softmax_layers=a.softmax_layers,
               dtype="float32", token_shift=True)
    return cfg


def _layers(text):
    return [int(s) for s in text.split(",") if s.strip()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=sorted(TASK_DEFAULTS), default="mqar")
    p.add_argument("--attention", choices=ATTENTIONS, default="race")
    for flag, key, typ in (("steps", "steps", int), ("batch-size", "batch_size", int), ("tokens", "seq_len", int),
                           ("d-model", "d_model", int), ("heads", "n_heads", int), ("layers", "n_layers", int),
                           ("lr", "lr", float), ("warmup", "warmup", float), ("vocab-size", "vocab_size", int),
                           ("num-pairs", "num_pairs", int), ("eval-every", "eval_every", int),
                           ("eval-size", "eval_size", int), ("conv-size", "conv_size", int)):
        p.add_argument(f"--{flag}", dest=key, type=typ, default=None)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-planes", type=int, default=LAYER_NUM_PLANES)
    p.add_argument("--num-tables", type=int, default=LAYER_NUM_TABLES)
    p.add_argument("--beta", type=float, default=LAYER_BETA, help="initial temperature")
    p.add_argument("--fixed-beta", action="store_true")
    p.add_argument("--beta-per-head", action="store_true")
    p.add_argument("--estimator", choices=("ratio", "bucket_mean"), default="ratio")
    p.add_argument("--softmax-layers", type=_layers, default=[], help="comma-separated layers that use softmax")
    p.add_argument("--threads", type=int, default=None, help="torch and Numba threads (default: as set)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--out", default=None, help="accepted for train_sweep.py; nothing is written there")
    a = p.parse_args(argv)
    if a.threads:
        import racecpu
        torch.set_num_threads(a.threads)
        racecpu.set_threads(a.threads)
    res = train(config_from_args(a), progress=not a.quiet)
    if a.json:
        json.dump(res, sys.stdout, default=str)
        print()
    else:
        shown = {k: res[k] for k in ("val_loss", "val_accuracy", "val_bpc", "time_per_step_ms", "beta") if k in res}
        print(shown)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RACECPU_QUIET_COMPILE", "1")
    sys.exit(main())
