"""Training a small Transformer LM with racecpu's op, in PyTorch and in JAX: step time and loss on a budget.

    PYTHONPATH=. python3 benchmarks/framework_train.py                   # the full run (quiet machine; ~30 min)
    PYTHONPATH=. python3 benchmarks/framework_train.py --quick           # smoke test at tiny sizes (~1 min)
    PYTHONPATH=. python3 benchmarks/framework_train.py --frameworks torch --lengths 1024,4096 --no-training

The models are ``examples/torch_char_lm.py`` and ``examples/jax_char_lm.py``
(d_model 128, 4 heads, 2 layers, AdamW; the attention is the only switch):

(a) **step time**: one training step (forward, backward, gradient clip,
    AdamW) at batch 1 and each of ``--lengths`` tokens, for torch
    race vs torch SDPA (``F.scaled_dot_product_attention(is_causal=True)``)
    and JAX race vs JAX softmax (written out in ``jax.numpy``).  Median of
    up to ``--repeats`` steps after ``--warmup`` steps (the first JAX step
    compiles); fewer when the timed steps pass ``--max-timed-seconds``.  The
    race model's and its baseline's timed steps alternate (both models are
    alive together), so that a burst of load on a shared machine hits both.
    Each configuration is predicted first and skipped, with the reason in
    the table, when its step would pass ``--max-step-seconds`` (extrapolated
    from the configuration's shorter lengths: linear for race, a N + b N^2
    for the quadratic attentions) or when JAX softmax's N^2 tensors would pass
    ``--mem-cap-gib`` (predicted as 4 n_layers + 2 score-sized H*N^2 float32
    tensors, which is what XLA's step held at N = 4096; 40 GiB at N = 16384).
    Torch's SDPA takes its flash-attention CPU kernel here (memory linear in
    N), so only its time is predicted.
(b) **loss on a budget**: each of the four trains from seed 0 (race and
    its baseline start from the same weights; the race models add beta and
    the planes) on the same batches (stdlib-docstring characters,
    ``--train-seq-len`` tokens, ``--batch-size`` windows a step) for the same
    wall clock, ``--budget`` seconds (the first step, which compiles, is not
    counted), then is evaluated on the same ``--eval-windows`` validation
    windows: bits per character.

Writes ``framework_train.{md,json}`` (``framework_train_quick.*`` with
``--quick``) to ``benchmarks/results/framework_train/`` (``--out``), after
every measurement, so an interrupted run leaves what it measured; prints
progress to stderr and the tables to stdout.  Both frameworks run in this one
process, one configuration at a time; torch and racecpu's Numba kernels use
``--threads`` threads, XLA its own pool (all cores).
"""

import argparse
import datetime
import gc
import json
import math
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# the examples' folder comes in, for the two models
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import racecpu  # noqa: E402
from racecpu.apps.tasks import CHARS, char_corpus, char_eval_windows  # noqa: E402

VOCAB = len(CHARS)
#: (framework, attention) pairs, race first, then its baseline
CONFIGS = {"torch": ("race", "sdpa"), "jax": ("race", "softmax")}
QUADRATIC = {"sdpa", "softmax"}
#: seconds: a warm-up step this long is the last warm-up step
LONG_STEP = 10.0


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def example(framework):
    if framework == "torch":
        import torch_char_lm as mod
    else:
        import jax_char_lm as mod
    return mod


# ---------------------------------------------------------------------------
# memory: peak RSS per configuration
# ---------------------------------------------------------------------------

def _reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _status_kib(field):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _available_gib():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return None


# ---------------------------------------------------------------------------
# (a) step time
# ---------------------------------------------------------------------------

def predict_seconds(attention, history, n):
    """Predicted seconds per step at ``n`` from ``history`` [(n, seconds), ...] of the same configuration."""
    if not history:
        return None
    n1, t1 = history[-1]
    if attention not in QUADRATIC:
        return t1 * n / n1
    if len(history) >= 2:
        n0, t0 = history[-2]
        # t = a n + b n^2 through the last two points
        det = n0 * n1 ** 2 - n1 * n0 ** 2
        a = (t0 * n1 ** 2 - t1 * n0 ** 2) / det
        b = (n0 * t1 - n1 * t0) / det
        if a >= 0 and b >= 0:
            return a * n + b * n ** 2
    return t1 * (n / n1) ** 2  # an upper bound when the linear part is unknown


