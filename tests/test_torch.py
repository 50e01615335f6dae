"""racecpu.torch: the custom ops against the NumPy API, gradcheck, torch.compile, zero-copy."""

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import racecpu  # noqa: E402
import racecpu.engine as engine  # noqa: E402  (what the op calls on CPU tensors)
import racecpu.torch as rt  # noqa: E402

EAGER = rt._eager  # the real choice, restored after tests that force one path


def _inputs(shape=(2, 3, 24, 8), dv=6, dtype=torch.float64, seed=0, nk=None):
    g = torch.Generator().manual_seed(seed)
    *lead, n, d = shape
    nk = n if nk is None else nk
    q = torch.randn(*lead, n, d, generator=g, dtype=dtype)
    k = torch.randn(*lead, nk, d, generator=g, dtype=dtype)
    v = torch.randn(*lead, nk, dv, generator=g, dtype=dtype)
    planes = torch.from_numpy(racecpu.hyperplanes(d, 2, 3, seed=seed, dtype=np.float64))
    return q, k, v, planes


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64(causal):
    q, k, v, planes = _inputs((2, 10, 6), dv=5)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    beta = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, 3] = False

    def f(q, k, v, beta):
        return rt.race_attention(q, k, v, planes, beta, causal=causal, key_mask=mask)

    assert torch.autograd.gradcheck(f, (q, k, v, beta), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_equals_numpy_api(dtype, causal):
    q, k, v, planes = _inputs(dtype=dtype)
    mask = torch.rand(2, 3, 24, generator=torch.Generator().manual_seed(1)) > 0.2
    beta = torch.tensor(3.0, dtype=dtype, requires_grad=True)
    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
    out = rt.race_attention(qt, kt, vt, planes, beta, causal=causal, key_mask=mask)
    g = torch.randn(out.shape, dtype=dtype, generator=torch.Generator().manual_seed(2))
    out.backward(g)

    ref, res = racecpu.race_attention_fwd(q.numpy(), k.numpy(), v.numpy(), planes.numpy(), 3.0, causal=causal,
                                          key_mask=mask.numpy())
    dq, dk, dv, dbeta = racecpu.race_attention_bwd(res, g.numpy())
    assert out.dtype == dtype and qt.grad.dtype == dtype and beta.grad.dtype == dtype
    np.testing.assert_array_equal(out.detach().numpy(), ref)
    np.testing.assert_array_equal(qt.grad.numpy(), dq)
    np.testing.assert_array_equal(kt.grad.numpy(), dk)
    np.testing.assert_array_equal(vt.grad.numpy(), dv)
    assert beta.grad.shape == () and float(beta.grad) == pytest.approx(dbeta, rel=1e-6 if dtype == torch.float32
                                                                          else 0)


def test_non_causal_cross_lengths_and_strides():
    q, k, v, planes = _inputs((2, 7, 8), dv=4, nk=11)
    # a transposed (non-contiguous) q: viewed, not copied, and the same result
    qs = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not qs.is_contiguous()
    out = rt.race_attention(qs, k, v, planes, 2.0)
    np.testing.assert_array_equal(out.numpy(), racecpu.race_attention(q.numpy(), k.numpy(), v.numpy(),
                                                                      planes.numpy(), 2.0))
    assert out.shape == (2, 7, 4)


def test_zero_copy_both_ways(monkeypatch):
    seen = {}
    real = engine.forward

    def spy(q, k, v, planes, beta, **kw):
        out, res = real(q, k, v, planes, beta, **kw)
        seen.update(q=q, k=k, v=v, out=out)
        return out, res

    monkeypatch.setattr(engine, "forward", spy)
    for dtype in (torch.float32, torch.float64, torch.float16):
        q, k, v, planes = _inputs(dtype=dtype)
        k = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # strided: still a view
        v.requires_grad_()
        out = rt.race_attention(q, k, v, planes, 2.0)
        for name, t in (("q", q), ("k", k), ("v", v)):
            assert np.shares_memory(seen[name], t.detach().numpy()), (dtype, name)
        assert np.shares_memory(seen["out"], out.detach().numpy()), dtype
        assert out.dtype == dtype


def test_residuals_live_as_long_as_the_graph(monkeypatch):
    """The custom op's residuals (behind a handle: torch.compile's path) are kept only with grad,
    found by a retained graph's second backward and freed with the graph or when the output is
    dropped without a backward."""
    monkeypatch.setattr(rt, "_eager", lambda *tensors: False)
    gc.collect()
    before = len(rt._RESIDUALS)
    q, k, v, planes = _inputs()
    with torch.no_grad():
        rt.race_attention(q.requires_grad_(), k, v, planes)
    assert len(rt._RESIDUALS) == before  # no residuals kept without grad
    out = rt.race_attention(q, k, v, planes, causal=True)
    assert len(rt._RESIDUALS) == before + 1
    out.sum().backward(retain_graph=True)
    g1 = q.grad.clone()
    out.sum().backward()  # the retained graph still finds them
    torch.testing.assert_close(q.grad, 2 * g1)
    gc.collect()
    assert len(rt._RESIDUALS) == before  # freed with the graph
    out = rt.race_attention(q, k, v, planes)
    del out  # dropped without a backward
    gc.collect()
    assert len(rt._RESIDUALS) == before


def test_eager_path_equals_the_op_and_frees_its_residuals(monkeypatch):
    """Eager calls on plain tensors take the autograd function (_EagerRace), not the custom op:
    the same out and gradients to the bit (q, k, v, planes, beta), a retained graph's second
    backward, residuals on the autograd context freed with the graph, and no residuals at all
    without grad; fake and meta tensors, torch.func transforms and torch.compile take the op."""
    import weakref
    kept = []
    real = rt._forward_impl
    monkeypatch.setattr(rt, "_forward_impl", lambda *a: kept.append(r := real(*a)) or r)
    q, k, v, planes = _inputs()
    beta = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    planes.requires_grad_()
    grads = []
    for eager in (True, False):
        monkeypatch.setattr(rt, "_eager", (lambda *t: True) if eager else (lambda *t: False))
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v, planes)] + [beta.detach().clone().requires_grad_()]
        out = rt.race_attention(*xs[:4], xs[4], causal=True)
        out.pow(2).sum().backward()
        grads.append([out.detach()] + [x.grad for x in xs])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    monkeypatch.setattr(rt, "_eager", EAGER)
    kept.clear()
    q.requires_grad_()
    out = rt.race_attention(q, k, v, planes.detach(), causal=True)
    res = weakref.ref(kept.pop()[1])                      # the list would keep it alive
    out.sum().backward(retain_graph=True)
    g1 = q.grad.clone()
    out.sum().backward()
    torch.testing.assert_close(q.grad, 2 * g1)
    assert res() is not None
    del out
    gc.collect()
    assert res() is None                                   # freed with the graph
    with torch.no_grad():
        rt.race_attention(q, k, v, planes)
    assert kept[-1][1] is None                             # nothing kept without grad
    assert not rt._eager(torch.empty(2, device="meta"))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        assert not rt._eager(torch.empty(2))
    seen = []
    torch.func.grad(lambda x: seen.append(rt._eager(x)) or x.sum())(torch.ones(2))
    assert seen == [False] and rt._eager(torch.ones(2))


