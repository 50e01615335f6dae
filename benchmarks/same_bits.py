"""Whether two racecpu checkouts give the same bits on every path.

Imports this checkout's racecpu (A) and another's (B) into one process
(as :mod:`benchmarks.ab` does) and runs both on the same inputs through
every frontend: the NumPy API (forward, forward alone, backward, with
``dplanes``, ``out=`` buffers, key masks, grouped-query heads, packed
sequences, 16-bit inputs, float32 and float64, causal and not, chunks short
enough that every scan crosses chunks and segments), the sketch algebra,
streaming decode, the out-of-core passes and the soft hash.  Prints each
case and whether every result is bitwise equal (NaNs equal), and exits 1
if any differs.  A refactoring that claims "the same bits" passes it.

    python benchmarks/same_bits.py OTHER_CHECKOUT [WORD ...]   # WORD: only the cases named with it
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import ROOT, load  # noqa: E402


def flat(x):
    """Every array in a nested result, in order."""
    if isinstance(x, (tuple, list)):
        return [a for y in x for a in flat(y)]
    if hasattr(x, "A") and hasattr(x, "B") and hasattr(x, "planes"):  # a Sketch
        return [np.asarray(x.A), np.asarray(x.B)]
    return [np.asarray(x)]


def same(a, b):
    fa, fb = flat(a), flat(b)
    if len(fa) != len(fb):
        return False
    for x, y in zip(fa, fb):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.dtype.kind == "f" or x.dtype.name == "bfloat16":
            x, y = x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)
        if not np.array_equal(x, y):
            return False
    return True


def cases(rc, rng_seed):
    """(name, thunk) pairs running racecpu module ``rc`` on inputs from ``rng_seed``."""
    rng = np.random.default_rng(rng_seed)

    def arr(*shape, dtype=np.float32):
        return rng.standard_normal(shape).astype(dtype)

    out = []
    for dtype in (np.float32, np.float64):
        for causal in (False, True):
            for group in (1, 3):
                tag = f"{np.dtype(dtype).name} {'causal' if causal else 'non-causal'} group {group}"
                q, g = arr(2, 3 * group, 150, 6, dtype=dtype), arr(2, 3 * group, 150, 5, dtype=dtype)
                k, v = arr(2, 3, 150, 6, dtype=dtype), arr(2, 3, 150, 5, dtype=dtype)
                W = rc.hyperplanes(6, 3, 2, seed=1, dtype=dtype)
                mask = rng.random((2, 3, 150)) > 0.2

                def api(q=q, k=k, v=v, g=g, W=W, mask=mask, causal=causal):
                    y, res = rc.race_attention_fwd(q, k, v, W, 2.0, causal=causal, key_mask=mask)
                    alone = rc.race_attention(q, k, v, W, 2.0, causal=causal, key_mask=mask)
                    return y, alone, res.A, res.B, rc.race_attention_bwd(res, g, dplanes=True)
                out.append((f"api {tag}", api))

                def buffers(q=q, k=k, v=v, g=g, W=W, causal=causal, dtype=dtype):
                    o = np.empty(q.shape[:-1] + (5,), dtype)
                    y, res = rc.race_attention_fwd(q, k, v, W, 2.0, causal=causal, out=o)
                    grads = tuple(np.empty_like(x) for x in (q, k, v))
                    return y, rc.race_attention_bwd(res, g, out=grads)
                out.append((f"out= buffers {tag}", buffers))
            cu = np.array([0, 20, 36, 39, 89, 89, 150])
            q, k, v, g = (arr(2, 2, 150, 6, dtype=dtype) for _ in range(4))
            W = rc.hyperplanes(6, 3, 2, seed=2, dtype=dtype)

            def packed(q=q, k=k, v=v, g=g, W=W, causal=causal):
                y, res = rc.race_attention_fwd(q, k, v, W, 2.0, causal=causal, cu_seqlens=cu)
                return y, rc.race_attention_bwd(res, g, dplanes=True)
            out.append((f"packed {np.dtype(dtype).name} causal={causal}", packed))
    for route, chunk in (("split", 32), ("segments", 512)):  # one head on 2 threads: two segments
        q, k, v, g = (arr(1, 600, 6) for _ in range(4))
        W = rc.hyperplanes(6, 3, 2, seed=4)

        def one_head(q=q, k=k, v=v, g=g, W=W, chunk=chunk):
            rc.config.CHUNK = chunk
            try:
                y, res = rc.race_attention_fwd(q, k, v, W, 2.0, causal=True)
                return y, rc.race_attention_bwd(res, g, dplanes=True)
            finally:
                rc.config.CHUNK = 32
        out.append((f"one head, causal backward by the {route} route where threads allow", one_head))
    q, k, v, g = (arr(2, 2, 70, 8, dtype=np.float16) for _ in range(4))
    W = rc.hyperplanes(8)
    for causal in (False, True):
        def half(q=q, k=k, v=v, g=g, W=W, causal=causal):
            y, res = rc.race_attention_fwd(q, k, v, W, causal=causal)
            return y, rc.race_attention_bwd(res, g)
        out.append((f"float16 causal={causal}", half))

    # the sketch algebra
    k, v, q, g = arr(2, 90, 6), arr(2, 90, 5), arr(2, 60, 6), arr(2, 60, 5)
    W = rc.hyperplanes(6, 3, 2, seed=3)
    mask = rng.random((2, 90)) > 0.3

    def sketch_algebra():
        S = rc.sketches
        sk = S.sketch(k, v, W, 2.0, key_mask=mask)
        o = S.readout(q, sk)
        dq, dsk, db = S.readout_bwd(q, sk, g)
        dk, dv, db2 = S.sketch_bwd(k, v, dsk, key_mask=mask)
        return sk, o, dq, dsk, db, dk, dv, db2
    out.append(("sketches: sketch, readout and their backwards", sketch_algebra))
    qc, kc, vc, gc = arr(2, 90, 6), arr(2, 90, 6), arr(2, 90, 5), arr(2, 90, 5)
    m2 = rng.random((2, 90)) > 0.3

    def causal_blocks():
        S = rc.sketches
        o1, s1 = S.causal_block(qc[:, :40], kc[:, :40], vc[:, :40], W, 2.0, key_mask=m2[:, :40])
        o2, s2 = S.causal_block(qc[:, 40:], kc[:, 40:], vc[:, 40:], W, 2.0, s1, key_mask=m2[:, 40:])
        d2 = S.causal_block_dstate(qc[:, 40:], kc[:, 40:], vc[:, 40:], W, 2.0, gc[:, 40:], s1, key_mask=m2[:, 40:])
        d2o = S.causal_block_dstate(qc[:, 40:], kc[:, 40:], vc[:, 40:], W, 2.0, gc[:, 40:], s1, key_mask=m2[:, 40:],
                                    out=o2)
        b2 = S.causal_block_bwd(qc[:, 40:], kc[:, 40:], vc[:, 40:], W, 2.0, gc[:, 40:], s1, key_mask=m2[:, 40:])
        b1 = S.causal_block_bwd(qc[:, :40], kc[:, :40], vc[:, :40], W, 2.0, gc[:, :40], None, b2[4],
                                key_mask=m2[:, :40])
        st = S.state_from_sketch(s2, 90)
        return o1, s1, o2, s2, d2, d2o, b2, b1, S.sketch_from_state(st)
    out.append(("sketches: causal blocks, their backward and dstate", causal_blocks))

    def streaming():
        st = rc.RaceState(W, 2.0, batch_shape=(2,), dv=5)
        outs = [st.extend(qc[:, :33], kc[:, :33], vc[:, :33])]
        for i in range(33, 45):
            outs.append(st.step(qc[:, i], kc[:, i], vc[:, i]))
        outs.append(st.extend(qc[:, 45:], kc[:, 45:], vc[:, 45:]))
        return outs, st.A, st.B
    out.append(("streaming: extend, step, extend", streaming))

    qo, ko, vo, go = arr(1, 4, 300, 6), arr(1, 2, 300, 6), arr(1, 2, 300, 5), arr(1, 4, 300, 5)

    def out_of_core():
        ooc = rc.outofcore
        res = []
        for causal in (False, True):
            o = np.zeros((1, 4, 300, 5), np.float32)
            r = ooc.race_attention_fwd_ooc(qo, ko, vo, W, 2.0, causal=causal, out=o, block=128, progress=False)
            dq, dk, dv = np.zeros_like(qo), np.zeros_like(ko), np.zeros_like(vo)
            db = ooc.race_attention_bwd_ooc(r, go, dq=dq, dk=dk, dv=dv, progress=False)
            res += [o, dq, dk, dv, db]
        return res
    out.append(("out of core, grouped heads, causal and not", out_of_core))
    out.append(("soft_buckets", lambda: rc.soft_buckets(arr(3, 77, 6), W, 2.0)))
    return out


def main(argv=None):
    if not argv and len(sys.argv) < 2:
        raise SystemExit(__doc__)
    other = (argv or sys.argv[1:])[0]
    a, b = load(ROOT, "racecpu"), load(other, "racecpu_ab_other")
    for m in (a, b):  # short chunks: every scan crosses chunks, segments and backward routes
        m.config.CHUNK = 32
    import importlib
    for name in ("sketches", "outofcore", "streaming"):
        for m, pkg in ((a, "racecpu"), (b, "racecpu_ab_other")):
            setattr(m, name, importlib.import_module(f"{pkg}.{name}"))
    failed = 0
    only = (argv or sys.argv[1:])[1:]  # optional words: run the cases whose names hold one
    for (name, fa), (_, fb) in zip(cases(a, 0), cases(b, 0)):
        if only and not any(w in name for w in only):
            continue
        ok = same(fa(), fb())
        failed += not ok
        print(f"{'same' if ok else 'DIFFERENT':9s}  {name}", flush=True)
    print(f"{failed} of the cases differ" if failed else "every case: the same bits")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
