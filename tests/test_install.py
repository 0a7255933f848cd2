"""The package as it installs, not as the checkout imports it: the sdist and the wheel that
``python -m build`` makes (as .ci/run does) hold every module and the fused kernels' C sources,
their metadata requires the torch releases embcore was tested on, and the installed wheel, away
from the checkout, builds its kernels from its own sources and trains a step.

The wheel is installed with ``pip install --no-deps --target`` into a temporary folder and run
with that folder on ``PYTHONPATH`` (torch and numpy from this environment), from a folder
outside the checkout. The build runs without isolation (``--no-isolation``: no download), with the
``build`` and ``setuptools`` of the test extra.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from embcore.base import compat

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "embcore"


def test_ci_runs_every_install_command_of_the_readme():
    """Each ``pip install`` of README's commands is in .ci/run verbatim (there in a fresh venv,
    then ``pip check``), as is README's test command."""
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", readme, flags=re.S))
    commands = [line for line in blocks.splitlines() if line.startswith("python3 -m venv ")]
    assert len(commands) >= 2, commands
    ci_lines = [line.strip() for line in ci.splitlines()]
    missing = []
    for command in commands:
        steps = command.split(" && ")[2:]  # after the venv's creation and activation
        installs = " && ".join(s for s in steps if s.startswith("pip install"))
        assert installs, command
        if not any(line.startswith(installs) for line in ci_lines):
            missing.append(installs)
        rest = [s for s in steps if not s.startswith("pip install")]
        missing += [s for s in rest if s not in ci]
    assert not missing, f".ci/run does not run these README commands verbatim: {missing}"
    assert "python -m pytest" in ci_lines and "pip check" in ci_lines


# The Triton each tested torch's CUDA build requires (its metadata: torch 2.13.0 triton==3.7.1,
# torch 2.14.1 triton~=3.8.0), and the one a CPU venv gets (the newest the extra admits).
TORCH_S_TRITON = {"2.13": "3.7.1", "2.14": "3.8.0", "cpu": "3.9.0"}


def test_the_gpu_test_extra_leaves_triton_to_torch():
    """The gpu-test extra admits the Triton each tested torch requires, so that installing it
    never makes pip replace the user's torch (a pin such as triton==3.9.0 did, on torch 2.14)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    triton = [Requirement(r) for r in extras["gpu-test"] if Requirement(r).name == "triton"]
    assert len(triton) == 1, extras["gpu-test"]
    refused = {k: v for k, v in TORCH_S_TRITON.items() if not triton[0].specifier.contains(v)}
    assert not refused, f"the gpu-test extra ({triton[0]}) refuses the Triton of {refused}"


def _build_or_skip() -> None:
    pytest.importorskip("build",
                        reason="the build package is not installed (pip install -e '.[test]')")


def _shipped() -> set[str]:
    """The files under embcore/ that an install needs: every module and the kernels' sources."""
    files = {p for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    wanted = {p for p in files if p.suffix == ".py" or p.name == "py.typed"
              or p.parent.name == "csrc" and p.suffix in (".cpp", ".h")}
    return {p.relative_to(ROOT).as_posix() for p in wanted}


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The folder holding ``python -m build``'s sdist and wheel (the wheel built from the sdist)."""
    _build_or_skip()
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out),
                           str(ROOT)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"python -m build failed:\n{done.stdout}\n{done.stderr}"
    return out


def _one(dist: Path, pattern: str) -> Path:
    found = sorted(dist.glob(pattern))
    assert len(found) == 1, f"{pattern} in {dist}: {[p.name for p in dist.iterdir()]}"
    return found[0]


@pytest.mark.slow  # builds the sdist and the wheel
def test_the_sdist_and_the_wheel_hold_every_module_and_the_kernel_sources(dist):
    want = _shipped()
    assert any(name.endswith("csrc/kernels.cpp") for name in want)
    wheel = set(zipfile.ZipFile(_one(dist, "embcore-*.whl")).namelist())
    assert not want - wheel, f"the wheel lacks {sorted(want - wheel)}"
    with tarfile.open(_one(dist, "embcore-*.tar.gz")) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert not want - names, f"the sdist lacks {sorted(want - names)}"
    assert {"pyproject.toml", "README.md", "LICENSE", "packaging/fbgemm-gpu-cpu/pyproject.toml"} \
        <= names


@pytest.mark.slow
def test_the_wheel_requires_the_tested_torch(dist):
    """The wheel's metadata admits every torch release of compat.TESTED_TORCH and none outside."""
    with zipfile.ZipFile(_one(dist, "embcore-*.whl")) as wheel:
        meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        lines = wheel.read(meta).decode().splitlines()
    from packaging.requirements import Requirement  # (build's own dependency)

    requires = [Requirement(line.split(":", 1)[1]) for line in lines
                if line.startswith("Requires-Dist:")]
    torch_req = [r for r in requires if r.name == "torch"]
    assert len(torch_req) == 1 and torch_req[0].marker is None, torch_req
    (major, first), (_, last) = compat.TESTED_TORCH
    tested = [f"{major}.{m}.{p}" for m in range(first, last + 1) for p in (0, 1)]
    outside = [f"{major}.{first - 1}.1", f"{major}.{last + 1}.0"]
    spec = torch_req[0].specifier
    assert all(spec.contains(v) for v in tested), (spec, tested)
    assert not any(spec.contains(v) for v in outside), (spec, outside)
    extras = {str(r.marker): r for r in requires if r.marker is not None}
    assert any(r.name == "torchrec" for r in extras.values()), extras


SMOKE = """
import sys
from pathlib import Path

import torch

import embcore as ec
from embcore.kernels import cpu
from embcore.kernels.cpu import library

site = Path(sys.argv[1]).resolve()
assert Path(ec.__file__).resolve().is_relative_to(site), ec.__file__
assert library.CSRC.is_relative_to(site), library.CSRC
assert cpu.available(), cpu.error()  # compiled now, from the installed sources

table = ec.TableConfig(vocabulary_size=8, dim=4, name="t")
emb = ec.EmbeddingLayer({"f": ec.FeatureConfig(table=table)}, ec.SGD(learning_rate=0.5))
before = emb.embedding_tables["t"].detach().clone()  # (V, D)
out = emb({"f": torch.tensor([1, 2])})["f"]          # (B, D)
assert torch.equal(out.detach(), before[[1, 2]])
out.sum().backward()                                 # SGD: rows 1 and 2 move by -0.5
after = emb.embedding_tables["t"].detach()
assert torch.allclose(after[[1, 2]], before[[1, 2]] - 0.5)
assert torch.equal(after[[0, 3, 4, 5, 6, 7]], before[[0, 3, 4, 5, 6, 7]])
print("installed wheel ok")
"""


@pytest.mark.slow  # and compiles the kernels
def test_the_installed_wheel_builds_its_kernels_and_trains(dist, tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                           "--no-index", "--no-compile", "--target", str(site),
                           str(_one(dist, "embcore-*.whl"))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"pip install of the wheel failed:\n{done.stderr}"
    assert (site / "embcore" / "kernels" / "cpu" / "csrc" / "kernels.cpp").is_file()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBCORE_")}
    env["PYTHONPATH"] = str(site)               # the installed wheel, not the checkout
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # a fresh kernel cache: a real build
    work = tmp_path / "elsewhere"
    work.mkdir()
    done = subprocess.run([sys.executable, "-c", SMOKE, str(site)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "installed wheel ok" in done.stdout, (
        f"the installed wheel's smoke test failed:\n{done.stdout}\n{done.stderr}")
    assert any((tmp_path / "cache").rglob("*.so")), "no kernel library was built in the cache"
