"""First contact with the compiler (issue 57): one line on stderr when the kernels compile,
whichever entry point calls them; a cache every process of a user finds, also where the
package folder and HOME are read-only; and ``racecpu warmup`` covering what the torch, JAX
and autograd paths call."""

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import racecpu
from racecpu._kernels import _jit

LINE = "racecpu: compiling RACE kernels"

_NUMPY = """
import numpy as np, racecpu
x = np.random.default_rng(0).standard_normal((2, 300, 16)).astype(np.float32)
out, res = racecpu.race_attention_fwd(x, x, x, racecpu.hyperplanes(16, seed=0), causal=True)
racecpu.race_attention_bwd(res, np.ones_like(out))
print("ok", float(out.sum()))
"""

_TORCH = """
import torch, racecpu.torch as rt, racecpu
x = torch.randn(1, 2, 300, 16, requires_grad=True)
W = torch.as_tensor(racecpu.hyperplanes(16, seed=0))
rt.race_attention(x, x, x, W, causal=True).sum().backward()
print("ok", float(x.grad.abs().sum()))
"""

_JAX = """
import jax, jax.numpy as jnp, numpy as np, racecpu, racecpu.jax as rj
x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 2, 300, 16)).astype(np.float32))
W = jnp.asarray(racecpu.hyperplanes(16, seed=0))
step = jax.jit(jax.grad(lambda x: rj.race_attention(x, x, x, W, causal=True).sum()))
print("ok", float(jnp.abs(step(x)).sum()))
"""

_AUTOGRAD = """
import numpy as np, racecpu
from racecpu.autograd import Tensor, functional as F
x = Tensor(np.random.default_rng(0).standard_normal((2, 300, 16)).astype(np.float32), requires_grad=True)
W = racecpu.hyperplanes(16, seed=0)
F.race_attention(x, x, x, W, causal=True).sum().backward()
print("ok", float(np.abs(x.grad).sum()))
"""