def test_16_bit_inputs():
    q, k, v, planes = _inputs(dtype=torch.float32)
    ref = rt.race_attention(q, k, v, planes)
    for dtype in (torch.float16, torch.bfloat16):
        q16, k16, v16 = (x.to(dtype).requires_grad_() for x in (q, k, v))
        out = rt.race_attention(q16, k16, v16, planes, torch.tensor(8.0, requires_grad=True))
        assert out.dtype == dtype
        exact = rt.race_attention(*(x.detach().float() for x in (q16, k16, v16)), planes)
        torch.testing.assert_close(out.float(), exact.to(dtype).float(), rtol=0, atol=0)  # computed in float32
        torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)
        out.float().square().sum().backward()
        assert q16.grad.dtype == dtype and torch.isfinite(q16.grad.float()).all()


@pytest.mark.parametrize("causal", [False, True])
def test_learnable_planes_gradcheck_and_numpy_equality(causal):
    """Planes that require grad get race_attention_bwd's dplanes: central differences
    in float64 (gradcheck), and the NumPy API's gradient bit for bit."""
    q, k, v, planes = _inputs((2, 12, 5), dv=4)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    W = planes.clone().requires_grad_()

    def f(q, k, v, W):
        return rt.race_attention(q, k, v, W, 1.3, causal=causal)

    assert torch.autograd.gradcheck(f, (q, k, v, W), eps=1e-6, atol=1e-7, rtol=1e-5)
    out = f(q, k, v, W)
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
    out.backward(g)
    _, res = racecpu.race_attention_fwd(*(x.detach().numpy() for x in (q, k, v)), planes.numpy(), 1.3,
                                        causal=causal)
    dW = racecpu.race_attention_bwd(res, g.numpy(), dplanes=True)[4]
    assert W.grad.dtype == W.dtype and W.grad.shape == W.shape
    np.testing.assert_array_equal(W.grad.numpy(), dW)
    with pytest.raises(ValueError, match="one element"):
        rt.race_attention(q, k, v, planes.detach(), torch.ones(2))


