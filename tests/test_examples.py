"""The character-LM examples (examples/torch_char_lm.py, examples/jax_char_lm.py) train at a tiny size."""

import importlib.util
import pathlib

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _periodic_batch(rng, vocab, batch, n):
    """Period-3 sequences over 8 of the symbols: a few steps take the loss from log(vocab) towards log(8)."""
    base = rng.integers(0, 8, (batch, 3)) * (vocab // 8)
    w = np.tile(base, (1, (n + 1) // 3 + 1))[:, :n + 1]
    return w[:, :-1], w[:, 1:]


def _train_and_check(mod, baseline, get_beta, steps=12):
    """Trains a race and a baseline model a few steps; returns {attention: (model, losses)}."""
    from racecpu.apps.tasks import char_corpus, char_eval_windows

    rng = np.random.default_rng(0)
    batches = [_periodic_batch(rng, mod.VOCAB, 4, 32) for _ in range(steps)]
    _, val_ids = char_corpus()
    windows = char_eval_windows(val_ids, 2, 32)
    losses = {}
    for att in ("race", baseline):
        model = mod.build_model(att, mod.VOCAB, d_model=16, n_heads=2, n_layers=1, seq_len=32, seed=0)
        # evaluate() is in bits per character: an untrained model is near uniform, log2(97) = 6.6
        assert abs(mod.evaluate(model, windows) - np.log2(mod.VOCAB)) < 0.3, att
        beta0 = get_beta(model) if att == "race" else None
        step = mod.make_step(model, lr=1e-2)
        losses[att] = np.array([step(x, y) for x, y in batches])
        if att == "race":
            # beta is a trained parameter of racecpu's op: its gradient reached it
            assert get_beta(model) != beta0
        assert np.all(np.isfinite(losses[att])), att
        # the first loss is about log(vocab) = 4.57 nats; a dozen AdamW steps take off over a nat
        assert abs(losses[att][0] - np.log(mod.VOCAB)) < 0.5, (att, losses[att][0])
        assert losses[att][-3:].mean() < losses[att][0] - 1.0, (att, losses[att])
        assert np.isfinite(mod.evaluate(model, windows)), att
    # the attention is the only difference: the two differ (RACE is not the baseline) but learn alike
    assert not np.allclose(losses["race"], losses[baseline])


def test_torch_char_lm_race_and_sdpa_train():
    pytest.importorskip("torch")
    from racecpu.apps.tasks import char_corpus

    mod = _load("torch_char_lm")
    _train_and_check(mod, "sdpa", lambda m: m.blocks[0].race.beta.item())
    # train(), as main() and the benchmark call it, on the corpus with a step budget
    model = mod.build_model("race", mod.VOCAB, d_model=16, n_heads=2, n_layers=1, seq_len=32)
    res = mod.train(model, char_corpus()[0], seq_len=32, batch_size=2, steps=3, log=None)
    assert res["steps"] == 3 and len(res["losses"]) == 3 and res["step_ms"] > 0


@pytest.mark.slow
def test_jax_char_lm_race_and_softmax_train():
    pytest.importorskip("jax")
    mod = _load("jax_char_lm")
    _train_and_check(mod, "softmax", lambda m: float(m.params["blocks"][0]["beta"]))
