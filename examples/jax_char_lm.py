"""A small character-level Transformer LM in JAX whose attention is racecpu's RACE op (or plain softmax).

The same model as ``examples/torch_char_lm.py``, written as plain functions
over a params pytree (no Flax, no Optax: a hand-written AdamW), with a jitted
training step.  It trains on the CPU on the stdlib-docstring characters
(:func:`racecpu.apps.tasks.char_corpus`; nothing is downloaded)::

    PYTHONPATH=. python3 examples/jax_char_lm.py --attention race --seq-len 1024 --seconds 120
    PYTHONPATH=. python3 examples/jax_char_lm.py --attention softmax --seq-len 1024 --seconds 120
    PYTHONPATH=. python3 examples/jax_char_lm.py --steps 200 --seq-len 256    # a short run

The model: token and learned position embeddings, ``n_layers`` pre-LayerNorm
blocks (causal multi-head attention, then a GELU MLP), a final LayerNorm and
a linear head; AdamW with gradient clipping.  The attention is the one
switch:

* ``race``: :func:`racecpu.jax.race_attention` (P = 3 hyperplanes per table,
  L = 3 tables, planes fixed constants, the temperature ``beta`` trained,
  one per layer);
* ``softmax``: ``softmax(q k^T / sqrt(d) + causal mask) v``, written out in
  ``jax.numpy`` (it materialises the (H, N, N) scores: memory grows as N^2).

``benchmarks/framework_train.py`` imports :func:`build_model`,
:func:`make_step`, :func:`train` and :func:`evaluate` from here.
"""

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import racecpu
import racecpu.jax as rj
from racecpu.apps.tasks import CHARS, char_batch, char_corpus, char_eval_windows

ATTENTIONS = ("race", "softmax")
VOCAB = len(CHARS)


# ---------------------------------------------------------------------------
# the model: a config, a params pytree and pure functions
# ---------------------------------------------------------------------------

class Model:
    """What :func:`build_model` returns: the static settings, the (constant) planes and the params pytree."""

    def __init__(self, attention, vocab, d_model, n_heads, n_layers, seq_len, planes, params):
        self.attention, self.vocab, self.d_model = attention, vocab, d_model
        self.n_heads, self.n_layers, self.seq_len = n_heads, n_layers, seq_len
        self.planes = planes      # one (L, P, d) array per layer, or None for softmax
        self.params = params      # dict of arrays; updated in place by make_step's step

    def num_parameters(self):
        return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(self.params))