def scores_gib(args, n):
    """Predicted memory of JAX softmax's N^2 tensors in one step (batch 1): (4 n_layers + 2) x H*N^2 float32.

    Calibrated on XLA's CPU step here: 2 layers, 4 heads, N = 4096 raised the
    peak RSS by 2.4 GiB, ten 256 MiB score-sized tensors.
    """
    return (4 * args.n_layers + 2) * args.n_heads * n * n * 4 / 2 ** 30


def time_configs(args, framework, attentions, n):
    """Step times of ``attentions`` (one framework, ``n`` tokens, batch 1): {attention: dict}.

    Each model warms up on its own (``--warmup`` steps, the first one alone
    when it takes over LONG_STEP seconds; the peak RSS is read over these),
    then the models' timed steps alternate, so that a burst of load on a
    shared machine falls on both: up to ``--repeats`` each, fewer once a
    model's timed steps pass ``--max-timed-seconds``.
    """
    mod = example(framework)
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, (1, n))
    y = rng.integers(0, VOCAB, (1, n))
    steps, out = {}, {}
    for att in attentions:
        model = mod.build_model(att, VOCAB, args.d_model, args.n_heads, args.n_layers, seq_len=n, seed=0)
        steps[att] = (model, mod.make_step(model, lr=1e-4))
        tracked = _reset_peak()
        before = _status_kib("VmRSS")
        warm = []
        for _ in range(args.warmup):
            t0 = time.perf_counter()
            steps[att][1](x, y)
            warm.append(time.perf_counter() - t0)
            if warm[-1] > LONG_STEP:
                break  # a step this long is past the warm-up effects that a second one would remove
        peak = _status_kib("VmHWM") if tracked else None
        out[att] = {"warmup_ms": [1e3 * t for t in warm], "times_ms": [],
                    "peak_rss_gib": None if peak is None else peak / 2 ** 20,
                    "rss_before_gib": None if before is None else before / 2 ** 20}
        log(f"  {att}: warm-up {', '.join(f'{1e3 * t:.1f}' for t in warm)} ms")
    for _ in range(args.repeats):
        for att in attentions:
            ts = out[att]["times_ms"]
            if ts and sum(ts) / 1e3 >= args.max_timed_seconds:
                continue
            t0 = time.perf_counter()
            loss = steps[att][1](x, y)
            ts.append(1e3 * (time.perf_counter() - t0))
            if not math.isfinite(loss):
                raise FloatingPointError(f"{framework} {att} N={n}: loss {loss}")
    for att in attentions:
        r = out[att]
        r.update(ms=float(np.median(r["times_ms"])), steps_timed=len(r["times_ms"]))
    del steps, model
    gc.collect()
    return out


def step_times(args, frameworks, results, save):
    hist = {}   # (framework, attention) -> [(n, seconds per step, or None when skipped)]
    for n in args.lengths:
        for fw in frameworks:
            rows, run = {}, []
            for att in CONFIGS[fw]:
                row = {"framework": fw, "attention": att, "seq_len": n}
                results["timing"].append(row)
                rows[att] = row
                h = hist.setdefault((fw, att), [])
                measured = [(m, t) for m, t in h if t is not None]
                pred = predict_seconds(att, measured, n)
                skip = None
                if fw == "jax" and att == "softmax" and scores_gib(args, n) > args.mem_cap_gib:
                    skip = (f"N^2 scores predicted at {scores_gib(args, n):.3g} GiB "
                            f"> --mem-cap-gib {args.mem_cap_gib:.3g}")
                elif pred is not None and pred > args.max_step_seconds:
                    skip = (f"predicted {pred:.3g} s/step (from N={measured[-1][0]}) > --max-step-seconds "
                            f"{args.max_step_seconds:g}")
                elif h and h[-1][1] is None:
                    skip = f"N={h[-1][0]} was skipped"
                if skip:
                    row["skipped"] = skip
                    h.append((n, None))
                    log(f"timing {fw:5s} {att:7s} N={n:6d}: skipped: {skip}")
                else:
                    run.append(att)
                    if pred is not None:
                        row["predicted_s"] = pred
            save()
            if not run:
                continue
            log(f"timing {fw:5s} N={n:6d}: {' and '.join(run)}, alternating"
                + "".join(f"; {att} predicted {rows[att]['predicted_s']:.2f} s/step"
                          for att in run if "predicted_s" in rows[att]))
            try:
                res = time_configs(args, fw, run, n)
            except MemoryError as exc:
                for att in run:
                    rows[att]["skipped"] = f"MemoryError: {exc}"
                    hist[(fw, att)].append((n, None))
                log(f"  skipped: MemoryError: {exc}")
                save()
                continue
            for att in run:
                r = res[att]
                rows[att].update(r)
                hist[(fw, att)].append((n, r["ms"] / 1e3))
                log(f"  {att}: {r['ms']:.1f} ms/step (median of {r['steps_timed']}), peak RSS "
                    + ("?" if r["peak_rss_gib"] is None else f"{r['peak_rss_gib']:.2f} GiB"))
            save()


