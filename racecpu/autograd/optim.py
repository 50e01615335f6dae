"""Optimiser, learning-rate schedule and gradient clipping."""

from __future__ import annotations

import numpy as np

__all__ = ["AdamW", "warmup_linear_decay", "clip_grad_norm"]


class AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter).

    Parameters
    ----------
    params : list of Parameter
    lr : float
        Learning rate; may be changed between steps (``opt.lr = ...``).
    betas : (float, float), default (0.9, 0.999)
    eps : float, default 1e-8
    weight_decay : float, default 0.01
        Applied as ``p -= lr * weight_decay * p`` to parameters with ``ndim >= 2``
        only (matrices and embeddings; not biases, norms or beta).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        self.params = list(params)
        if not self.params:
            raise ValueError("AdamW got an empty parameter list")
        if lr < 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid AdamW settings lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.t = 0
        self.m = [np.zeros_like(p.data) for p in self.params]
        self.v = [np.zeros_like(p.data) for p in self.params]

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        """One update from the ``.grad`` of every parameter (parameters without a grad are skipped)."""
        self.t += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            g = p.grad
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            update = (m / c1) / (np.sqrt(v / c2) + self.eps)
            if self.weight_decay and p.ndim >= 2:
                update = update + self.weight_decay * p.data
            p.data = (p.data - self.lr * update).astype(p.dtype, copy=False)


def warmup_linear_decay(step, total_steps, base_lr, warmup_frac=0.01):
    """The paper's schedule: linear warm-up from 0 over ``warmup_frac * total_steps``
    updates, then linear decay to 0 at ``total_steps``.  ``step`` counts from 0."""
    warm = max(1, int(round(warmup_frac * total_steps)))
    if step < warm:
        return base_lr * (step + 1) / warm
    return base_lr * max(0.0, (total_steps - step) / max(1, total_steps - warm))


def clip_grad_norm(params, max_norm):
    """Scale all gradients so their global L2 norm is at most ``max_norm``; returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = float(np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads)))
    if max_norm is not None and norm > max_norm:
        scale = max_norm / (norm + 1e-12)
        for p in params:
            if p.grad is not None:
                p.grad = p.grad * np.asarray(scale, p.grad.dtype)
    return norm
