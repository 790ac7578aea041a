"""Every reference to a page or section of the manual resolves.

The convention: code, configs and cluster files refer to the manual as `docs/<page>.md` or
`docs/<page>.md#<anchor>`; Markdown files link with relative links, `[text](page.md#anchor)`. A referenced file
must exist, and an anchor must be one that GitHub generates for a heading of that file. The old style, a section
of the top-level README named in quotes (`see README "Performance"`), is refused in the package and the presets:
the README is no longer where the manual lives. Links to http(s) URLs are not checked.
"""

from __future__ import annotations

import re
from collections import Counter
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# `docs/<page>.md` or `docs/<page>.md#<anchor>`, anywhere in a file (comments, strings, docstrings, Markdown).
DOC_REFERENCE = re.compile(r"(?<![\w/.-])(docs/[\w.-]+\.md)(?:#([\w-]+))?")
# Markdown links and images: [text](target "title"), and reference definitions: [label]: target
MD_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
MD_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
FENCE = re.compile(r"^ {0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
# The top-level README as the manual: README "Section", README's "Section", README: Section, README.md#anchor,
# (see README). Not README.md as a file name (raydiff.export writes a README.md model card into its folders).
OLD_STYLE = re.compile(r"\bREADME(?:\.md)?(?:'s)?\s*[,:]?\s*[\"“][A-Z]|\bREADME(?:\.md)?#|\bREADME:\s*[A-Z]"
                       r"|\bsee (?:the )?(?:top-level )?README\b(?!\.md of)")


def _without_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            lines.append((number, line))
    return lines


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading's text: links reduced to their text, lowercase, every character other
    than a letter, digit, space, hyphen or underscore dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading anchor of a Markdown file; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: Counter[str] = Counter()
    found = set()
    for _, line in _without_fences(path.read_text(encoding="utf-8")):
        heading = HEADING.match(line)
        if heading:
            anchor = github_anchor(heading.group(2))
            found.add(f"{anchor}-{seen[anchor]}" if seen[anchor] else anchor)
            seen[anchor] += 1
    return frozenset(found)


def references(path: Path) -> list[tuple[int, Path, str | None, str]]:
    """(line, target file, anchor or None, the reference as written) for every reference in a file."""
    text = path.read_text(encoding="utf-8", errors="replace")
    markdown = path.suffix == ".md"
    lines = _without_fences(text) if markdown else list(enumerate(text.splitlines(), 1))
    found = []
    for number, line in lines:
        for match in DOC_REFERENCE.finditer(line):
            found.append((number, ROOT / match.group(1), match.group(2), match.group(0)))
        if not markdown:
            continue
        prose = CODE_SPAN.sub("", line)
        for target in [*MD_LINK.findall(prose), *MD_DEFINITION.findall(prose)]:
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http(s), mailto: not checked
                continue
            file, _, anchor = target.partition("#")
            found.append((number, (path.parent / file).resolve() if file else path, anchor or None, target))
    return found


def scanned_files() -> list[Path]:
    files = [*sorted((ROOT / "raydiff").rglob("*.py")), *sorted((ROOT / "configs").glob("*.yaml")),
             ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "pyproject.toml"]
    for folder in ("cluster", ".ci"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return [p for p in files if p.is_file()]


def problem(target: Path, anchor: str | None) -> str | None:
    if not target.exists():
        return f"no such file ({target.relative_to(ROOT) if target.is_relative_to(ROOT) else target})"
    if anchor is None:
        return None
    if target.suffix != ".md" or not target.is_file():
        return "an anchor into a file that is not a Markdown page"
    if anchor not in anchors(target):
        return f"no heading of {target.name} has the anchor #{anchor}"
    return None


def test_every_reference_to_a_doc_or_section_resolves():
    broken = []
    for path in scanned_files():
        for line, target, anchor, written in references(path):
            why = problem(target, anchor)
            if why:
                broken.append(f"{path.relative_to(ROOT)}:{line}: {written}: {why}")
    assert broken == [], "\n".join(broken)


def test_the_package_and_presets_refer_to_the_manual_not_to_readme_sections():
    old = []
    for path in [*sorted((ROOT / "raydiff").rglob("*.py")), *sorted((ROOT / "configs").glob("*.yaml"))]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if OLD_STYLE.search(line):
                old.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert old == [], "refer to docs/<page>.md#<anchor> instead:\n" + "\n".join(old)


def test_the_checks_see_what_they_look_for(tmp_path):
    """The rules on made-up files (a check that finds nothing passes everything)."""
    assert github_anchor("How `cifar10` differs from the paper") == "how-cifar10-differs-from-the-paper"
    assert github_anchor("Resume, failures and elastic training") == "resume-failures-and-elastic-training"
    assert github_anchor("AWS and Google Cloud (Ray cluster launcher)") == "aws-and-google-cloud-ray-cluster-launcher"
    assert github_anchor("[Data](data.md) & `data.cache`_x") == "data--datacache_x"
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n## Usage\n\n```bash\n# not a heading\n```\n\n## Usage\n\n## Usage ##\n"
                    "See [it](#usage-1), [that](other.md#top), [web](https://example.com/x.md#y) and\n"
                    "`[code](nowhere.md)` and docs/configuration.md#train.\n\n[def]: page.md#usage-2\n")
    assert anchors(page) == {"page", "usage", "usage-1", "usage-2"}
    found = [(line, target, anchor) for line, target, anchor, _ in references(page)]
    assert found == [(12, page, "usage-1"), (12, tmp_path / "other.md", "top"),
                     (13, ROOT / "docs" / "configuration.md", "train"), (15, page, "usage-2")]
    assert problem(tmp_path / "other.md", "top").startswith("no such file")
    assert problem(page, "missing") is not None and problem(page, "usage-2") is None
    code = tmp_path / "code.py"
    code.write_text('# see docs/configuration.md#nowhere and docs/training.md\nx = "docs/data.md#sources."\n')
    assert [(line, anchor) for line, _, anchor, _ in references(code)] == [(1, "nowhere"), (1, None), (2, "sources")]
    for old in ('(see README "Performance")', 'README.md, "Training"', "see README's \"Measuring quality\"",
                "README: Performance", "README.md#training", "(see README)"):
        assert OLD_STYLE.search(old), old
    for fine in ('(folder / "README.md").write_text(card)', '"""README.md of an exported folder: a model card."""',
                 "and a README model card", "see {out / 'README.md'}"):
        assert not OLD_STYLE.search(fine), fine
