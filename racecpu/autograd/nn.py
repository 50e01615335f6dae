"""Neural-network modules: layers and small Transformers with pluggable attention.

A :class:`Module` finds its parameters by walking its attributes (Parameters,
sub-Modules, lists of Modules), in attribute order, so ``state_dict`` keys are
stable dotted names such as ``blocks.0.attn.q.weight``.  Constant arrays a
module needs to reproduce its output (RACE hyperplanes) are listed in
``_buffers`` and saved with the parameters.
"""

from __future__ import annotations

import numpy as np

from ..hashing import LAYER_BETA, LAYER_NUM_PLANES, LAYER_NUM_TABLES, hyperplanes
from . import functional as F
from .tensor import Tensor

__all__ = ["Parameter", "Module", "Linear", "LayerNorm", "Embedding", "MultiHeadAttention",
           "TransformerBlock", "TransformerLM", "TransformerClassifier", "ATTENTIONS", "ESTIMATORS"]

ATTENTIONS = ("race", "softmax", "angular", "linear")
#: RACE's estimators: the paper's ratio over tables, or the per-bucket mean of the authors' released code.
ESTIMATORS = ("ratio", "bucket_mean")


class Parameter(Tensor):
    """A Tensor that a Module trains (``requires_grad=True``)."""

    def __init__(self, data):
        super().__init__(data, requires_grad=True)


def _rng(seed):
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


class Module:
    """Base class: ``parameters()``, ``state_dict()``, ``load_state_dict()``, ``save``/``load`` (npz)."""

    training = True
    _buffers = ()

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def _children(self):
        for name, val in vars(self).items():
            if isinstance(val, Module):
                yield name, val
            elif isinstance(val, (list, tuple)):
                for i, m in enumerate(val):
                    if isinstance(m, Module):
                        yield f"{name}.{i}", m

    def named_parameters(self, prefix=""):
        for name, val in vars(self).items():
            if isinstance(val, Parameter):
                yield prefix + name, val
        for name, child in self._children():
            yield from child.named_parameters(f"{prefix}{name}.")

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def _named_buffers(self, prefix=""):
        for name in self._buffers:
            yield prefix + name, self, name
        for name, child in self._children():
            yield from child._named_buffers(f"{prefix}{name}.")

    def num_parameters(self):
        return int(sum(p.size for p in self.parameters()))

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None

    def train(self, mode=True):
        self.training = bool(mode)
        for _, child in self._children():
            child.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def state_dict(self):
        """Copies of all parameters and buffers, by dotted name."""
        state = {name: p.data.copy() for name, p in self.named_parameters()}
        state.update({name: np.array(getattr(owner, attr)) for name, owner, attr in self._named_buffers()})
        return state

    def load_state_dict(self, state):
        """Load arrays from ``state`` (dict name -> array); names and shapes must match exactly."""
        params = dict(self.named_parameters())
        buffers = {name: (owner, attr) for name, owner, attr in self._named_buffers()}
        expected, given = set(params) | set(buffers), set(state)
        if expected != given:
            raise ValueError(f"state_dict mismatch: missing {sorted(expected - given)}, "
                             f"unexpected {sorted(given - expected)}")
        for name, arr in state.items():
            arr = np.asarray(arr)
            cur = params[name].data if name in params else getattr(*buffers[name])
            if arr.shape != cur.shape:
                raise ValueError(f"state_dict[{name!r}] has shape {arr.shape}, expected {cur.shape}")
        for name, arr in state.items():
            if name in params:
                params[name].data = np.array(arr, dtype=params[name].dtype)
                params[name].grad = None
            else:
                owner, attr = buffers[name]
                setattr(owner, attr, np.array(arr, dtype=getattr(owner, attr).dtype))
        return self

    def save(self, path):
        """Write the state dict to an ``.npz`` file."""
        np.savez(path, **self.state_dict())

    def load(self, path):
        """Read a state dict written by :meth:`save`."""
        with np.load(path) as f:
            return self.load_state_dict({k: f[k] for k in f.files})