# ---------------------------------------------------------------------------
# (b) validation loss after a fixed wall-clock budget
# ---------------------------------------------------------------------------

def budget_training(args, frameworks, results, save):
    train_ids, val_ids = char_corpus()
    windows = char_eval_windows(val_ids, args.eval_windows, args.train_seq_len)
    for fw in frameworks:
        mod = example(fw)
        for att in CONFIGS[fw]:
            log(f"training {fw} {att}: {args.budget:.0f} s at N={args.train_seq_len}, batch {args.batch_size}")
            model = mod.build_model(att, VOCAB, args.d_model, args.n_heads, args.n_layers,
                                    seq_len=args.train_seq_len, seed=0)
            r = mod.train(model, train_ids, seq_len=args.train_seq_len, batch_size=args.batch_size,
                          seconds=args.budget, lr=args.lr, seed=0, log_every=max(5.0, args.budget / 10),
                          log=lambda m, fw=fw, att=att: log(f"{fw} {att}{m}"))
            t0 = time.perf_counter()
            bpc = mod.evaluate(model, windows)
            row = {"framework": fw, "attention": att, "steps": r["steps"], "train_seconds": r["seconds"],
                   "step_ms": r["step_ms"], "train_loss": float(np.mean(r["losses"][-10:])),
                   "val_bpc": bpc, "eval_seconds": time.perf_counter() - t0,
                   "losses": [round(v, 4) for v in r["losses"]]}
            if att == "race":
                row["beta"] = _betas(fw, model)
            results["training"].append(row)
            log(f"  {r['steps']} steps, train loss {row['train_loss']:.4f} nats, validation {bpc:.4f} bits/char")
            del model
            gc.collect()
            save()


def _betas(framework, model):
    if framework == "torch":
        return [round(b.race.beta.item(), 3) for b in model.blocks]
    return [round(float(b["beta"]), 3) for b in model.params["blocks"]]


# ---------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------

def markdown(args, results):
    env = results["environment"]
    md = [f"# Training a Transformer LM with racecpu's op: torch and JAX{' (--quick)' if args.quick else ''}", "",
          f"{env['date']}; {env['cpu']}, {env['cores']} cores; torch {env.get('torch', '-')} "
          f"({env.get('torch_threads', '-')} threads), jax {env.get('jax', '-')} (XLA's own pool), "
          f"racecpu {env['racecpu']} (Numba threads {env['numba_threads']}).",
          f"Model: d_model {args.d_model}, {args.n_heads} heads, {args.n_layers} layers, vocab {VOCAB}, "
          f"float32; RACE P = L = 3, beta trained.", ""]
    if results["timing"]:
        md += [f"## Training step time (batch 1; forward + backward + clip + AdamW; median of up to "
               f"{args.repeats} steps after {args.warmup} warm-up)", ""]
        by = {(r["framework"], r["attention"], r["seq_len"]): r for r in results["timing"]}
        fws = [fw for fw in CONFIGS if any(k[0] == fw for k in by)]
        head = ["N"]
        for fw in fws:
            base = CONFIGS[fw][1]
            head += [f"{fw} race ms", f"{fw} {base} ms", f"{base} / race"]
        md += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for n in sorted({k[2] for k in by}):
            cells = [str(n)]
            for fw in fws:
                rs = [by.get((fw, att, n)) for att in CONFIGS[fw]]
                for r in rs:
                    if r is None:
                        cells.append("")
                    elif "skipped" in r:
                        cells.append(f"skipped: {r['skipped']}")
                    elif "ms" in r:
                        few = "" if r["steps_timed"] >= args.repeats else f" (n={r['steps_timed']})"
                        cells.append(f"{r['ms']:.1f}{few}")
                    else:
                        cells.append("running")
                ok = all(r is not None and "ms" in r for r in rs)
                cells.append(f"{rs[1]['ms'] / rs[0]['ms']:.2f}x" if ok else "")
            md.append("| " + " | ".join(cells) + " |")
        peaks = [r for r in results["timing"] if r.get("peak_rss_gib") is not None]
        if peaks:
            md += ["", "Peak RSS of the process over each configuration's warm-up steps (GiB; both models of an "
                       "N are alive together, and the process keeps what torch, XLA and racecpu's pools hold): "
                       + ", ".join(
                f"{r['framework']} {r['attention']} {r['seq_len']}: {r['peak_rss_gib']:.2f}" for r in peaks)
                   + "."]
        md.append("")
    if results["training"]:
        md += [f"## Validation bits/char after {args.budget:.0f} s of training (N = {args.train_seq_len}, "
               f"batch {args.batch_size}, lr {args.lr}, {args.eval_windows} validation windows)", "",
               "| framework | attention | steps | ms/step | train loss (nats) | val bits/char | beta |",
               "|---|---|---|---|---|---|---|"]
        for r in results["training"]:
            md.append(f"| {r['framework']} | {r['attention']} | {r['steps']} | {r['step_ms']:.1f} | "
                      f"{r['train_loss']:.4f} | {r['val_bpc']:.4f} | "
                      f"{' '.join(str(b) for b in r.get('beta', []))} |")
        md.append("")
    md.append("Command: `" + " ".join(["python3", "benchmarks/framework_train.py"] + results["argv"]) + "`")
    return "\n".join(md) + "\n"


