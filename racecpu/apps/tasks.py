"""Offline training tasks: multi-query associative recall and stdlib characters.

Nothing is downloaded: MQAR is synthetic (seeded), and the character corpus
is the docstrings and comments of the Python standard library's own top-level
source files, found with :mod:`sysconfig`.
"""

from __future__ import annotations

import ast
import functools
import glob
import re
import os
import sysconfig

import numpy as np

__all__ = ["IGNORE", "mqar_batch", "stdlib_files", "extract_text", "char_corpus", "CHARS", "encode", "decode",
           "char_batch", "char_eval_windows"]

#: Target value that the loss and the metrics skip.
IGNORE = -100


# ---------------------------------------------------------------------------
# MQAR
# ---------------------------------------------------------------------------

def mqar_batch(rng, batch_size, seq_len, vocab_size, num_pairs):
    """A batch of multi-query associative recall sequences.

    Token 0 is padding; keys are drawn from ``1 .. nk`` and values from
    ``nk+1 .. vocab_size-1`` with ``nk = (vocab_size - 1) // 2``.  Each
    sequence is ``num_pairs`` distinct key-value pairs ``k1 v1 k2 v2 ...``,
    then a query region in which every key appears once more, in random order
    and at random (two-token-aligned) positions, followed by its value; the rest
    is padding.  The model must predict the value at each query key's position.

    Returns
    -------
    tokens : int64 array (batch_size, seq_len)
    targets : int64 array (batch_size, seq_len)
        The value at query-key positions, :data:`IGNORE` elsewhere.
    """
    nk = (vocab_size - 1) // 2
    nv = vocab_size - 1 - nk
    if num_pairs < 1 or num_pairs > nk:
        raise ValueError(f"num_pairs must be in [1, {nk}] for vocab_size={vocab_size}, got {num_pairs}")
    if seq_len < 4 * num_pairs:
        raise ValueError(f"seq_len must be >= 4 * num_pairs = {4 * num_pairs}, got {seq_len}")
    n = num_pairs
    slots = (seq_len - 2 * n) // 2
    tokens = np.zeros((batch_size, seq_len), np.int64)
    targets = np.full((batch_size, seq_len), IGNORE, np.int64)
    for b in range(batch_size):
        keys = rng.choice(nk, n, replace=False) + 1
        vals = rng.integers(0, nv, n) + nk + 1
        tokens[b, 0:2 * n:2], tokens[b, 1:2 * n:2] = keys, vals
        pos = 2 * n + 2 * np.sort(rng.choice(slots, n, replace=False))
        order = rng.permutation(n)
        tokens[b, pos], tokens[b, pos + 1] = keys[order], vals[order]
        targets[b, pos] = vals[order]
    return tokens, targets


# ---------------------------------------------------------------------------
# characters of the stdlib's docstrings and comments
# ---------------------------------------------------------------------------

#: The character vocabulary: newline, printable ASCII, and ``\x7f`` standing for anything else.
CHARS = "\n" + "".join(chr(c) for c in range(32, 127)) + "\x7f"
_LOOKUP = np.full(256, len(CHARS) - 1, np.int64)
_LOOKUP[[ord(c) for c in CHARS]] = np.arange(len(CHARS))


def encode(text):
    """Text -> int64 ids in ``[0, len(CHARS))`` (non-ASCII bytes map to the last id)."""
    return _LOOKUP[np.frombuffer(text.encode("utf-8"), np.uint8)]


def decode(ids):
    return "".join(CHARS[i] for i in np.asarray(ids).ravel())


def stdlib_files():
    """The standard library's top-level ``*.py`` files, sorted by name."""
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))


def extract_text(source):
    """Docstrings (module, class, function) and full-line ``#`` comments of a Python source.

    Comments are found by a line regex (tokenize is ~10x slower), so a line of
    a string literal that starts with ``#`` would count as a comment; inline
    comments after code are left out.
    """
    parts = []
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        tree = None
    if tree is not None:
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    parts.append(doc)
    comments = [c.strip() for c in _COMMENT.findall(source)]
    comments = [c for c in comments if c and not c.startswith("!")]
    if comments:
        parts.append("\n".join(comments))
    return "\n\n".join(parts)


_COMMENT = re.compile(r"^[ \t]*#+(.*)$", re.M)


@functools.lru_cache(maxsize=2)
def char_corpus(val_every=10):
    """``(train_ids, val_ids)``: encoded stdlib docstrings and comments.

    Deterministic split by file: the files at sorted positions ``i`` with
    ``i % val_every == val_every - 1`` form the validation set.
    """
    train, val = [], []
    for i, path in enumerate(stdlib_files()):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = extract_text(f.read())
        if text:
            (val if i % val_every == val_every - 1 else train).append(text)
    if not train or not val:
        raise RuntimeError(f"found no stdlib sources under {sysconfig.get_paths()['stdlib']!r}")
    return encode("\n\n".join(train)), encode("\n\n".join(val))


def char_batch(rng, ids, batch_size, seq_len):
    """Random windows: inputs ``ids[s:s+N]`` and next-character targets ``ids[s+1:s+N+1]``."""
    starts = rng.integers(0, len(ids) - seq_len - 1, batch_size)
    idx = starts[:, None] + np.arange(seq_len + 1)
    w = ids[idx]
    return w[:, :-1], w[:, 1:]


def char_eval_windows(ids, num_windows, seq_len):
    """``num_windows`` windows spread evenly over ``ids`` (deterministic): (inputs, targets)."""
    starts = np.linspace(0, len(ids) - seq_len - 1, num_windows).astype(np.int64)
    w = ids[starts[:, None] + np.arange(seq_len + 1)]
    return w[:, :-1], w[:, 1:]
