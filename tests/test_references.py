"""The project cites only what it contains or what anyone can look up.

- Every `*.md` name in the code, tests, recipes, examples, benchmarks and docs is a file of this repository (relative to
  the citing file or to the repository root), and a link's `#anchor` is a heading of that file.
- Every section sign is attached to a source: on the same line, shortly before it and with no other section sign in
  between, an arXiv id (`arXiv 2604.06159 <section>`) or a file of this repository (a wrapped line continues the
  line before it); or it follows an attached section sign in a list (`<section> 3.4, <section> 3.6`).

This file itself is not scanned: its self-test quotes counterexamples.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ["trl_isopo", "tests", "recipes", "examples", "benchmarks", "docs", "README.md"]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".sh"}
SECTION = "\u00a7"
URL = re.compile(r"[a-z]+://\S+")
MD_REF = re.compile(r"(?<![\w./-])((?:\.{1,2}/|[\w-]+/)*[\w.-]*[\w-]\.md)(#[\w-]+)?")
ARXIV = re.compile(r"\b\d{4}\.\d{4,5}(?:v\d+)?\b")
FILE_REF = re.compile(r"(?<![\w./-])((?:\.{1,2}/|[\w-]+/)*[\w.-]+\.(?:md|py|yaml|yml|json|jsonl|txt|png))\b")
ATTACH_WINDOW = 40  # characters from the end of a source to its section sign
# between two section signs of a list: "3.4, ", "3.4-3.6 and ", '2.0.2 "Its title" and ', "2, v4 " (paper versions)
CHAIN = re.compile(r'[\w.\-\u2013]*\s*(?:"[^"]*"\s*)?(?:,|;|/|and|or|-|\u2013)?\s*(?:v\d+\s*)?')


def scanned_files() -> list[Path]:
    files = []
    for entry in SCANNED:
        path = ROOT / entry
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        files += [p for p in candidates if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts]
    return [p for p in files if p != Path(__file__).resolve()]


def resolve(ref: str, citing: Path) -> Path | None:
    """The repository file `ref` names, relative to the citing file's folder or to the root; None if none."""
    for base in (citing.parent, ROOT):
        target = (base / ref).resolve()
        if target.is_file() and target.is_relative_to(ROOT):
            return target
    return None


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def heading_anchors(md: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings (lowercase, punctuation dropped, spaces to '-', repeats -1...)."""
    anchors, seen, fenced = set(), {}, False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def lines_of(path: Path):
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        yield number, URL.sub("", line)


def md_reference_problems(path: Path) -> list[str]:
    problems = []
    for number, line in lines_of(path):
        for match in MD_REF.finditer(line):
            ref, anchor = match.group(1), match.group(2)
            target = resolve(ref, path)
            where = f"{shown(path)}:{number}: {ref}{anchor or ''}"
            if target is None:
                problems.append(f"{where} (no such file in the repository)")
            elif anchor and anchor[1:] not in heading_anchors(target):
                problems.append(f"{where} (no such heading in {shown(target)})")
        if path.suffix == ".md":  # links to a heading of the same page
            for anchor in re.findall(r"\]\(#([\w-]+)\)", line):
                if anchor not in heading_anchors(path):
                    problems.append(f"{shown(path)}:{number}: #{anchor} (no such heading)")
    return problems


def section_problems(path: Path) -> list[str]:
    problems, previous = [], ""
    for number, line in lines_of(path):
        # A wrapped line continues the previous one: its source may end that line.
        text = previous.rstrip() + " " + line.lstrip(" \t#*>-")
        start_of_line = len(previous.rstrip()) + 1
        previous = line
        sources = [m.end() for m in ARXIV.finditer(text)]
        sources += [m.end() for m in FILE_REF.finditer(text) if resolve(m.group(1), path) is not None]
        attached_end = None  # end of the last attached section sign: the next one may follow it in a list
        previous_end = 0  # a source attaches only to the first section sign after it
        for match in re.finditer(SECTION, text):
            near_source = any(previous_end <= end <= match.start() <= end + ATTACH_WINDOW for end in sources)
            previous_end = match.end()
            in_list = attached_end is not None and CHAIN.fullmatch(text[attached_end : match.start()])
            if near_source or in_list:
                attached_end = match.end()
            else:
                attached_end = None
                if match.start() >= start_of_line:
                    problems.append(f"{shown(path)}:{number}: {line.strip()[:100]}")
    return problems


@pytest.mark.parametrize("check", [md_reference_problems, section_problems], ids=["md-files", "sections"])
def test_references_resolve(check):
    problems = [p for path in scanned_files() for p in check(path)]
    assert not problems, f"{len(problems)} reference(s) to nothing in this repository:\n" + "\n".join(problems)


def test_the_checks_catch_what_they_guard(tmp_path):
    """Each rule rejects its counterexamples and accepts its examples (in a file outside the repository, whose
    references resolve against the repository root)."""
    sample = tmp_path / "sample.md"
    sample.write_text(
        "# A page\n"
        "[ok](docs/isopo.md) and [bad](docs/no-such-page.md) and [gone](docs/isopo.md#no-such-heading)\n"
        "[here](#a-page) and [nowhere](#no-heading); https://example.org/x.md is a link, not a file\n"
        f"arXiv 2604.06159 {SECTION}3.4, {SECTION}3.6 are fine; the spec {SECTION}5 is not\n"
        f"docs/isopo.md {SECTION}2 is fine, and so is arXiv 2512.23353,\n{SECTION}2.0.2 on a wrapped line\n",
        encoding="utf-8",
    )
    assert [p.split(": ", 1)[1] for p in md_reference_problems(sample)] == [
        "docs/no-such-page.md (no such file in the repository)",
        "docs/isopo.md#no-such-heading (no such heading in docs/isopo.md)",
        "#no-heading (no such heading)",
    ]
    (problem,) = section_problems(sample)
    assert problem.startswith("sample.md:4:")
