"""``racecpu train``: train small Transformers in pure NumPy with RACE or baseline attention.

Examples
--------
racecpu train --task mqar --attention race
racecpu train --task chars --attention softmax --steps 500 --json
racecpu train --task mqar --compare            # all four attentions, table + learning curves
racecpu train --timing                         # step time vs sequence length, RACE vs softmax
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time

import numpy as np

from ..autograd import functional as F
from ..autograd.nn import ATTENTIONS, ESTIMATORS, TransformerLM
from ..autograd.optim import AdamW, clip_grad_norm, warmup_linear_decay
from ..autograd.tensor import no_grad
from ..hashing import LAYER_BETA, LAYER_NUM_PLANES, LAYER_NUM_TABLES
from .tasks import IGNORE, char_batch, char_corpus, char_eval_windows, mqar_batch, CHARS

#: Per-task defaults (chosen so one run takes a few minutes on a 2-core machine).
TASK_DEFAULTS = {
    "mqar": dict(steps=1200, batch_size=32, seq_len=64, d_model=64, n_heads=2, n_layers=2, lr=3e-3,
                 warmup=0.05, vocab_size=32, num_pairs=8, eval_every=100, eval_size=256, token_shift=True,
                 conv_size=0),
    "chars": dict(steps=1000, batch_size=16, seq_len=128, d_model=64, n_heads=2, n_layers=2, lr=3e-3,
                  warmup=0.05, vocab_size=len(CHARS), num_pairs=None, eval_every=100, eval_size=64,
                  token_shift=True, conv_size=4),
}
# conv_size: the short convolution on q, k, v goes to all four attention types alike.  On chars it lowers
# every model's bits/char (RACE 3.24 -> 2.63, softmax 2.85 -> 2.63 at 1000 steps); on MQAR (PyTorch's
# default Conv1d init) it lowered RACE's accuracy to 0.93 (softmax 1.0), so MQAR keeps it off.

def add_arguments(p):
    from ..cli import (add_alias, add_common_arguments, nonnegative_float, nonnegative_int, num_planes,
                       positive_float, positive_int)

    p.add_argument("--task", choices=sorted(TASK_DEFAULTS), default="mqar",
                   help="mqar: multi-query associative recall; chars: character LM on stdlib docstrings/comments")
    p.add_argument("--attention", choices=ATTENTIONS, default="race")
    p.add_argument("--compare", action="store_true",
                   help="train all four attentions on the same budget; write a table and learning-curve PNG")
    p.add_argument("--timing", action="store_true",
                   help="time one training step at several sequence lengths (RACE vs softmax vs linear)")
    g = p.add_argument_group("model and budget (defaults depend on --task)")
    for name, typ in (("steps", positive_int), ("batch-size", positive_int), ("tokens", positive_int),
                      ("d-model", positive_int), ("heads", positive_int), ("layers", positive_int),
                      ("lr", positive_float), ("warmup", nonnegative_float), ("vocab-size", positive_int),
                      ("num-pairs", positive_int), ("eval-every", positive_int), ("eval-size", positive_int)):
        key = _KEYS.get(name, name.replace("-", "_"))
        g.add_argument(f"--{name}", dest=key, type=typ, default=None,
                       help="default: " + ", ".join(f"{t} {d[key]}" for t, d in sorted(TASK_DEFAULTS.items())
                                                    if d[key] is not None))
    for old, key, typ in (("--seq-len", "seq_len", positive_int), ("--n-heads", "n_heads", positive_int),
                          ("--n-layers", "n_layers", positive_int)):
        add_alias(g, old, key, typ)
    g.add_argument("--token-shift", choices=("on", "off"), default=None,
                   help="add an embedding of the previous token (default: on)")
    g.add_argument("--conv-size", type=nonnegative_int, default=None,
                   help="width of a causal depthwise convolution on q, k, v, for every attention type (0: none); "
                        "default: " + ", ".join(f"{t} {d['conv_size']}" for t, d in sorted(TASK_DEFAULTS.items())))
    g.add_argument("--conv-act", choices=("on", "off"), default="on", help="SiLU after the convolution")
    g.add_argument("--weight-decay", type=nonnegative_float, default=0.01)
    g.add_argument("--clip", type=positive_float, default=1.0, help="global gradient-norm clip")
    g.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    g.add_argument("--seed", type=nonnegative_int, default=0)
    r = p.add_argument_group("RACE")
    r.add_argument("--num-planes", type=num_planes, default=LAYER_NUM_PLANES,
                   help=f"P, 1..16 (angular attention uses gamma = P); default {LAYER_NUM_PLANES}")
    add_alias(r, "--planes", "num_planes", num_planes)
    r.add_argument("--num-tables", type=positive_int, default=LAYER_NUM_TABLES, help=f"L; default {LAYER_NUM_TABLES}")
    add_alias(r, "--tables", "num_tables", positive_int)
    r.add_argument("--beta", type=positive_float, default=LAYER_BETA,
                   help=f"initial temperature, > 0; default {LAYER_BETA}")
    r.add_argument("--fixed-beta", action="store_true", help="do not train beta")
    r.add_argument("--estimator", choices=ESTIMATORS, default="ratio",
                   help="ratio: the paper's (linear in N); "
                        "bucket_mean: the authors' released code's (also linear in N)")
    r.add_argument("--beta-per-head", action="store_true", help="one trained temperature per head")
    o = add_common_arguments(p, out=True)
    o.add_argument("--save-qkv", metavar="FILE.npz", default=None,
                   help="after training, save the queries, keys and values every layer's attention reads on the "
                        "first 8 validation sequences (arrays q, k, v of shape (layers, 8, heads, N, head_dim); "
                        "for racecpu validate --qkv)")
    o.add_argument("--timing-lengths", type=_lengths, default="256,512,1024,2048",
                   help="comma-separated sequence lengths for --timing")


# flag name -> the config key (the config keeps the model's own words)
_KEYS = {"tokens": "seq_len", "heads": "n_heads", "layers": "n_layers"}


def _lengths(text):
    import argparse
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def config_from_args(args, attention=None):
    """A plain dict of every training setting (task defaults filled in)."""
    cfg = dict(TASK_DEFAULTS[args.task])
    for key in cfg:
        val = getattr(args, key, None)
        if val is not None:
            cfg[key] = val
    cfg.update(task=args.task, attention=attention or args.attention, weight_decay=args.weight_decay,
               clip=args.clip, dtype=args.dtype, seed=args.seed, num_planes=args.num_planes,
               num_tables=args.num_tables, beta=args.beta, train_beta=not args.fixed_beta,
               beta_per_head=args.beta_per_head, conv_act=args.conv_act == "on",
               estimator=getattr(args, "estimator", "ratio"))
    if args.conv_size is not None:
        cfg["conv_size"] = args.conv_size
    if cfg["task"] == "chars":
        cfg["vocab_size"] = len(CHARS)
    if args.token_shift is not None:
        cfg["token_shift"] = args.token_shift == "on"
    return cfg


def build_model(cfg):
    return TransformerLM(cfg["vocab_size"], cfg["d_model"], cfg["n_heads"], cfg["n_layers"],
                         attention=cfg["attention"], num_planes=cfg["num_planes"], num_tables=cfg["num_tables"],
                         beta=cfg["beta"], estimator=cfg.get("estimator", "ratio"), train_beta=cfg["train_beta"],
                         beta_per_head=cfg["beta_per_head"],
                         conv_size=cfg["conv_size"], conv_act=cfg["conv_act"], max_len=cfg["seq_len"],
                         token_shift=cfg["token_shift"],
                         seed=cfg["seed"], dtype=np.dtype(cfg["dtype"]))


class _Data:
    """Training batches and the fixed evaluation set of a task."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.rng = np.random.default_rng([cfg["seed"], 1])
        n = cfg["seq_len"]
        if cfg["task"] == "mqar":
            self.eval = mqar_batch(np.random.default_rng([cfg["seed"], 2]), cfg["eval_size"], n,
                                   cfg["vocab_size"], cfg["num_pairs"])
        else:
            self.train_ids, val_ids = char_corpus()
            self.eval = char_eval_windows(val_ids, cfg["eval_size"], n)

    def batch(self):
        c = self.cfg
        if c["task"] == "mqar":
            return mqar_batch(self.rng, c["batch_size"], c["seq_len"], c["vocab_size"], c["num_pairs"])
        return char_batch(self.rng, self.train_ids, c["batch_size"], c["seq_len"])


