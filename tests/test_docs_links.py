"""The docs' links and section references resolve (issue 54): fast, no model, no jax.

* every relative markdown link in README.md and docs/**/*.md points to an existing file, and to an
  existing heading of that file where it carries a `#anchor` (GitHub's slugs);
* every "results.md §X" (also "`docs/results.md` §X", "results §X", and the lists "§X, §Y" /
  "§X to §Y" after one) in the repository's *.md and *.py files names a heading of docs/results.md
  that starts with that section number ("## 2c. ..." for §2c, "### 2c-4. ..." for §2c-4). A
  reference into an old version ("`git show 4157bb8:docs/results.md` §2d", "the old results §2d",
  kept in docs/notes) is not checked.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results.md"
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "runs", "build", "dist", "__pycache__",
             ".pytest_cache", "shared"}

LINK = re.compile(r"(?<!!)\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
SECTION = r"§\s*([0-9][0-9a-z]*(?:-[0-9]+)?)"
RESULTS_REF = re.compile(r"results(?:\.md)?`?\)?\s*" + SECTION)
MORE_REFS = re.compile(r"\s*(?:,|/|and|to|or)\s*" + SECTION)
OLD_VERSION = re.compile(r"[0-9a-f]{7,40}:(?:docs/)?$")


def _walk(suffix: str):
    """The repository's files ending in suffix, outside virtual environments, run folders, etc."""
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for f in sorted(files):
            if f.endswith(suffix):
                yield Path(top) / f


def doc_files() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def _outside_code(text: str) -> str:
    """The text with fenced code blocks and inline code spans blanked (links there are not links)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group(0)), line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but '-' and '_'
    removed, each space a '-'."""
    s = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    s = s.replace("`", "").strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def headings(path: Path) -> list[str]:
    out, fenced = [], False
    for line in path.read_text(encoding="utf-8").split("\n"):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            out.append(m.group(2))
    return out


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in headings(path):
        s = slug(h)
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


def section_numbers() -> set[str]:
    out = set()
    for h in headings(RESULTS):
        m = re.match(r"([0-9][0-9a-z]*(?:-[0-9]+)?)\.?\s", h)
        if m:
            out.add(m.group(1))
    return out


def broken_links(path: Path) -> list[str]:
    text = _outside_code(path.read_text(encoding="utf-8"))
    bad = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
            continue  # http:, https:, mailto: ...
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part).resolve()
        line = text.count("\n", 0, m.start()) + 1
        where = f"{path.relative_to(ROOT)}:{line}: {target}"
        if not dest.exists():
            bad.append(f"{where} (no such file)")
        elif anchor and dest.is_file() and dest.suffix == ".md" and anchor.lower() not in anchors(dest):
            bad.append(f"{where} (no heading with that anchor in {dest.relative_to(ROOT)})")
    return bad


def results_refs(text: str):
    """(section, offset) of every results.md § reference in text, lists included."""
    for m in RESULTS_REF.finditer(text):
        before = text[max(0, m.start() - 60):m.start()]
        if OLD_VERSION.search(before) or re.search(r"\bold\s+$", before):
            continue  # a section of an old version, kept in docs/notes
        yield m.group(1), m.start()
        end = m.end()
        while (more := MORE_REFS.match(text, end)):
            yield more.group(1), more.start(1)
            end = more.end()


def test_slug_matches_github():
    assert slug("2c-4. A drafted answer, the whole prompt's budget") == \
        "2c-4-a-drafted-answer-the-whole-prompts-budget"
    assert slug("Question-aware MaskAhead (`maskahead-qa`; ours, issue 40)") == \
        "question-aware-maskahead-maskahead-qa-ours-issue-40"


def test_results_refs_parse():
    refs = [s for s, _ in results_refs("see `docs/results.md` §2c, §2c-2 and §3b; results §4 "
                                       "but not `git show 4157bb8:docs/results.md` §2d "
                                       "nor the old results §2b")]
    assert refs == ["2c", "2c-2", "3b", "4"]


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert not broken_links(path), "\n".join(broken_links(path))


def test_results_section_references_resolve():
    sections = section_numbers()
    assert {"1", "2", "2c", "3", "4"} <= sections
    bad = []
    for suffix in (".md", ".py"):
        for path in _walk(suffix):
            text = path.read_text(encoding="utf-8", errors="replace")
            for sec, at in results_refs(text):
                if sec not in sections:
                    line = text.count("\n", 0, at) + 1
                    bad.append(f"{path.relative_to(ROOT)}:{line}: results.md §{sec}")
    assert not bad, "no such section in docs/results.md:\n" + "\n".join(bad)
