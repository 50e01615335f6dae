"""A tiny causal language model whose attention is racecpu's, trained with a jitted step in JAX.

One embedding, one multi-head RACE attention layer (trainable beta), one
output head; plain SGD on a periodic token sequence, so the loss visibly
falls in a few steps.  Run: ``python examples/jax_train_step.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np

import racecpu
import racecpu.jax as rj

VOCAB, D, HEADS, N, BATCH = 16, 32, 2, 64, 4
HD = D // HEADS
PLANES = racecpu.hyperplanes(HD, num_planes=3, num_tables=3, seed=0)


def init(key):
    ks = jax.random.split(key, 4)
    s = D ** -0.5
    return {"emb": jax.random.normal(ks[0], (VOCAB, D)) * s,
            "qkv": jax.random.normal(ks[1], (D, 3 * D)) * s,
            "proj": jax.random.normal(ks[2], (D, D)) * s,
            "head": jax.random.normal(ks[3], (D, VOCAB)) * s,
            "beta": jnp.array(8.0)}


def loss_fn(params, tokens):
    x = params["emb"][tokens[:, :-1]]                                  # (B, N, D)
    B, n, _ = x.shape
    q, k, v = jnp.split(x @ params["qkv"], 3, axis=-1)
    q, k, v = (t.reshape(B, n, HEADS, HD).transpose(0, 2, 1, 3) for t in (q, k, v))
    y = rj.race_attention(q, k, v, PLANES, params["beta"], causal=True)  # (B, H, N, HD)
    x = x + y.transpose(0, 2, 1, 3).reshape(B, n, D) @ params["proj"]
    logp = jax.nn.log_softmax(x @ params["head"])
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


@jax.jit
def train_step(params, tokens, lr=0.5):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss


def batch(rng):
    period = rng.integers(2, 6, size=(BATCH, 1))
    start = rng.integers(0, VOCAB, size=(BATCH, 1))
    return jnp.asarray((start + np.arange(N + 1) % period) % VOCAB)


def main(steps=30, verbose=True):
    params = init(jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    losses = []
    for step in range(steps):
        params, loss = train_step(params, batch(rng))
        losses.append(float(loss))
        if verbose:
            print(f"step {step:3d}  loss {loss:.4f}  beta {float(params['beta']):.3f}")
    return np.array(losses)


if __name__ == "__main__":
    main()
