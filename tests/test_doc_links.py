"""Every relative markdown link in the docs, and every quoted section reference (`README "Versions"`,
`docs/engine.md "Check the engine on your machine"`) in the docs, the service configs, the manifests and the
Dockerfiles, points at a file that exists and, for an anchor or a section name, at one of its headings
(anchors by GitHub's slug rule; a section name may be the start of a heading, e.g. "Fifth pass" for
"Fifth pass (the idle p99 ...)")."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARKDOWN = sorted([REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("src/**/*.md"),
                   *REPO.glob("k8s/**/*.md"), *REPO.glob("results/*.md")])
REFERRING = MARKDOWN + sorted([*REPO.glob("src/**/*.py"), *REPO.glob("src/kvtier/configs/**/*.yaml"),
                               *REPO.glob("docker/Dockerfile*"),
                               *(p for p in REPO.glob("k8s/**/*.yaml") if "schemas" not in p.parts)])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# `README "X"`, `docs/engine.md, "X"`; the name may wrap onto the next line (of a comment, too)
REFERENCE = re.compile(r"\b(README(?:\.md)?|[\w./-]+\.md),?[ \t]+\"([^\"]{1,120})\"")


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def _prose(text: str) -> str:
    """Markdown without fenced code blocks and inline code (where brackets are code, not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _heading_text(line: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line.lstrip("#").strip().rstrip("#").strip())
    return text.replace("`", "")


@lru_cache(maxsize=None)
def headings(path: Path) -> tuple[str, ...]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return tuple(_heading_text(line) for line in text.splitlines() if re.match(r"#{1,6} ", line))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in headings(path):
        s = slug(h)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return frozenset(out)


def _target(source: Path, name: str) -> Path | None:
    if name in ("README", "README.md"):
        return REPO / "README.md"
    for base in (REPO, source.parent):          # references name repository paths; links are relative
        if (base / name).exists():
            return base / name
    return None


def test_slugs_follow_github():
    assert slug("Check the engine on your machine (kvtier engine check)") == \
        "check-the-engine-on-your-machine-kvtier-engine-check"
    assert slug("GPU deployments: the tested configurations") == "gpu-deployments-the-tested-configurations"
    assert slug("RL on compressed rollouts: a learner that replays each rollout's evictions") == \
        "rl-on-compressed-rollouts-a-learner-that-replays-each-rollouts-evictions"
    assert slug("`max_num_seqs: auto`".replace("`", "")) == "max_num_seqs-auto"


def broken_links(source: Path) -> list[str]:
    bad = []
    for target in LINK.findall(_prose(source.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve() if path else source
        if not resolved.exists():
            bad.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            bad.append(f"{target}: no heading #{anchor} in {_rel(resolved)}")
    return bad


def broken_references(source: Path) -> list[str]:
    bad = []
    for name, section in REFERENCE.findall(source.read_text()):
        section = " ".join(re.sub(r"\n\s*#*", " ", section).split())
        path = _target(source, name)
        if path is None:
            bad.append(f'{name} "{section}": no such file')
            continue
        want = section.lower()
        if not any(h.lower() == want or (h.lower().startswith(want) and not h[len(want)].isalnum())
                   for h in headings(path)):
            bad.append(f'{name} "{section}": no such heading in {_rel(path)}')
    return bad


def test_broken_links_and_references_are_caught(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text('# Here\n[ok](#here) [gone](#there) [none](missing.md)\n`[code](not-a-link)`\n'
                   '(README "GPU deployments") (docs/engine.md "GPU deployments") (docs/engine.md "Check the\n'
                   'engine on your machine") (README "Versions")\n')
    assert broken_links(doc) == [f"#there: no heading #there in {doc}", "missing.md: no such file"]
    assert broken_references(doc) == ['README "GPU deployments": no such heading in README.md']


@pytest.mark.parametrize("source", MARKDOWN, ids=_rel)
def test_relative_links_resolve(source):
    assert not broken_links(source), f"{_rel(source)}: {broken_links(source)}"


def test_quoted_section_references_resolve():
    bad = {_rel(s): b for s in REFERRING if (b := broken_references(s))}
    assert not bad, bad
