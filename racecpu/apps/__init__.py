"""Applications built on racecpu; the library itself never imports them.

Each is a ``racecpu`` subcommand (a module exposing ``add_arguments(parser)``
and ``run(args)``) or a script:

* :mod:`.bench` -- ``racecpu bench``: the benchmark suite (roofline model,
  NumPy/torch peer statements of RACE, one child process per measurement);
* :mod:`.cuda_bench` -- ``python -m racecpu.apps.cuda_bench``: the GPU benchmark;
* :mod:`.demo` -- ``racecpu demo``: RACE at a million tokens, checked against
  exact references; ``--out-of-core`` runs :mod:`.ooc_demo`;
* :mod:`.ooc_demo` -- the out-of-core demo and its seeded input streams
  (:class:`~racecpu.apps.ooc_demo.SeededArray`);
* :mod:`.train`, :mod:`.tasks` -- ``racecpu train``: small Transformers in
  pure NumPy (:mod:`racecpu.autograd`) on offline tasks;
* :mod:`.validation` -- ``racecpu validate``: RACE against the angular kernel
  and Theorem 1.

Importing this package imports none of them.
"""