def evaluate(model, cfg, data, batch=64):
    """Validation metrics: MQAR accuracy at query positions, or bits per character."""
    x, y = data.eval
    model.eval()
    nll, n_tok, correct = 0.0, 0, 0
    with no_grad():
        for s in range(0, len(x), batch):
            logits = model(x[s:s + batch]).data.astype(np.float64)
            t = y[s:s + batch]
            valid = t != IGNORE
            tt = np.where(valid, t, 0)
            m = logits.max(-1, keepdims=True)
            lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
            nll += float(((lse - np.take_along_axis(logits, tt[..., None], -1)[..., 0]) * valid).sum())
            correct += int(((logits.argmax(-1) == t) & valid).sum())
            n_tok += int(valid.sum())
    model.train()
    return validation_metrics(cfg["task"], nll, n_tok, correct)


def validation_metrics(task, nll, n_tok, correct):
    """The validation dict from summed negative log-likelihood (nats), scored tokens and correct ones:
    ``val_loss`` and MQAR's ``val_accuracy`` or the characters' ``val_bpc``."""
    loss = nll / max(n_tok, 1)
    if task == "mqar":
        return {"val_loss": loss, "val_accuracy": correct / max(n_tok, 1)}
    return {"val_loss": loss, "val_bpc": loss / math.log(2)}


