"""The package's layout: importing the library loads no application."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Subpackages the core must never import: applications, the autograd library
#: built on the core, and the CUDA path (loaded on a device array's first call).
NOT_CORE = ("racecpu.apps", "racecpu.autograd", "racecpu.cuda")


def loaded_after(statement):
    """The racecpu modules a fresh interpreter holds after ``statement``, run from the repo root."""
    code = f"{statement}; import sys; print(sorted(m for m in sys.modules if m.startswith('racecpu')))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return ast.literal_eval(r.stdout.strip().splitlines()[-1])


def test_import_racecpu_loads_no_application():
    loaded = loaded_after("import racecpu")
    assert "racecpu.attention" in loaded
    assert [m for m in loaded if m.startswith(NOT_CORE)] == []


@pytest.mark.parametrize("module", ["racecpu.outofcore", "racecpu.cli"])
def test_other_core_modules_load_no_application(module):
    loaded = loaded_after(f"import {module}")
    assert [m for m in loaded if m.startswith(NOT_CORE)] == []


# ---------------------------------------------------------------------------
# the import graph
# ---------------------------------------------------------------------------

def _module_name(path):
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path, name):
    """racecpu modules that ``path`` (module ``name``) imports, at any depth of its code."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("racecpu"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("racecpu"):
                continue
            found.add(mod)
            for a in node.names:  # "from . import x" imports the submodule x
                found.add(f"{mod}.{a.name}")
    return found


def import_graph():
    """{module: racecpu modules it imports}, over every module of the package."""
    files = {_module_name(p): p for p in (ROOT / "racecpu").rglob("*.py")}
    graph = {}
    for name, path in files.items():
        # A module's ancestor packages are imported before it by Python itself:
        # ``from .. import config`` is an edge to racecpu.config, not to racecpu.
        ancestors = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}
        graph[name] = {m for m in _imports(path, name) if m in files and m != name and m not in ancestors}
    return graph


def test_the_import_graph_is_acyclic():
    # Every import counts, also one inside a function: a cycle broken only by
    # importing late is still a cycle for a reader.
    graph = import_graph()
    assert "racecpu._kernels.causal" in graph and "racecpu.attention" in graph
    state = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_leaf_layer_imports_nothing_above_it():
    graph = import_graph()
    assert graph["racecpu.config"] == set()
    above = {"racecpu.attention", "racecpu.hashing", "racecpu.streaming", "racecpu.outofcore", "racecpu._blocks",
             "racecpu.cuda", "racecpu.apps", "racecpu.autograd", "racecpu.engine", "racecpu.backend",
             "racecpu.plan", "racecpu.sketches", "racecpu.dask"}
    for leaf in ("racecpu._checks", "racecpu._kernels", "racecpu._memory"):
        deps = set().union(*(graph[m] for m in graph if m == leaf or m.startswith(leaf + ".")))
        assert not {d for d in deps if d.startswith(tuple(above))}, leaf


#: The modules outside racecpu/_kernels/ and racecpu/apps/ that import racecpu._kernels, and why
#: (docs/design.md, "Map of the engine"): the engine calls the kernels; the argument checks run the
#: parallel NaN/Inf count and the 16-bit conversions, and sit below the engine, which reports through them.
KERNEL_IMPORTERS = {"racecpu.engine": "calls the kernels",
                    "racecpu._checks": "the parallel NaN/Inf count and the 16-bit conversions of the checks"}


def _kernel_importers(graph):
    """The modules outside racecpu/_kernels/ and racecpu/apps/ that import any of racecpu._kernels."""
    def under(m, package):
        return m.split(".")[:2] == ["racecpu", package]
    return {m for m, deps in graph.items()
            if not (under(m, "_kernels") or under(m, "apps")) and any(under(d, "_kernels") for d in deps)}


def test_only_the_engine_and_the_checks_import_the_kernels():
    graph = import_graph()
    assert len(KERNEL_IMPORTERS) <= 2
    assert _kernel_importers(graph) <= set(KERNEL_IMPORTERS)
    assert "racecpu.engine" in _kernel_importers(graph)
    # the check sees an import where there is one
    graph["racecpu.sketches"] = graph["racecpu.sketches"] | {"racecpu._kernels.causal"}
    assert "racecpu.sketches" in _kernel_importers(graph)


def _private_imports():
    """``(module, line, imported from, name)`` of every ``from X import _name`` of a racecpu
    module X where ``_name`` is not a module (dunder names aside)."""
    files = {_module_name(p): p for p in (ROOT / "racecpu").rglob("*.py")}
    found = []
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")
                mod = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("racecpu"):
                continue
            for a in node.names:
                private = a.name.startswith("_") and not a.name.startswith("__")
                if private and f"{mod}.{a.name}" not in files:
                    found.append((name, node.lineno, mod, a.name))
    return found


def test_no_module_imports_another_modules_private_names():
    # a name with a leading underscore is its module's own business; a private *module*
    # (racecpu._kernels, racecpu._checks) is the package's, and may be imported within it
    assert _private_imports() == []


def test_no_backend_is_picked_by_a_module_name():
    # dispatch goes by what an array is (racecpu.backend.backend_for), never by the name of the
    # module its type lives in
    hits = []
    for path in (ROOT / "racecpu").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "__module__":
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert hits == []


# ---------------------------------------------------------------------------
# no process-wide side effects
# ---------------------------------------------------------------------------

