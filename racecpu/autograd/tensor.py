"""The ``Tensor`` of :mod:`racecpu.autograd` and its elementwise / shape ops.

A ``Tensor`` wraps a NumPy array.  Every op computes its output eagerly and,
when an input needs a gradient, records its parents and a *vector-Jacobian
product* ``vjp(g) -> (grad for each parent)`` (the JAX ``custom_vjp`` idea).
``backward()`` walks the graph in reverse topological order and feeds each
node's cotangent to its ``vjp``.  Broadcasting is undone in one place
(:func:`_unbroadcast`): a ``vjp`` may return a gradient of the broadcast
shape and the engine sums it down to the parent's shape.
"""

from __future__ import annotations

import contextlib
import numbers

import numpy as np

__all__ = ["Tensor", "no_grad", "is_grad_enabled", "as_tensor", "op"]

_GRAD_ENABLED = True


@contextlib.contextmanager
def no_grad():
    """Context manager: ops inside record no graph (for evaluation)."""
    global _GRAD_ENABLED
    prev, _GRAD_ENABLED = _GRAD_ENABLED, False
    try:
        yield
    finally:
        _GRAD_ENABLED = prev


def is_grad_enabled():
    return _GRAD_ENABLED


def _unbroadcast(g, shape):
    """Sum ``g`` down to ``shape`` (the inverse of NumPy broadcasting)."""
    if g.shape == shape:
        return g
    extra = g.ndim - len(shape)
    if extra:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


def as_tensor(x, like=None):
    """``x`` as a Tensor; Python scalars and int arrays take ``like``'s float dtype."""
    if isinstance(x, Tensor):
        return x
    if isinstance(x, numbers.Number) and like is not None:
        return Tensor(np.asarray(x, dtype=like.dtype))
    arr = np.asarray(x)
    if arr.dtype.kind != "f":
        arr = arr.astype(like.dtype if like is not None else np.float64)
    return Tensor(arr)


def op(data, parents, vjp):
    """The output Tensor of an op: ``data``, and (where a parent needs a gradient) its
    ``parents`` and ``vjp(g) -> one cotangent per parent`` recorded for :meth:`Tensor.backward`."""
    out = Tensor(data)
    if _GRAD_ENABLED and any(p.requires_grad for p in parents):
        out.requires_grad = True
        out._parents = tuple(parents)
        out._vjp = vjp
    return out


def _power(a, p):
    """``a ** p``; small integer powers by multiplication (NumPy's float32 pow is ~50x slower)."""
    if p == int(p) and 0 <= p <= 4:
        out = np.ones_like(a)
        for _ in range(int(p)):
            out = out * a
        return out
    return a ** p


def _is_basic_index(idx):
    items = idx if isinstance(idx, tuple) else (idx,)
    return all(isinstance(i, (numbers.Integral, slice)) or i is None or i is Ellipsis for i in items)


