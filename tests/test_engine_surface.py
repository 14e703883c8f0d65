"""The version gate and the private surface (engine/versions.py, engine/surface.py, engine/fingerprints.py), in
whichever supported vLLM this environment has (0.31 in .venv, 0.32 in .venv-vllm032; `make test` runs both):

* the installed release is a tested one and its recorded fingerprints equal its sources, so a patch release
  with the same sources would pass and one with a changed function is refused naming it;
* unknown minors, pre-releases and dev builds are refused naming the version and the newest supported one;
* every compat.py helper is declared in surface.PRIVATE_STATE, and the counts docs/engine.md reports are
  the ones the script computes.
"""

import inspect
import re
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtier.engine import compat, surface, versions  # noqa: E402
from kvtier.engine.fingerprints import RECORDED  # noqa: E402
from kvtier.engine.plugin import check_vllm_version  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "engine.md"


def test_the_installed_vllm_is_a_tested_release_with_its_recorded_fingerprints():
    minor = check_vllm_version()
    assert versions.installed() == versions.TESTED[minor]
    now = surface.fingerprints(minor)
    assert set(now) <= set(RECORDED[minor]) and "missing" not in now.values()
    assert versions.changed_functions(RECORDED[minor], now) == []


def test_a_patch_release_with_unchanged_private_functions_is_accepted():
    minor = versions.installed_minor()
    patch = versions.TESTED[minor].rsplit(".", 1)[0] + ".7"
    assert versions.check(patch, surface.fingerprints) == minor
    assert versions.check(versions.TESTED[minor] + "+cu130", surface.fingerprints) == minor


def test_a_patch_release_with_a_changed_private_function_is_refused_naming_it():
    minor = versions.installed_minor()
    target = "vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots"

    def changed(m):
        return {**surface.fingerprints(m), target: "0" * 16}

    with pytest.raises(versions.VLLMVersionError, match=re.escape(target)) as err:
        versions.check(versions.TESTED[minor].rsplit(".", 1)[0] + ".1", changed)
    assert "patch release" in str(err.value)


@pytest.mark.parametrize("version", ["0.33.0", "0.30.2", "1.0.0", "0.32.0rc1", "0.31.1.dev5+gabc", "nonsense"])
def test_other_versions_are_refused_naming_the_version_and_the_newest_supported(version):
    def never(_):
        raise AssertionError("no fingerprints are read for an unsupported minor")

    with pytest.raises(versions.VLLMVersionError) as err:
        versions.check(version, never)
    assert f"found vLLM {version}" in str(err.value) and f"newest supported: {versions.NEWEST}" in str(err.value)


def test_the_tested_releases_are_the_gpu_tables_and_the_default_environments():
    assert set(versions.GPU_BUILDS) <= set(versions.TESTED.values())
    assert versions.DEFAULT in versions.TESTED.values() and versions.NEWEST == max(versions.TESTED.values())
    assert set(RECORDED) == set(versions.TESTED)
    from kvtier.engine.allowlist import TESTED, markdown

    row = next(r for r in TESTED if r.setting == "vLLM release")
    assert row.check(None) is None and all(v in markdown() for v in versions.TESTED.values())


def test_every_compat_helper_declares_the_private_state_it_touches():
    homes = {compat.__name__, "kvtier.engine.compat_serve"}   # compat.py re-exports compat_serve's helpers
    helpers = {f"compat.{name}" for name, fn in inspect.getmembers(compat, inspect.isfunction)
               if fn.__module__ in homes and not name.startswith("_")}
    assert "compat.stat_loggers" in helpers and "compat.truncate_request_blocks" in helpers
    for minor in versions.TESTED:
        assert helpers - set(surface.PRIVATE_STATE[minor]) == set(), minor
        assert all(re.fullmatch(r"\w+\.\w+", a) for a in surface.attributes(minor)), minor
    assert surface.attributes("0.32") < surface.attributes("0.31")   # 0.32 no longer splits rows into kernel blocks


def test_docs_report_the_counts_the_script_computes():
    text = DOCS.read_text()
    for minor in versions.TESTED:
        c = surface.counts(minor)
        row = re.search(rf"^\| {re.escape(minor)} \|([^\n]*)$", text, re.M)
        assert row, f"docs/engine.md has no private-surface row for vLLM {minor}"
        cells = [x.strip() for x in row.group(1).split("|") if x.strip()]
        assert cells[:5] == [str(c["functions_wrapped"]), str(c["underscore_functions_wrapped"]),
                             str(c["functions_relied_on"]), str(c["private_attributes_before_62"]),
                             str(c["private_attributes"])], (minor, cells, c)


def test_the_gpu_image_names_the_vllm_release_it_is_built_for():
    dockerfile = (DOCS.parents[1] / "docker" / "Dockerfile").read_text()
    label = re.search(r'^LABEL io\.kvtier\.vllm="([^"]+)"', dockerfile, re.M)
    assert label and label.group(1) == versions.DEFAULT and versions.DEFAULT in versions.GPU_BUILDS
    assert "docker/Dockerfile" in versions.GPU_BUILDS[versions.DEFAULT]