def _env(**extra):
    """This process's environment with its racecpu first on the path (not one in the cwd)."""
    path = os.pathsep.join([str(Path(racecpu.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    env.pop("RACECPU_QUIET_COMPILE", None)
    env.update(extra)
    return env


def _run(code, env, cwd, user=None, timeout=900):
    kw = {}
    if user is not None:
        kw["user"], kw["group"], kw["extra_groups"] = user, user, []
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout, **kw)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ok" in r.stdout
    return r.stderr


def _lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith(LINE)]


def _cache_without_runners(dest):
    """A copy of this process's kernel cache at ``dest`` less the launchers of the parallel
    loop (runtime._launch, one per task and argument types): a process using it compiles those
    (a second or two), loads the rest."""
    src = _jit.cache_dir()
    if src is None or not any(Path(src).glob("*.nbi")):
        pytest.skip("no warm kernel cache in this process to copy")
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("runtime._launch-*"))


@pytest.mark.slow
@pytest.mark.parametrize("frontend", ["numpy", "torch", "jax", "autograd"])
def test_a_process_that_compiles_says_so_in_one_line_and_a_cached_one_says_nothing(frontend, tmp_path):
    if frontend in ("torch", "jax"):
        pytest.importorskip(frontend)
    code = {"numpy": _NUMPY, "torch": _TORCH, "jax": _JAX, "autograd": _AUTOGRAD}[frontend]
    cache = tmp_path / "cache"
    _cache_without_runners(cache / "racecpu" / _jit.cache_tag())
    env = _env(NUMBA_CACHE_DIR=str(cache))
    first = _run(code, env, tmp_path)
    lines = _lines(first)
    assert len(lines) == 1, first
    assert str(cache) in lines[0] and "float32" in lines[0]
    assert _lines(_run(code, env, tmp_path)) == []  # the second process loads what the first compiled
    for name in list((cache / "racecpu" / _jit.cache_tag()).glob("runtime._launch-*"))[:1]:
        name.unlink()
    assert _lines(_run(code, dict(env, RACECPU_QUIET_COMPILE="1"), tmp_path)) == []


@pytest.mark.slow
def test_warmup_covers_what_torch_jax_and_autograd_call(tmp_path):
    # racecpu warmup fills the shared cache (loads it, where the suite's warm-up ran); then a
    # torch step, a JAX jit + grad step (JAX hands read-only arrays) and an autograd step,
    # float32 and bfloat16, compile nothing.
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    if _jit.shared_cache_dir() is None:
        pytest.skip("no shared kernel cache")
    env = _env()
    r = subprocess.run([sys.executable, "-m", "racecpu", "warmup", "--quiet"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    half = _TORCH.replace("torch.randn(1, 2, 300, 16,", "torch.randn(1, 2, 300, 16, dtype=torch.bfloat16,")
    code = "\n".join(["exec(" + repr(c) + ")" for c in (_TORCH, half, _JAX, _AUTOGRAD, _NUMPY)])
    err = _run(code, env, tmp_path)
    assert _lines(err) == [], err


def _without_write_override():
    """The command prefix that runs a process of this user unable to write where the permission
    bits say no: nothing for a user other than root; for root, ``setpriv`` dropping the
    capabilities that override them (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH); None if root
    has no setpriv."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    return None if setpriv is None else [setpriv, "--bounding-set", "-dac_override,-dac_read_search", "--"]


def _read_only_tree(path):
    for dirpath, dirnames, files in os.walk(path):
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o444)
        os.chmod(dirpath, 0o555)


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX permissions")
def test_a_read_only_install_with_a_read_only_home_compiles_once_per_user(tmp_path):
    # A copy of the installed package and HOME are read-only (mode 0555; as root, the process runs
    # without the capabilities that override permission bits), NUMBA_CACHE_DIR and XDG_CACHE_HOME
    # unset: the cache goes to <tmp>/racecpu-<uid>/<tag>.  The first process compiles into it (the
    # parallel loops: the rest is copied in first, to keep this test to seconds) and the second
    # loads everything: no line, and the first result comes from the cache.
    prefix = _without_write_override()
    if prefix is None:
        pytest.skip("running as root without setpriv: cannot make a folder read-only to this process")
    root = tmp_path / "ro"
    home, tmp, site = root / "home", root / "tmp", root / "site"
    home.mkdir(parents=True)
    tmp.mkdir()
    tmp.chmod(0o1777)
    shutil.copytree(Path(racecpu.__file__).parent, site / "racecpu", ignore=shutil.ignore_patterns("__pycache__"))
    uid = _jit._user_id()
    private = tmp / f"racecpu-{uid}"
    _cache_without_runners(private / _jit.cache_tag())
    private.chmod(0o700)
    _read_only_tree(site)
    _read_only_tree(home)
    try:
        env = _env(HOME=str(home), TMPDIR=str(tmp))
        env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
        for var in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME"):
            env.pop(var, None)
        code = ("import time; t0 = time.perf_counter()\n" + _NUMPY
                + "import sys, racecpu; from racecpu._kernels._jit import cache_dir\n"
                  "print('package', racecpu.__file__, file=sys.stderr); print('dir', cache_dir(), file=sys.stderr)\n"
                  "print(f'first result {time.perf_counter() - t0:.2f} s', file=sys.stderr)")
        cmd = [*prefix, sys.executable, "-c", code]
        runs = []
        for _ in range(2):
            r = subprocess.run(cmd, cwd=home, env=env, capture_output=True, text=True, timeout=900)
            assert r.returncode == 0, r.stderr[-3000:]
            runs.append(r.stderr)
        first, second = runs
        assert f"package {site / 'racecpu'}" in first  # the read-only copy, not the install
        assert not (site / "racecpu" / "_kernels" / "__pycache__").exists()
        assert f"dir {private / _jit.cache_tag()}" in first
        assert len(_lines(first)) == 1, first
        assert any((private / _jit.cache_tag()).glob("runtime._run_tasks-*.nbc"))  # written by the first
        assert _lines(second) == [], second
        print(second.splitlines()[-1])  # the time to the first result (a benchmark, not asserted)
    finally:
        for dirpath, _, _ in os.walk(root):
            os.chmod(dirpath, 0o755)


def test_the_cache_is_the_first_writable_place_in_order(monkeypatch, tmp_path):
    monkeypatch.setattr(_jit.numba_config, "CACHE_DIR", str(tmp_path / "numba"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(_jit.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    tag = _jit.cache_tag()
    order = [tmp_path / "numba" / "racecpu", tmp_path / "xdg" / "racecpu", _jit._SOURCES / "__pycache__",
             tmp_path / "tmp" / f"racecpu-{_jit._user_id()}"]
    assert _jit.cache_candidates() == [p / tag for p in order]
    try:
        for i, want in enumerate(order):
            monkeypatch.setattr(_jit, "_writable", lambda p, ok=want: str(p).startswith(str(ok)))
            _jit.cache_dir.cache_clear()
            assert _jit.cache_dir() == str(want / tag), i
        monkeypatch.setattr(_jit, "_writable", lambda p: False)
        _jit.cache_dir.cache_clear()
        with pytest.warns(RuntimeWarning, match="no writable directory"):
            assert _jit.cache_dir() is None
    finally:
        _jit.cache_dir.cache_clear()


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes")
def test_a_temporary_cache_folder_others_can_write_is_not_used(monkeypatch, tmp_path):
    monkeypatch.setattr(_jit.tempfile, "gettempdir", lambda: str(tmp_path))
    root = tmp_path / f"racecpu-{_jit._user_id()}"
    assert _jit._private_temp_root() == root
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    root.chmod(0o777)  # a folder another user could plant pickles in
    assert _jit._private_temp_root() is None
    root.rmdir()
    root.symlink_to(tmp_path)  # or a link to somewhere else
    assert _jit._private_temp_root() is None


def test_a_new_tag_prunes_all_but_the_newest_folders(tmp_path):
    for i in range(_jit.KEPT_TAGS + 3):
        d = tmp_path / f"kernels-old{i}"
        d.mkdir()
        os.utime(d, (1000 + i, 1000 + i))
    (tmp_path / "unrelated").mkdir()
    _jit._prune_old_tags(tmp_path, "kernels-new")
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == sorted(["unrelated"] + [f"kernels-old{i}" for i in range(4, _jit.KEPT_TAGS + 3)])