def train_step(model, opt, x, y, clip):
    """Forward, backward, clip, update; returns the loss."""
    loss = F.cross_entropy(model(x), y, ignore_index=IGNORE)
    opt.zero_grad()
    loss.backward()
    clip_grad_norm(opt.params, clip)
    opt.step()
    return float(loss.data)


def attention_inputs(model, tokens):
    """The ``(q, k, v)`` each attention layer of ``model`` reads on ``tokens (B, N)``.

    Returns a list with one tuple of arrays per layer, shapes ``(B, H, N,
    head_dim)`` (keys and values with the layer's key/value heads), as
    :meth:`racecpu.autograd.nn.MultiHeadAttention.project` gives them.
    The model is run once without gradients and left as it was.
    """
    seen = []

    def capture(attn):
        def forward(x, *args, **kwargs):
            seen.append(tuple(t.data for t in attn.project(x)))
            return type(attn).forward(attn, x, *args, **kwargs)
        return forward

    for blk in model.blocks:
        blk.attn.forward = capture(blk.attn)  # an instance attribute, removed below
    try:
        with no_grad():
            model(tokens)
    finally:
        for blk in model.blocks:
            del blk.attn.forward
    return seen


def save_attention_inputs(model, tokens, path):
    """Write :func:`attention_inputs` to ``path`` (``.npz``: ``q``, ``k``, ``v`` stacked over layers)."""
    layers = attention_inputs(model, tokens)
    np.savez_compressed(path, **{name: np.stack([qkv[i] for qkv in layers]) for i, name in enumerate("qkv")})