def environment(args, frameworks):
    import numba
    env = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
           "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "racecpu": racecpu.__version__, "numba_threads": numba.get_num_threads(),
           "mem_available_gib": _available_gib()}
    try:
        env["numba_threading_layer"] = numba.threading_layer()
    except ValueError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if names:
            env["cpu"] = names[0]
    except OSError:
        pass
    if "torch" in frameworks:
        import torch
        env.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    if "jax" in frameworks:
        import jax
        env.update(jax=jax.__version__, jax_backend=jax.default_backend())
    return env


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1024,4096,16384,65536", help="comma-separated N for the step timing")
    p.add_argument("--budget", type=float, default=120.0, help="training seconds per model for (b)")
    p.add_argument("--frameworks", default="torch,jax", help="comma-separated: torch, jax")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test of the whole script")
    p.add_argument("--no-timing", action="store_true", help="skip (a)")
    p.add_argument("--no-training", action="store_true", help="skip (b)")
    p.add_argument("--train-seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8, help="training batch for (b); (a) uses 1")
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="timed steps per configuration (at most)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (fewer for slow steps)")
    p.add_argument("--max-step-seconds", type=float, default=300.0,
                   help="skip a configuration whose predicted step is longer")
    p.add_argument("--max-timed-seconds", type=float, default=120.0,
                   help="stop timing a configuration once its timed steps add up to this")
    p.add_argument("--mem-cap-gib", type=float, default=None,
                   help="skip JAX softmax above this much N^2 scores (default: half the available memory)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch and racecpu (Numba) threads (default: all cores)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "framework_train"))
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        q = dict(lengths="128,256", budget=min(args.budget, 4.0), train_seq_len=128, batch_size=4, eval_windows=4,
                 d_model=32, n_heads=2, n_layers=1, repeats=3, warmup=1)
        for k, v in q.items():
            if getattr(args, k) == p.get_default(k):  # flags given on the command line win
                setattr(args, k, v)
    args.lengths = sorted(int(s) for s in str(args.lengths).split(",") if s.strip())
    if args.mem_cap_gib is None:
        args.mem_cap_gib = 0.5 * (_available_gib() or 8.0)
    return args


def main(argv=None):
    args = parse_args(argv)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    bad = [f for f in frameworks if f not in CONFIGS]
    if bad:
        raise SystemExit(f"unknown framework(s) {bad}; choose from {sorted(CONFIGS)}")
    threads = args.threads or os.cpu_count()
    if "torch" in frameworks:
        # torch first, as a user's script has it: racecpu's Numba kernels then run on torch's OpenMP runtime
        # (one libgomp), and each of their parallel calls sets its thread count to Numba's, so both get the same
        import torch
        torch.set_num_threads(threads)
    import numba
    racecpu.set_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, "framework_train_quick" if args.quick else "framework_train")
    results = {"argv": args.argv, "environment": environment(args, frameworks),
               "settings": {k: v for k, v in vars(args).items() if k not in ("argv", "out")},
               "timing": [], "training": []}

    def save():
        with open(base + ".json", "w") as f:
            json.dump(results, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(markdown(args, results))

    env = results["environment"]
    log(f"frameworks {frameworks}; torch threads {env.get('torch_threads', '-')}, Numba threads "
        f"{env['numba_threads']}, XLA: its own pool; mem cap {args.mem_cap_gib:.1f} GiB; writing {base}.md/.json")
    if not args.no_timing:
        step_times(args, frameworks, results, save)
    if not args.no_training:
        budget_training(args, frameworks, results, save)
    save()
    print(markdown(args, results))
    log(f"wrote {base}.md and {base}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
