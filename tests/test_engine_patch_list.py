"""engine/patches.py lists every change kvtier makes to vLLM; the wrappers live in one module per seam
(patch_frontend, patch_scheduler, patch_kv_cache, patch_worker, patch_shm). Each listed target resolves
in the pinned vLLM and says why."""

import importlib
import inspect


def test_every_patch_is_listed_resolves_and_lives_in_its_seam_module():
    from kvtier.engine import patches

    seams = {"patch_frontend", "patch_scheduler", "patch_kv_cache", "patch_worker", "patch_shm"}
    listed = {p.make for p in patches.PATCHES} | {patches.ATTENTION_CAPTURE.make}
    for p in patches.PATCHES:
        owner, name = patches._resolve(p.target)
        assert hasattr(owner, name), p.target
        assert len(p.why) > 40, p.target
        assert p.make.__module__.rsplit(".", 1)[1] in seams, (p.target, p.make.__module__)
    # every wrapper factory a seam module defines (a function taking `orig`) is in the list
    for seam in seams:
        mod = importlib.import_module(f"kvtier.engine.{seam}")
        for fn_name, fn in inspect.getmembers(mod, inspect.isfunction):
            if fn.__module__ == mod.__name__ and list(inspect.signature(fn).parameters) == ["orig"]:
                assert fn in listed, f"{seam}.{fn_name} wraps vLLM but is not listed in engine/patches.py"