def train(cfg, progress=False, desc=None, save_qkv=None):
    """Train one model from ``cfg`` (see :func:`config_from_args`); returns the metrics dict.

    The dict holds the final validation metrics, ``time_per_step_ms`` (median
    over steps), ``train_seconds`` and ``history`` (per-step losses and the
    periodic validation metrics, for learning curves).  With ``save_qkv`` (a
    path), the trained model's attention inputs on the first 8 validation
    sequences are written there (:func:`save_attention_inputs`).
    """
    from tqdm import tqdm

    data = _Data(cfg)
    model = build_model(cfg)
    opt = AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    steps = cfg["steps"]
    history = {"step": [], "loss": [], "eval_step": [], "eval": []}
    times = []
    ema = None
    bar = tqdm(range(steps), desc=desc or f"{cfg['task']}/{cfg['attention']}", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    t_start = time.perf_counter()
    for step in bar:
        opt.lr = warmup_linear_decay(step, steps, cfg["lr"], cfg["warmup"])
        x, y = data.batch()
        t0 = time.perf_counter()
        loss = train_step(model, opt, x, y, cfg["clip"])
        times.append(time.perf_counter() - t0)
        if not math.isfinite(loss):
            raise FloatingPointError(f"training diverged at step {step} (loss {loss})")
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        history["step"].append(step)
        history["loss"].append(loss)
        if (step + 1) % cfg["eval_every"] == 0 or step + 1 == steps:
            ev = evaluate(model, cfg, data)
            history["eval_step"].append(step + 1)
            history["eval"].append(ev)
            bar.set_postfix(loss=f"{ema:.3f}", **{k: f"{v:.3f}" for k, v in ev.items() if k != "val_loss"})
        elif step % 10 == 0:
            bar.set_postfix(loss=f"{ema:.3f}")
    bar.close()
    total = time.perf_counter() - t_start
    final = history["eval"][-1] if history["eval"] else evaluate(model, cfg, data)
    if save_qkv:
        save_attention_inputs(model, data.eval[0][:8], save_qkv)
    betas = None
    if cfg["attention"] == "race":
        betas = [b for blk in model.blocks for b in np.atleast_1d(blk.attn.current_beta())]
    return {"task": cfg["task"], "attention": cfg["attention"], "steps": steps, **final,
            "train_loss": float(np.mean(history["loss"][-max(1, steps // 20):])),
            "time_per_step_ms": 1e3 * float(np.median(times)), "train_seconds": total,
            "num_parameters": model.num_parameters(), "beta": betas,
            "numba_threads": _numba_threads(), "config": cfg, "history": history}


def _numba_threads():
    try:
        import numba
        return int(numba.get_num_threads())
    except Exception:  # pragma: no cover
        return None


def _threads_note():
    blas = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or "default"
    return f"numba threads {_numba_threads()}, BLAS threads {blas}"


# ---------------------------------------------------------------------------
# --compare and --timing
# ---------------------------------------------------------------------------

def _metric(task):
    return ("val_accuracy", "accuracy") if task == "mqar" else ("val_bpc", "bits/char")


def compare(args):
    task = args.task
    from ..cli import output_dir

    results = [train(config_from_args(args, att), progress=args.progress) for att in ATTENTIONS]
    key, label = _metric(task)
    base = os.path.join(output_dir(args, "train"), f"{task}_compare")
    rows = [{"attention": r["attention"], label: round(r[key], 4), "val_loss": round(r["val_loss"], 4),
             "ms_per_step": round(r["time_per_step_ms"], 2), "train_s": round(r["train_seconds"], 1),
             "steps": r["steps"], "params": r["num_parameters"],
             "beta": "" if r["beta"] is None else " ".join(f"{b:.2f}" for b in r["beta"])} for r in results]
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cfg = results[0]["config"]
    settings = ", ".join(f"{k}={cfg[k]}" for k in ("steps", "batch_size", "seq_len", "d_model", "n_heads",
                                                   "n_layers", "lr", "token_shift", "conv_size", "num_planes",
                                                   "num_tables", "dtype")
                         if cfg.get(k) is not None)
    md = [f"**{task}** ({settings}; {_threads_note()})", "",
          "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    md += ["| " + " | ".join(str(v) for v in r.values()) + " |" for r in rows]
    with open(base + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    with open(base + ".json", "w") as f:
        json.dump(results, f)
    _plot_curves(results, key, label, base + ".png")
    print("\n".join(md))
    print(f"wrote {base}.csv, .md, .json, .png")
    args.result = {"task": task, "out": os.path.dirname(base),
                   "results": [{k: v for k, v in r.items() if k not in ("history", "config")} for r in results]}
    return 0


def _plot_curves(results, key, label, path):
    # A Figure on an Agg canvas: pyplot's backend and figures are left as the caller has them.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    a1, a2 = fig.subplots(1, 2)
    for r in results:
        h = r["history"]
        loss = np.asarray(h["loss"])
        k = max(1, len(loss) // 50)
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        a1.plot(np.arange(len(smooth)) + k, smooth, label=r["attention"])
        a2.plot(h["eval_step"], [e[key] for e in h["eval"]], marker=".", label=r["attention"])
    a1.set(xlabel="step", ylabel="training loss (nats/token)", title=f"{results[0]['task']}: training loss")
    a2.set(xlabel="step", ylabel=f"validation {label}", title=f"{results[0]['task']}: validation {label}")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def timing(args, repeats=5):
    """Median seconds of one training step vs sequence length for race, softmax, linear."""
    from ..cli import output_dir

    lengths = args.timing_lengths if isinstance(args.timing_lengths, list) else _lengths(args.timing_lengths)
    rows = []
    for n in lengths:
        row = {"seq_len": n}
        for att in ("race", "softmax", "linear"):
            cfg = config_from_args(args, att)
            cfg.update(seq_len=n, batch_size=1, task="chars", vocab_size=len(CHARS), token_shift=False)
            model = build_model(cfg)
            opt = AdamW(model.parameters(), lr=1e-4)
            rng = np.random.default_rng(0)
            x = rng.integers(0, cfg["vocab_size"], (1, n))
            y = rng.integers(0, cfg["vocab_size"], (1, n))
            train_step(model, opt, x, y, 1.0)  # warm-up (Numba compile, caches)
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                train_step(model, opt, x, y, 1.0)
                ts.append(time.perf_counter() - t0)
            row[f"{att}_ms"] = round(1e3 * float(np.median(ts)), 2)
        row["softmax/race"] = round(row["softmax_ms"] / row["race_ms"], 2)
        rows.append(row)
        print(row, file=sys.stderr) if not args.quiet else None
    cfg = config_from_args(args, "race")
    head = (f"training step (forward+backward+AdamW), batch 1, d_model={cfg['d_model']}, n_heads={cfg['n_heads']}, "
            f"n_layers={cfg['n_layers']}, conv_size={cfg['conv_size']} ({cfg['task']} default), {cfg['dtype']}, "
            f"median of {repeats}; {_threads_note()}")
    md = [head, "", "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    md += ["| " + " | ".join(str(v) for v in r.values()) + " |" for r in rows]
    out = output_dir(args, "train")
    with open(os.path.join(out, "step_timing.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    args.result = {"timing": rows, "out": out}
    return 0


def run(args):
    from ..cli import UsageError, require

    if args.compare:
        require("matplotlib", "racecpu train --compare (its learning-curve plot)", "train")
    cfg = config_from_args(args)
    if cfg["task"] == "mqar" and not args.timing and cfg["seq_len"] < 4 * cfg["num_pairs"]:
        raise UsageError(f"mqar needs --tokens >= 4 * --num-pairs = {4 * cfg['num_pairs']}, got {cfg['seq_len']}")
    if args.timing:
        return timing(args)
    if args.compare:
        return compare(args)
    if args.save_qkv and (args.compare or args.timing):
        raise UsageError("--save-qkv saves one trained model's attention inputs: not with --compare or --timing")
    if args.save_qkv and not os.path.isdir(os.path.dirname(os.path.abspath(args.save_qkv))):
        raise UsageError(f"--save-qkv {args.save_qkv}: no such folder")
    res = train(config_from_args(args), progress=args.progress, save_qkv=args.save_qkv)
    key, label = _metric(args.task)
    print(f"{res['task']} / {res['attention']}: validation {label} {res[key]:.4f}, val loss {res['val_loss']:.4f}, "
          f"{res['time_per_step_ms']:.1f} ms/step, {res['train_seconds']:.0f} s"
          + (f", beta {', '.join(f'{b:.2f}' for b in res['beta'])}" if res["beta"] else ""))
    args.result = {k: v for k, v in res.items() if k != "history"}
    return 0


def main(argv=None):  # pragma: no cover - convenience for python -m
    p = argparse.ArgumentParser(prog="racecpu train")
    add_arguments(p)
    args = p.parse_args(argv)
    args.progress, args.result = not args.quiet and sys.stderr.isatty(), None
    rc = run(args)
    if args.json:
        print(json.dumps(args.result, default=str))
    return rc


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