def test_import_changes_nothing_outside_racecpu():
    code = """
import os, sys, warnings
import numba, numpy, scipy, llvmlite, threadpoolctl  # their own import-time effects are theirs
import numba.np.ufunc.parallel as parallel
env, filters = dict(os.environ), list(warnings.filters)
import racecpu
assert dict(os.environ) == env, "environment changed"
assert warnings.filters == filters, "warning filters changed"
assert not parallel._is_initialized, "threads started at import"
x = numpy.ones((1, 600, 8), numpy.float32)
racecpu.race_attention(x, x, x, racecpu.hyperplanes(8), causal=True)
assert dict(os.environ) == env, "environment changed by a call"
assert "OMP_WAIT_POLICY" not in os.environ
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={k: v for k, v in __import__("os").environ.items() if k != "OMP_WAIT_POLICY"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr


def test_import_works_without_the_resource_module():
    # Windows has no 'resource'; racecpu imports and computes without it.
    code = ("import sys; sys.modules['resource'] = None\n"
            "import numpy as np, racecpu\n"
            "x = np.ones((1, 8, 4)); racecpu.race_attention(x, x, x, racecpu.hyperplanes(4)); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr


def test_threads_context_manager_restores_the_count():
    import numba
    import racecpu
    before = numba.get_num_threads()
    with racecpu.threads(1):
        assert numba.get_num_threads() == 1
    assert numba.get_num_threads() == before
    with pytest.raises(ValueError, match="NUMBA_NUM_THREADS"):
        racecpu.set_threads(0)
    with pytest.raises(ValueError):
        racecpu.set_threads(numba.config.NUMBA_NUM_THREADS + 1)


# ---------------------------------------------------------------------------
# the kernels' cache
# ---------------------------------------------------------------------------

def test_cache_stamp_covers_every_kernel_source_and_config(tmp_path, monkeypatch):
    from racecpu._kernels import _jit
    pkg = tmp_path / "racecpu"
    (pkg / "_kernels").mkdir(parents=True)
    for f in (ROOT / "racecpu" / "_kernels").glob("*.py"):
        (pkg / "_kernels" / f.name).write_text(f.read_text())
    (pkg / "config.py").write_text((ROOT / "racecpu" / "config.py").read_text())
    monkeypatch.setattr(_jit, "_SOURCES", pkg / "_kernels")
    stamps = []
    for edit in (None, "_kernels/tiles.py", "config.py", "_kernels/products.py"):
        if edit:
            with open(pkg / edit, "a") as fh:
                fh.write("\n# edited\n")
        _jit.source_digest.cache_clear()
        stamps.append(_jit.source_digest())
    _jit.source_digest.cache_clear()
    assert len(set(stamps)) == len(stamps)


@pytest.mark.slow
def test_import_and_a_call_work_with_an_unwritable_cache_and_recompile_a_corrupt_one(tmp_path):
    import os
    cache = tmp_path / "cache"
    cache.mkdir()
    code = ("import numpy as np, racecpu\n"
            "x = np.ones((1, 8, 4)); y = racecpu.race_attention(x, x, x, racecpu.hyperplanes(4))\n"
            "print('ok', float(y.sum()))")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    first = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stderr
    entries = list(cache.rglob("*.nbc"))
    assert entries, "nothing was cached"
    # Damaged entries are compiled again and overwritten, not fatal.  Those of the parallel
    # runner, which every call loads (the rest would compile everything again, ~1 min), and of
    # combine_rows, which the tasks call through its symbol (racecpu._kernels._link): their
    # cached callers then run the copy this process compiles.
    damaged = [f for f in entries if "_run_tasks" in f.name or "combine_rows-" in f.name]
    assert any("combine_rows-" in f.name for f in damaged), sorted(f.name for f in entries)
    assert any("_run_tasks" in f.name for f in damaged), sorted(f.name for f in entries)
    for f in damaged:
        f.write_bytes(b"not a pickle")
    again = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env=env)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split() == first.stdout.split()
    assert all(f.read_bytes() != b"not a pickle" for f in damaged), "a damaged entry was not compiled again"


def test_the_public_api_is_typed():
    # py.typed promises type checkers annotated signatures: every public
    # function and method says what each parameter takes and what it returns.
    import importlib.resources
    import inspect

    import racecpu
    from racecpu import sketches

    assert importlib.resources.files("racecpu").joinpath("py.typed").is_file()
    functions = [getattr(racecpu, name) for name in racecpu.__all__ if inspect.isfunction(getattr(racecpu, name))]
    functions += [getattr(sketches, name) for name in ("readout_bwd", "sketch_bwd", "causal_block",
                                                       "causal_block_bwd", "causal_block_dstate")]
    for cls in (racecpu.RaceState, racecpu.RaceAttention):
        functions += [f for name, f in vars(cls).items() if inspect.isfunction(f) and not name.startswith("_")
                      or name in ("__init__", "__call__")]
        functions += [f.__func__ for f in vars(cls).values() if isinstance(f, classmethod)]
    assert len(functions) > 20
    missing = []
    for f in functions:
        sig = inspect.signature(f, eval_str=True)  # the annotations also evaluate
        missing += [f"{f.__qualname__}({p})" for p in sig.parameters.values()
                    if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
        if sig.return_annotation is inspect.Signature.empty and f.__name__ not in ("__init__", "threads"):
            missing.append(f"{f.__qualname__} -> ?")
    assert missing == []