class Tensor:
    """An n-dimensional float array that can record the ops applied to it.

    Parameters
    ----------
    data : array_like
        Float data (int/bool data is converted to float64).  Not copied if it is
        already a float ndarray.
    requires_grad : bool, default False
        Whether ``backward`` should accumulate a gradient into ``.grad``.

    Attributes
    ----------
    data : ndarray
    grad : ndarray or None
        Accumulated gradient (leaf tensors only), same shape and dtype as ``data``.
    """

    __array_priority__ = 1000  # ndarray op Tensor -> Tensor.__rop__

    def __init__(self, data, requires_grad=False):
        arr = np.asarray(data)
        if arr.dtype.kind != "f":
            arr = arr.astype(np.float64)
        self.data = arr
        self.requires_grad = bool(requires_grad)
        self.grad = None
        self._parents = ()
        self._vjp = None

    # -- basics -------------------------------------------------------------
    shape = property(lambda self: self.data.shape)
    ndim = property(lambda self: self.data.ndim)
    dtype = property(lambda self: self.data.dtype)
    size = property(lambda self: self.data.size)

    def __repr__(self):
        rg = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({np.array2string(self.data, precision=4, threshold=8)}{rg})"

    def __len__(self):
        return len(self.data)

    def numpy(self):
        return self.data

    def item(self):
        return self.data.item()

    def detach(self):
        """A new leaf Tensor sharing ``data``, cut from the graph."""
        return Tensor(self.data)

    def astype(self, dtype):
        src = self.dtype
        return op(self.data.astype(dtype), (self,), lambda g: (g.astype(src),))

    # -- backward -------------------------------------------------------------
    def backward(self, grad=None):
        """Accumulate d(self)/d(leaf) into ``.grad`` of every leaf that requires it.

        Parameters
        ----------
        grad : array_like, optional
            Cotangent of ``self``; may be omitted only for a single-element tensor.
        """
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad "
                               "(no input had requires_grad=True, or it was made under no_grad())")
        if grad is None:
            if self.size != 1:
                raise ValueError(f"grad must be given for a non-scalar tensor of shape {self.shape}")
            grad = np.ones_like(self.data)
        grad = np.asarray(grad, dtype=self.dtype)
        if grad.shape != self.shape:
            raise ValueError(f"grad has shape {grad.shape}, expected {self.shape}")
        # reverse topological order (iterative DFS: graphs can be deep)
        order, seen, stack = [], set(), [(self, False)]
        while stack:
            node, done = stack.pop()
            if done:
                order.append(node)
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.append((node, True))
            stack.extend((p, False) for p in node._parents if p.requires_grad and id(p) not in seen)
        grads = {id(self): grad}
        for node in reversed(order):
            g = grads.pop(id(node), None)
            if g is None:
                continue
            if node._vjp is None:  # leaf
                node.grad = g.copy() if node.grad is None else node.grad + g
                continue
            for p, gp in zip(node._parents, node._vjp(g)):
                if gp is None or not p.requires_grad:
                    continue
                gp = _unbroadcast(np.asarray(gp), p.shape).astype(p.dtype, copy=False)
                key = id(p)
                grads[key] = gp if key not in grads else grads[key] + gp

    # -- arithmetic -----------------------------------------------------------
    def __add__(self, other):
        other = as_tensor(other, self)
        return op(self.data + other.data, (self, other), lambda g: (g, g))

    def __sub__(self, other):
        other = as_tensor(other, self)
        return op(self.data - other.data, (self, other), lambda g: (g, -g))

    def __mul__(self, other):
        other = as_tensor(other, self)
        a, b = self.data, other.data
        return op(a * b, (self, other), lambda g: (g * b, g * a))

    def __truediv__(self, other):
        other = as_tensor(other, self)
        a, b = self.data, other.data
        return op(a / b, (self, other), lambda g: (g / b, -g * a / (b * b)))

    def __radd__(self, other):
        return as_tensor(other, self) + self

    def __rsub__(self, other):
        return as_tensor(other, self) - self

    def __rmul__(self, other):
        return as_tensor(other, self) * self

    def __rtruediv__(self, other):
        return as_tensor(other, self) / self

    def __neg__(self):
        return op(-self.data, (self,), lambda g: (-g,))

    def __pow__(self, exponent):
        """Power with a constant real exponent."""
        if isinstance(exponent, Tensor) or not isinstance(exponent, numbers.Real):
            raise TypeError(f"exponent must be a real number, got {type(exponent).__name__}")
        a, p = self.data, exponent
        return op(_power(a, p), (self,), lambda g: (g * p * _power(a, p - 1),))

    def __matmul__(self, other):
        """Matrix product of the last two dims (both operands need ndim >= 2)."""
        other = as_tensor(other, self)
        a, b = self.data, other.data
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(f"matmul needs operands with ndim >= 2, got shapes {a.shape} and {b.shape}")

        def vjp(g):
            ga = g @ np.swapaxes(b, -1, -2)
            if b.ndim == 2:  # (..., m, k) @ (k, n): one 2-D product instead of a batched one summed
                return ga, a.reshape(-1, a.shape[-1]).T @ g.reshape(-1, g.shape[-1])
            return ga, np.swapaxes(a, -1, -2) @ g
        return op(a @ b, (self, other), vjp)

    def __rmatmul__(self, other):
        return as_tensor(other, self) @ self

    # -- reductions -----------------------------------------------------------
    def sum(self, axis=None, keepdims=False):
        shape = self.shape
        out = self.data.sum(axis=axis, keepdims=keepdims)

        def vjp(g):
            if axis is not None and not keepdims:
                g = np.expand_dims(g, axis)
            return (np.broadcast_to(g, shape),)
        return op(out, (self,), vjp)

    def mean(self, axis=None, keepdims=False):
        axes = range(self.ndim) if axis is None else np.atleast_1d(axis)
        n = int(np.prod([self.shape[a] for a in axes]))
        return self.sum(axis, keepdims) * (1.0 / max(n, 1))

    # -- shape ----------------------------------------------------------------
    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        src = self.shape
        return op(self.data.reshape(shape), (self,), lambda g: (g.reshape(src),))

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        axes = tuple(axes) if axes else tuple(range(self.ndim))[::-1]
        inv = tuple(np.argsort(axes))
        return op(self.data.transpose(axes), (self,), lambda g: (g.transpose(inv),))

    @property
    def T(self):
        return self.transpose()

    def swapaxes(self, a, b):
        axes = list(range(self.ndim))
        axes[a], axes[b] = axes[b], axes[a]
        return self.transpose(axes)

    def __getitem__(self, idx):
        if isinstance(idx, Tensor):
            idx = idx.data.astype(np.intp)
        shape, dtype, basic = self.shape, self.dtype, _is_basic_index(idx)

        def vjp(g):
            z = np.zeros(shape, dtype)
            if basic:
                z[idx] = g
            else:
                np.add.at(z, idx, g)  # repeated indices accumulate
            return (z,)
        return op(self.data[idx], (self,), vjp)

    # -- elementwise ----------------------------------------------------------
    def exp(self):
        y = np.exp(self.data)
        return op(y, (self,), lambda g: (g * y,))

    def log(self):
        x = self.data
        return op(np.log(x), (self,), lambda g: (g / x,))

    def tanh(self):
        y = np.tanh(self.data)
        return op(y, (self,), lambda g: (g * (1 - y * y),))

    def sigmoid(self):
        x = self.data
        y = np.exp(-np.logaddexp(0, -x)).astype(x.dtype, copy=False)  # stable for any x
        return op(y, (self,), lambda g: (g * y * (1 - y),))

    def silu(self):
        """SiLU (swish): ``x * sigmoid(x)``, with ``sigmoid(x) = (1 + tanh(x / 2)) / 2`` (stable, fast)."""
        x = self.data
        sg = 0.5 * (1 + np.tanh(0.5 * x))
        return op(x * sg, (self,), lambda g: (g * (sg * (1 + x * (1 - sg))),))

    def relu(self):
        x = self.data
        return op(np.maximum(x, 0), (self,), lambda g: (g * (x > 0),))

    def elu(self):
        """``x`` for x > 0, ``exp(x) - 1`` otherwise."""
        x = self.data
        e = np.exp(np.minimum(x, 0))
        return op(np.where(x > 0, x, e - 1), (self,), lambda g: (g * np.where(x > 0, 1, e),))

    def gelu(self):
        """GELU, tanh approximation: ``0.5 x (1 + tanh(c (x + 0.044715 x^3)))``."""
        x = self.data
        c = float(np.sqrt(2 / np.pi))
        u = c * (x + 0.044715 * (x * x * x))
        t = np.tanh(u)
        y = 0.5 * x * (1 + t)

        def vjp(g):
            x2 = x * x
            return (g * (0.5 * (1 + t) + (0.5 * c) * x * (1 - t * t) * (1 + 3 * 0.044715 * x2)),)
        return op(y.astype(x.dtype, copy=False), (self,), vjp)
