"""vLLM general plugin entry point (`vllm.general_plugins` -> `kvtier = kvtier.engine.plugin:register`).

vLLM loads it in every process (frontend, engine core, workers). It checks the vLLM version (versions.check:
a tested release, or a patch release of a supported minor whose private functions kvtier touches are
unchanged; anything else is refused by name) and installs the patches; they stay inert unless an engine is
configured with additional_config["kvtier"].
"""

from __future__ import annotations

from .patches import install
from .surface import fingerprints
from .versions import VLLMVersionError, check, installed

__all__ = ["VLLMVersionError", "check_vllm_version", "register"]


def check_vllm_version() -> str:
    """The supported minor the installed vLLM runs as; VLLMVersionError naming why not."""
    return check(installed(), fingerprints)


def register() -> None:
    check_vllm_version()
    install()