class Linear(Module):
    """``y = x @ weight + bias``; weight ``(in, out)`` ~ N(0, 1/in)."""

    def __init__(self, in_features, out_features, bias=True, *, seed=0, dtype=np.float32):
        rng = _rng(seed)
        self.weight = Parameter((rng.standard_normal((in_features, out_features)) / np.sqrt(in_features)).astype(dtype))
        self.bias = Parameter(np.zeros(out_features, dtype)) if bias else None

    def forward(self, x):
        y = x @ self.weight
        return y + self.bias if self.bias is not None else y


class LayerNorm(Module):
    def __init__(self, d, eps=1e-5, *, dtype=np.float32):
        self.weight = Parameter(np.ones(d, dtype))
        self.bias = Parameter(np.zeros(d, dtype))
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, self.weight, self.bias, self.eps)


class Embedding(Module):
    """Lookup table ``(num_embeddings, d)`` ~ N(0, std^2)."""

    def __init__(self, num_embeddings, d, *, std=0.02, seed=0, dtype=np.float32):
        self.weight = Parameter((_rng(seed).standard_normal((num_embeddings, d)) * std).astype(dtype))

    def forward(self, indices):
        return F.embedding(self.weight, indices)


def _conv_init(K, C, rng, dtype):
    """Short-convolution weights: U(-1/sqrt(K), 1/sqrt(K)) (PyTorch's depthwise Conv1d default)."""
    return rng.uniform(-1, 1, (K, C)).astype(dtype) / np.sqrt(K).astype(dtype)