def test_race_attention_module_learns_planes():
    torch.manual_seed(0)
    att = rt.RaceAttention(8, num_planes=2, num_tables=3, beta=2.0, learn_planes=True, dtype=torch.float64)
    assert isinstance(att.planes, torch.nn.Parameter) and "planes" in dict(att.named_parameters())
    frozen = rt.RaceAttention(8, num_planes=2, num_tables=3, dtype=torch.float64)
    assert "planes" not in dict(frozen.named_parameters()) and "planes" in dict(frozen.named_buffers())
    q, k, v, _ = _inputs((2, 16, 8), dv=8)
    before = att.planes.detach().clone()
    opt = torch.optim.SGD(att.parameters(), lr=0.5)
    att(q, k, v, is_causal=True).square().sum().backward()
    assert att.planes.grad is not None and att.planes.grad.abs().sum() > 0
    opt.step()
    assert not torch.equal(att.planes.detach(), before)


class _Block(torch.nn.Module):
    """A standard multi-head causal self-attention block with a choice of attention."""

    def __init__(self, d_model=16, heads=2, race=True):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)
        self.attn = (rt.RaceAttention(d_model // heads, beta=4.0) if race
                     else torch.nn.functional.scaled_dot_product_attention)

    def forward(self, x):
        B, N, D = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = self.attn(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(B, N, D))


def test_module_is_a_drop_in_for_sdpa():
    torch.manual_seed(0)
    block, sdpa = _Block(), _Block(race=False)
    x = torch.randn(2, 20, 16)
    assert sdpa(x).shape == block(x).shape
    block(x).square().mean().backward()
    assert block.attn.beta.grad is not None and block.attn.planes.grad is None
    assert set(block.state_dict()) >= {"attn.planes", "attn.beta"}
    with pytest.raises(NotImplementedError):
        block.attn(x[None], x[None], x[None], attn_mask=torch.ones(20, 20, dtype=torch.bool))


def test_torch_compile_block():
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(2, 24, 16)
    ref = block(x)
    ref.sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    try:
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)  # fullgraph: the op breaks no graph
        out = compiled(x)
    except Exception as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"torch.compile unavailable: {exc}")
    out.sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for p, g in zip(block.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_fake_kernels_match():
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v, planes = _inputs(dtype=torch.float32)
    q = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    real = rt._race_attention_op(q, k, v, planes, torch.tensor(2.0), True, None, True)
    g = torch.ones_like(real[0])
    real_bwd = rt._race_attention_bwd_op(real[1], g, q, k, v, planes, True)
    real_bwd0 = rt._race_attention_bwd_op(real[1], g, q, k, v, planes, False)
    with FakeTensorMode() as mode:
        fq, fk, fv, fp, fg = (mode.from_tensor(x) for x in (q, k, v, planes, g))
        fake = rt._race_attention_op(fq, fk, fv, fp, torch.tensor(2.0), True, None, True)
        fake_bwd = rt._race_attention_bwd_op(fake[1], fg, fq, fk, fv, fp, True)
        fake_bwd0 = rt._race_attention_bwd_op(fake[1], fg, fq, fk, fv, fp, False)
    for r, f in zip(real + real_bwd + real_bwd0, fake + fake_bwd + fake_bwd0):
        assert (r.shape, r.stride(), r.dtype, r.device) == (f.shape, f.stride(), f.dtype, f.device)


def test_torch_thread_count_survives_the_op():
    """racecpu's OpenMP regions must not change torch's intra-op thread count."""
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        q, k, v, planes = _inputs((1, 2, 20000, 16), dv=16, dtype=torch.float32)
        q.requires_grad_()
        rt.race_attention(q, k, v, planes, causal=True).sum().backward()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(n)


def test_cuda_bfloat16_crossing_is_chosen_and_checked(monkeypatch):
    """racecpu.torch.CUDA_BFLOAT16: "float32" (the default) never sends bits; "bits" sends them to
    every racecpu.cuda call (both of its forms take them); anything else is a ValueError naming it.
    (The crossing itself needs CUDA tensors: the GPU's tests.)"""
    assert rt.CUDA_BFLOAT16 == "float32" and not rt._bits_crossing()
    monkeypatch.setattr(rt, "CUDA_BFLOAT16", "bits")
    assert rt._bits_crossing()
    monkeypatch.setattr(rt, "CUDA_BFLOAT16", "bfloat16")
    with pytest.raises(ValueError, match="CUDA_BFLOAT16 must be 'float32' or 'bits', got 'bfloat16'"):
        rt._bits_crossing()