def build_model(attention, vocab=VOCAB, d_model=128, n_heads=4, n_layers=2, seq_len=1024, seed=0,
                num_planes=3, num_tables=3):
    """A :class:`Model` with GPT-2's initialisation (N(0, 0.02); residual projections / sqrt(2 n_layers))."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if d_model % n_heads:
        raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
    rng = np.random.default_rng(seed)

    def normal(*shape, std=0.02):
        return jnp.asarray(rng.normal(0.0, std, shape), jnp.float32)

    zeros, ones = (lambda n: jnp.zeros(n, jnp.float32)), (lambda n: jnp.ones(n, jnp.float32))
    D, res_std = d_model, 0.02 / math.sqrt(2 * n_layers)
    blocks = []
    for _ in range(n_layers):
        blk = {"ln1_g": ones(D), "ln1_b": zeros(D), "qkv": normal(D, 3 * D), "proj": normal(D, D, std=res_std),
               "ln2_g": ones(D), "ln2_b": zeros(D), "fc1": normal(D, 4 * D), "fc1_b": zeros(4 * D),
               "fc2": normal(4 * D, D, std=res_std), "fc2_b": zeros(D)}
        if attention == "race":
            blk["beta"] = jnp.asarray(racecpu.config.DEFAULT_BETA, jnp.float32)
        blocks.append(blk)
    params = {"tok": normal(vocab, D), "pos": normal(seq_len, D), "blocks": blocks,
              "lnf_g": ones(D), "lnf_b": zeros(D), "head": normal(D, vocab)}
    planes = ([racecpu.hyperplanes(D // n_heads, num_planes, num_tables, seed=seed * 1000 + i)
               for i in range(n_layers)] if attention == "race" else None)
    return Model(attention, vocab, d_model, n_heads, n_layers, seq_len, planes, params)


def layer_norm(x, g, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * g + b


def softmax_attention(q, k, v):
    """Causal softmax attention on (B, H, N, d), written out: the (B, H, N, N) scores are materialised."""
    n, d = q.shape[-2], q.shape[-1]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d)
    causal = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]
    s = jnp.where(causal, s, -1e30)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def forward(model, params, tokens):
    """tokens (B, N) int -> logits (B, N, vocab).  ``model`` gives the static settings and planes."""
    B, N = tokens.shape
    D, H = model.d_model, model.n_heads
    x = params["tok"][tokens] + params["pos"][:N]
    for i, blk in enumerate(params["blocks"]):
        qkv = layer_norm(x, blk["ln1_g"], blk["ln1_b"]) @ blk["qkv"]                 # (B, N, 3D)
        q, k, v = qkv.reshape(B, N, 3, H, D // H).transpose(2, 0, 3, 1, 4)            # 3 x (B, H, N, D/H)
        if model.attention == "race":
            y = rj.race_attention(q, k, v, model.planes[i], blk["beta"], causal=True)
        else:
            y = softmax_attention(q, k, v)
        x = x + y.transpose(0, 2, 1, 3).reshape(B, N, D) @ blk["proj"]
        h = jax.nn.gelu(layer_norm(x, blk["ln2_g"], blk["ln2_b"]) @ blk["fc1"] + blk["fc1_b"], approximate=False)
        x = x + h @ blk["fc2"] + blk["fc2_b"]
    return layer_norm(x, params["lnf_g"], params["lnf_b"]) @ params["head"]


def loss_fn(model, params, x, y):
    """Mean next-character cross-entropy (nats)."""
    logp = jax.nn.log_softmax(forward(model, params, x))
    return -jnp.take_along_axis(logp, y[..., None], axis=-1).mean()


# ---------------------------------------------------------------------------
# training: hand-written AdamW, a jitted step
# ---------------------------------------------------------------------------

def make_step(model, lr=3e-3, weight_decay=0.01, clip=1.0, b1=0.9, b2=0.999, eps=1e-8):
    """A training step ``step(x, y, lr=None) -> loss`` (forward, backward, clip, AdamW), jitted.

    It updates ``model.params`` and keeps the optimizer state in its closure.
    Weight decay goes to the matrices only (not to LayerNorm, biases or beta),
    as in the torch example (``torch.optim.AdamW``'s update, same defaults).
    """
    state = {"m": jax.tree.map(jnp.zeros_like, model.params), "v": jax.tree.map(jnp.zeros_like, model.params),
             "t": jnp.zeros((), jnp.int32)}

    @jax.jit
    def update(params, state, x, y, lr):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, x, y))(params)
        norm = jnp.sqrt(sum(jnp.sum(g.astype(jnp.float32) ** 2) for g in jax.tree.leaves(grads)))
        scale = jnp.minimum(1.0, clip / (norm + 1e-6))
        t = state["t"] + 1
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g * scale, state["m"], grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * (g * scale) ** 2, state["v"], grads)
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t

        def apply(p, m, v):
            p = p * (1 - lr * weight_decay) if p.ndim >= 2 else p
            return p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps)
        return jax.tree.map(apply, params, m, v), {"m": m, "v": v, "t": t}, loss

    def step(x, y, lr_now=None):
        nonlocal state
        model.params, state, loss = update(model.params, state, jnp.asarray(x), jnp.asarray(y),
                                           jnp.float32(lr if lr_now is None else lr_now))
        return float(loss)  # waits for the step

    return step


def lr_at(step, progress, lr, warmup=20, final=0.1):
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``final * lr`` as ``progress`` goes 0 -> 1."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (final + (1 - final) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def train(model, train_ids, *, seq_len, batch_size=8, steps=None, seconds=None, lr=3e-3, warmup=20, seed=0,
          log_every=10.0, log=print):
    """Train on random windows of ``train_ids`` for ``steps`` steps or ``seconds`` of wall clock.

    As the torch example's ``train``: the first step (here: the jit compile)
    is not counted in ``seconds``; returns ``losses``, ``steps``, ``seconds``
    (first step included), ``step_ms`` (median).
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
            t_budget = t1  # the budget starts after the first step (the compile)
        i += 1
        if log is not None and t1 - t_log >= log_every:
            t_log = t1
            log(f"  step {i:5d}  loss {np.mean(losses[-10:]):.4f}  {1e3 * np.median(times[-10:]):.1f} ms/step")
    return {"losses": losses, "steps": i, "seconds": time.perf_counter() - t_start,
            "step_ms": 1e3 * float(np.median(times))}


def evaluate(model, windows, batch_size=8):
    """Validation loss in bits per character over ``windows`` (inputs, targets), e.g. from ``char_eval_windows``."""
    x, y = windows

    @jax.jit
    def nll_sum(params, x, y):
        logp = jax.nn.log_softmax(forward(model, params, x).astype(jnp.float32))
        return -jnp.take_along_axis(logp, y[..., None], axis=-1).sum()

    nll = 0.0
    for s in range(0, len(x), batch_size):
        nll += float(nll_sum(model.params, jnp.asarray(x[s:s + batch_size]), jnp.asarray(y[s:s + batch_size])))
    return nll / y.size / math.log(2)


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
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.steps is None and a.seconds is None:
        a.steps = 200
    train_ids, val_ids = char_corpus()
    model = build_model(a.attention, VOCAB, a.d_model, a.n_heads, a.n_layers, a.seq_len, a.seed)
    print(f"{a.attention}: {model.num_parameters()} parameters, {len(train_ids)} training characters, "
          f"jax {jax.__version__} on {jax.default_backend()}")
    res = train(model, train_ids, seq_len=a.seq_len, batch_size=a.batch_size, steps=a.steps, seconds=a.seconds,
                lr=a.lr, seed=a.seed, log_every=5.0)
    bpc = evaluate(model, char_eval_windows(val_ids, a.eval_windows, a.seq_len))
    betas = [f"{float(b['beta']):.2f}" for b in model.params["blocks"] if "beta" in b]
    print(f"{a.attention}: {res['steps']} steps in {res['seconds']:.1f} s ({res['step_ms']:.1f} ms/step), "
          f"train loss {np.mean(res['losses'][-10:]):.4f} nats, validation {bpc:.4f} bits/char"
          + (f", beta {' '.join(betas)}" if betas else ""))
    return bpc


if __name__ == "__main__":
    main()
