"""racecpu.autograd: a tiny reverse-mode autograd over NumPy, with RACE attention.

Enough to train small Transformers in pure NumPy and to embed RACE attention
in pipelines without PyTorch::

    import numpy as np, racecpu
    from racecpu.autograd import Tensor, functional as F
    q = Tensor(np.random.default_rng(0).standard_normal((2, 64, 16)), requires_grad=True)
    beta = Tensor(np.array(8.0), requires_grad=True)   # trainable temperature
    out = F.race_attention(q, q, q, racecpu.hyperplanes(16, dtype=np.float64), beta, causal=True)
    out.sum().backward()          # q.grad and beta.grad via racecpu.race_attention_bwd

Modules: :mod:`.tensor` (Tensor and its elementwise/shape ops),
:mod:`.functional` (losses, normalisations, attention ops, ``check_grad``),
:mod:`.nn` (modules and Transformers), :mod:`.optim` (AdamW, schedule,
clipping).  The training tasks and the ``racecpu train`` command that use
them are applications: :mod:`racecpu.apps.tasks`, :mod:`racecpu.apps.train`.
"""

from . import functional, nn, optim
from .functional import check_grad
from .tensor import Tensor, as_tensor, is_grad_enabled, no_grad

__all__ = ["Tensor", "as_tensor", "no_grad", "is_grad_enabled", "check_grad", "functional", "nn", "optim"]
