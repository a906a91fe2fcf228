"""The user-facing text (README, docs/, examples/) links only inside the repository, to files that
exist, and speaks to users: no vocabulary of the machine time that produced past measurements
(leases, carries, numbered device calls, run ordinals such as "tenth lease")."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.py")])

LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"  # [text](target "title")
                  r"|^\s*\[[^\]]+\]:\s*<?(\S+?)>?\s*$", re.MULTILINE)  # [label]: target
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, ...
ORDINAL = (r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
           r"fourteenth|fifteenth|\d+(?:st|nd|rd|th))")
FORBIDDEN = {
    "lease": re.compile(r"\bleases?\b", re.IGNORECASE),
    "carry": re.compile(r"\bcarr(?:y|ies)\b", re.IGNORECASE),
    "call N": re.compile(r"\bcalls? [0-9]+\b", re.IGNORECASE),
    "run ordinal": re.compile(rf"\b{ORDINAL}[ -](?:lease|run|session)s?\b", re.IGNORECASE),
}


def links(text: str) -> list[str]:
    return [a or b for a, b in LINK.findall(text)]


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, -1, -2 for repeats."""
    seen: dict[str, int] = {}
    fenced = False
    for line in markdown.splitlines():
        fenced ^= line.lstrip().startswith("```")
        if fenced or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def broken_links(path: Path) -> list[str]:
    """Relative links that leave the repository, name a missing file, or a missing heading of a page."""
    bad = []
    for target in links(path.read_text(encoding="utf-8")):
        if EXTERNAL.match(target):
            continue
        file, _, anchor = target.partition("#")
        resolved = path if not file else (ROOT / file.lstrip("/")) if file.startswith("/") else (path.parent / file)
        resolved = resolved.resolve()
        if not resolved.is_relative_to(ROOT):
            bad.append(f"{target} (leaves the repository)")
        elif not resolved.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text(encoding="utf-8")):
            bad.append(f"{target} (no such heading)")
    return bad


def forbidden_words(path: Path) -> list[str]:
    hits = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for what, pattern in FORBIDDEN.items():
            hits += [f"line {number}: {m.group(0)!r} ({what})" for m in pattern.finditer(line)]
    return hits


def test_the_scan_sees_the_user_files():
    names = {str(p.relative_to(ROOT)) for p in FILES}
    assert {"README.md", "docs/README.md", "docs/design.md", "examples/generate.py"} <= names


def test_the_index_lists_every_page_and_example():
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in links(index.read_text(encoding="utf-8"))}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md") if p.name != "README.md"}
    examples = {p.resolve() for p in (ROOT / "examples").glob("*.py")}
    assert sorted(str(p.relative_to(ROOT)) for p in (pages | examples) - linked) == []


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_inside_the_repository_and_resolve(path):
    assert broken_links(path) == [], f"{path.relative_to(ROOT)}: fix or remove these links"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_vocabulary_of_past_machine_time(path):
    assert forbidden_words(path) == [], f"{path.relative_to(ROOT)}: say what was measured, not how it was run"


def test_the_checks_catch_what_they_look_for(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    (tmp_path / "docs" / "here.md").write_text("# Top\n```\n# not a heading\n```\n## 6. The turnstile (cross-rank)\n")
    page.write_text("[ok](here.md#top) [out](../../outside/NOTES.md) [gone](missing.md) [web](https://x.org/a)\n"
                    "[s](here.md#6-the-turnstile-cross-rank) [no](here.md#not-a-heading) [self](#ref)\n"
                    "[ref]: ../here.md\nIn the tenth lease, call 4 carried the wheel; the second run and Tenth-session."
                    "\nThe carry and the leases.\n")
    assert broken_links(page) == ["../../outside/NOTES.md (leaves the repository)", "missing.md (no such file)",
                                  "here.md#not-a-heading (no such heading)", "#ref (no such heading)",
                                  "../here.md (no such file)"]
    kinds = [hit.rsplit("(", 1)[1] for hit in forbidden_words(page)]
    assert kinds == ["lease)", "call N)", "run ordinal)", "run ordinal)", "run ordinal)", "lease)", "carry)"]