class MultiHeadAttention(Module):
    """Multi-head self-attention with a choice of attention kernel.

    Parameters
    ----------
    d_model, n_heads : int
        ``d_model`` must be divisible by ``n_heads``.
    attention : {"race", "softmax", "angular", "linear"}
        ``race``: :func:`racecpu.race_attention` (one set of hyperplanes shared
        by the heads of a layer, beta trainable per layer as ``exp(log_beta)``;
        q and k are scaled by ``head_dim ** -0.5`` first, as in softmax
        attention, so that the hyperplane projections start near N(0, 1) and
        the tanh of the soft hash is not saturated);
        ``angular``: the exact kernel RACE estimates, gamma = ``num_planes``;
        ``linear``: elu+1 linear attention.
    causal : bool
    num_planes, num_tables : int, default 5, 4
        RACE's P and L (``LAYER_NUM_PLANES``, ``LAYER_NUM_TABLES`` of
        :mod:`racecpu.hashing`; docs/choosing.md says why).
    beta : float, default 2
        RACE's initial temperature (``LAYER_BETA``).
    estimator : {"ratio", "bucket_mean"}, default "ratio"
        RACE only.  ``ratio``: the paper's estimator (Algorithms 1 and 2),
        :func:`racecpu.race_attention`, linear in N; ``bucket_mean``: the
        estimator of the authors' released code,
        :func:`racecpu.autograd.functional.race_attention_bucket_mean` (a mean
        per bucket, summed over buckets and tables, no 1/L), linear in N by
        per-bucket (prefix) sums in NumPy.  Same hash, same q/k scaling.
    train_beta : bool, default True
    learn_planes : bool, default False
        RACE (``estimator="ratio"``) only: the hyperplanes are a
        :class:`Parameter` trained with the rest (their gradient from
        ``racecpu.race_attention_bwd(..., dplanes=True)``) instead of a
        constant buffer; the state dict keeps the name ``planes``.
    beta_per_head : bool, default False
        RACE only: one trained temperature per head instead of one per layer.
    conv_size : int, default 0
        If > 0, a causal depthwise convolution of this width (a "short
        convolution", as in H3, GLA, DeltaNet, Mamba) on each of q, k, v
        after their projections, for every attention type alike, so each
        query, key and value mixes the last ``conv_size`` tokens.  Causal only.
    conv_act : bool, default True
        SiLU after the short convolution.
    n_kv_heads : int, optional
        Grouped-query attention (multi-query for 1): keys and values get
        ``n_kv_heads`` heads, each read by ``n_heads // n_kv_heads`` query
        heads (default ``n_heads``: ordinary multi-head attention).  RACE
        (``estimator="ratio"``) computes each key/value head's sketch once
        for its group; the other attentions repeat k and v.
    seed : int or Generator
    """

    _buffers = ("planes",)

    def __init__(self, d_model, n_heads, *, attention="race", causal=True, num_planes=LAYER_NUM_PLANES,
                 num_tables=LAYER_NUM_TABLES, beta=LAYER_BETA, estimator="ratio", train_beta=True, beta_per_head=False,
                 conv_size=0, conv_act=True, learn_planes=False, n_kv_heads=None, seed=0, dtype=np.float32):
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if not (isinstance(n_kv_heads, (int, np.integer)) and 1 <= n_kv_heads <= n_heads
                and n_heads % n_kv_heads == 0):
            raise ValueError(f"n_kv_heads must divide n_heads ({n_heads}), got {n_kv_heads!r}")
        rng = _rng(seed)
        self.attention, self.causal, self.n_heads = attention, bool(causal), n_heads
        self.n_kv_heads = int(n_kv_heads)
        self.estimator = estimator
        self.head_dim = d_model // n_heads
        d_kv = self.n_kv_heads * self.head_dim
        self.q = Linear(d_model, d_model, seed=rng, dtype=dtype)
        self.k = Linear(d_model, d_kv, seed=rng, dtype=dtype)
        self.v = Linear(d_model, d_kv, seed=rng, dtype=dtype)
        self.proj = Linear(d_model, d_model, seed=rng, dtype=dtype)
        self.num_planes = num_planes
        self.planes = hyperplanes(self.head_dim, num_planes, num_tables, seed=rng, dtype=dtype)
        if learn_planes:
            if attention != "race" or estimator != "ratio":
                raise ValueError("learn_planes=True needs attention='race' with estimator='ratio', got "
                                 f"attention={attention!r}, estimator={estimator!r}")
            self.planes = Parameter(self.planes)
            self._buffers = ()  # a parameter now, saved under the same name
        if attention == "race" and train_beta:
            shape = (n_heads,) if beta_per_head else ()
            self.log_beta = Parameter(np.full(shape, np.log(beta), dtype))
        else:
            self.beta = float(beta)
        self.conv_size, self.conv_act = int(conv_size), bool(conv_act)
        if self.conv_size and not causal:
            raise ValueError("conv_size > 0 needs causal=True")
        if self.conv_size:
            self.conv_q, self.conv_k, self.conv_v = (Parameter(_conv_init(self.conv_size, width, rng, dtype))
                                                     for width in (d_model, d_kv, d_kv))

    def current_beta(self):
        if not hasattr(self, "log_beta"):
            return self.beta
        b = np.exp(self.log_beta.data.astype(np.float64))
        return float(b) if b.ndim == 0 else [float(v) for v in b]

    def _conv(self, t, w):
        t = F.causal_conv1d(t, w)
        return t.silu() if self.conv_act else t

    def project(self, x):
        """The queries, keys and values this layer's attention reads, for ``x (B, N, d_model)``.

        Returns Tensors ``q (B, H, N, head_dim)``, ``k``, ``v (B, n_kv_heads, N,
        head_dim)``: the projections, after the short convolution if any; for
        RACE, q and k scaled by ``head_dim ** -0.5`` as the hash sees them.
        """
        B, N, _ = x.shape
        dh = self.head_dim

        def heads(t, n):
            return t.reshape(B, N, n, dh).transpose(0, 2, 1, 3)
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.conv_size:
            q, k, v = self._conv(q, self.conv_q), self._conv(k, self.conv_k), self._conv(v, self.conv_v)
        q, k, v = heads(q, self.n_heads), heads(k, self.n_kv_heads), heads(v, self.n_kv_heads)
        if self.attention == "race":
            s = dh ** -0.5  # keeps W q ~ N(0, 1): tanh unsaturated, so q and k get gradients
            q, k = q * s, k * s
        return q, k, v

    def forward(self, x, key_mask=None, cu_seqlens=None):
        """``x``: (B, N, d_model); ``key_mask``: optional bool (B, N), False = padding;
        ``cu_seqlens``: packed sequences on the N axis (:func:`racecpu.race_attention`'s),
        each attending only within itself (RACE, either estimator, no convolution)."""
        B, N, D = x.shape
        if cu_seqlens is not None and not (self.attention == "race" and not self.conv_size):
            raise NotImplementedError("cu_seqlens (packed sequences) needs attention='race' and conv_size=0 (the "
                                      "convolution would mix sequences)")
        H, Hk = self.n_heads, self.n_kv_heads
        q, k, v = self.project(x)
        shared = self.attention == "race" and self.estimator == "ratio"  # grouped k, v read as they are
        if Hk != H and not shared:  # the others see each key/value head repeated for its query heads
            group = np.repeat(np.arange(Hk), H // Hk)
            k, v, Hk = k[:, group], v[:, group], H
        mask = None if key_mask is None else np.broadcast_to(np.asarray(key_mask)[:, None, :], (B, Hk, N))
        if self.attention == "race":
            beta = self.log_beta.exp() if hasattr(self, "log_beta") else self.beta
            race = F.race_attention if self.estimator == "ratio" else F.race_attention_bucket_mean
            packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
            o = race(q, k, v, self.planes, beta, causal=self.causal, key_mask=mask, **packed)
        elif self.attention == "softmax":
            o = F.softmax_attention(q, k, v, causal=self.causal, key_mask=mask)
        elif self.attention == "angular":
            o = F.angular_attention(q, k, v, self.num_planes, causal=self.causal, key_mask=mask)
        else:
            o = F.linear_attention(q, k, v, causal=self.causal, key_mask=mask)
        return self.proj(o.transpose(0, 2, 1, 3).reshape(B, N, D))


class TransformerBlock(Module):
    """Pre-LayerNorm block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))`` (GELU, 4x width)."""

    def __init__(self, d_model, n_heads, *, dropout=0.0, seed=0, dtype=np.float32, **attn_kwargs):
        rng = _rng(seed)
        self.ln1 = LayerNorm(d_model, dtype=dtype)
        self.attn = MultiHeadAttention(d_model, n_heads, seed=rng, dtype=dtype, **attn_kwargs)
        self.ln2 = LayerNorm(d_model, dtype=dtype)
        self.fc1 = Linear(d_model, 4 * d_model, seed=rng, dtype=dtype)
        self.fc2 = Linear(4 * d_model, d_model, seed=rng, dtype=dtype)
        self.dropout = dropout
        self._drop_rng = np.random.default_rng(rng.integers(2 ** 63))

    def forward(self, x, key_mask=None, cu_seqlens=None):
        drop = lambda t: F.dropout(t, self.dropout, self._drop_rng, self.training)  # noqa: E731
        x = x + drop(self.attn(self.ln1(x), key_mask, cu_seqlens))
        return x + drop(self.fc2(self.fc1(self.ln2(x)).gelu()))


class _Backbone(Module):
    def _build(self, vocab_size, d_model, n_heads, n_layers, max_len, causal, dropout, seed, dtype, attn_kwargs,
               token_shift=False):
        """Create embeddings, blocks, final norm; returns the rng for the head."""
        rng = _rng(seed)
        self.max_len, self.vocab_size = max_len, vocab_size
        self.tok = Embedding(vocab_size, d_model, seed=rng, dtype=dtype)
        self.pos = Embedding(max_len, d_model, seed=rng, dtype=dtype)
        # token shift: an embedding of the previous token (row vocab_size = "none"), a width-2 causal conv
        self.prev = Embedding(vocab_size + 1, d_model, seed=rng, dtype=dtype) if token_shift else None
        self.blocks = [TransformerBlock(d_model, n_heads, causal=causal, dropout=dropout, seed=rng, dtype=dtype,
                                        **attn_kwargs) for _ in range(n_layers)]
        self.ln_f = LayerNorm(d_model, dtype=dtype)
        return rng

    def features(self, tokens, key_mask=None):
        tokens = np.asarray(tokens)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape (B, N), got {tokens.shape}")
        if tokens.shape[1] > self.max_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_len={self.max_len}")
        x = self.tok(tokens) + self.pos(np.arange(tokens.shape[1]))
        if self.prev is not None:
            shifted = np.concatenate([np.full((len(tokens), 1), self.vocab_size), tokens[:, :-1]], axis=1)
            x = x + self.prev(shifted)
        for block in self.blocks:
            x = block(x, key_mask)
        return self.ln_f(x)


class TransformerLM(_Backbone):
    """Causal Transformer language model: int tokens (B, N) -> logits (B, N, vocab_size).

    Learned token and position embeddings (``max_len`` positions), ``n_layers``
    pre-LN blocks, final LayerNorm and a linear head.  ``attention``,
    ``num_planes``, ``num_tables``, ``beta``, ``train_beta`` go to every
    :class:`MultiHeadAttention`, and so do ``estimator``, ``beta_per_head``,
    ``conv_size``, ``conv_act`` and ``learn_planes`` (see there).  ``token_shift=True`` adds an embedding of the
    previous token to each position (a width-2 causal convolution on the
    tokens, like the short convolutions of H3/Based or RWKV's token shift), so a
    position knows its predecessor without spending an attention layer on it.
    """

    def __init__(self, vocab_size, d_model, n_heads, n_layers, *, attention="race", num_planes=LAYER_NUM_PLANES,
                 num_tables=LAYER_NUM_TABLES, beta=LAYER_BETA, estimator="ratio", train_beta=True, beta_per_head=False,
                 conv_size=0, conv_act=True, max_len=1024, dropout=0.0, token_shift=False, learn_planes=False,
                 seed=0, dtype=np.float32):
        rng = self._build(vocab_size, d_model, n_heads, n_layers, max_len, True, dropout, seed, dtype,
                          dict(attention=attention, num_planes=num_planes, num_tables=num_tables,
                               beta=beta, estimator=estimator, train_beta=train_beta, beta_per_head=beta_per_head,
                               conv_size=conv_size, conv_act=conv_act, learn_planes=learn_planes), token_shift)
        self.head = Linear(d_model, vocab_size, seed=rng, dtype=dtype)

    def forward(self, tokens):
        return self.head(self.features(tokens))


class TransformerClassifier(_Backbone):
    """Bidirectional Transformer encoder + mean pooling: tokens (B, N) -> logits (B, num_classes).

    ``key_mask`` (bool (B, N), False = padding) hides padding from attention
    and from the pooling.  ``estimator`` and ``learn_planes`` as in :class:`MultiHeadAttention`.
    """

    def __init__(self, vocab_size, num_classes, d_model, n_heads, n_layers, *, attention="race",
                 num_planes=LAYER_NUM_PLANES, num_tables=LAYER_NUM_TABLES, beta=LAYER_BETA, estimator="ratio",
                 train_beta=True, max_len=1024, dropout=0.0, learn_planes=False, seed=0, dtype=np.float32):
        rng = self._build(vocab_size, d_model, n_heads, n_layers, max_len, False, dropout, seed, dtype,
                          dict(attention=attention, num_planes=num_planes, num_tables=num_tables,
                               beta=beta, estimator=estimator, train_beta=train_beta, learn_planes=learn_planes))
        self.head = Linear(d_model, num_classes, seed=rng, dtype=dtype)

    def forward(self, tokens, key_mask=None):
        h = self.features(tokens, key_mask)
        B, N, _ = h.shape
        m = np.ones((B, N), bool) if key_mask is None else np.asarray(key_mask, bool)
        w = (m / np.maximum(m.sum(1, keepdims=True), 1)).astype(h.dtype)[:, :, None]
        return self.head((h * w).sum(1))
