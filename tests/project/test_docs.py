"""Every code reference in docs/design.md and docs/serving.md resolves: `path.py` names a file of the repository,
`path.py:Name` a class or function defined at its top level, `path.py:Class.method` a method
of that class. A rename that forgets the page fails here. And every figure of README.md names the
doc section whose command reproduces it (the rule: the docstring of the test that checks it)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REF = re.compile(r"`([\w/]+\.py)(?::([\w.]+))?`")


def references(doc: str) -> list[tuple[str, str | None]]:
    return sorted(set(REF.findall((ROOT / doc).read_text())))


def defined(path: Path) -> set[str]:
    """Top-level classes and functions, and Class.method for every method."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{f.name}" for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


CHECKED = ("docs/design.md", "docs/serving.md")


@pytest.mark.parametrize("doc, path, name", [(d, *r) for d in CHECKED for r in references(d)])
def test_design_doc_reference_resolves(doc, path, name):
    file = ROOT / path
    assert file.is_file(), f"{doc} names {path}, which does not exist"
    if name:
        assert name in defined(file), f"{doc} names {path}:{name}, which {path} does not define"


def test_the_design_doc_names_code_at_all():
    assert len(references("docs/design.md")) >= 20


# ---- README figures -------------------------------------------------------------------------------
FIGURE = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*(?:-\d+(?:[.,]\d+)*)?(?:x\b|\s?(?:tok/s|tokens/s|ms|s|%)(?![\w/]))"
                    r"|τ\s?\d+(?:\.\d+)?")
DOC_PATH = re.compile(r"[\w./-]+\.md")
AFTER_PATH = re.compile(r'#([\w-]+)|(?:\]\([^)]*\)|\))?,?\s*"([^"]+)"')
CODE_SPAN = re.compile(r"`[^`\n]+`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
CLAUSE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(\[*])|;\s+")
COMMAND = re.compile(r"(?:^|[\s`(])(?:python3? -[mc]\s|(?:\.venv/bin/)?tercel\s|(?:\.venv/bin/)?train-drafter\s"
                     r"|make\s|(?:bash\s)?bench/\w+\.sh)", re.M)
# Settings, not measurements: each phrase as README writes it -> where it is set.
SETTINGS = {
    "every 5 s": "health_check_period_s of the replicas (serving/cluster/replicas.py)",
    "10% faster": "ThreadConfig.margin, 0.9 (spec/threads.py)",
    "≥ 99%": "GATE_AGREEMENT, the quality gate (bench/quality.py)",
    "must be 100%": "the parse rate bench structured requires (bench/structured.py, module docstring)",
}


def prose_blocks(text: str) -> list[str]:
    """Paragraphs, list items and table rows, each on one line; code blocks and headings left out."""
    blocks, current, fenced = [], [], False
    for line in text.splitlines():
        fence = line.lstrip().startswith("```")
        fenced ^= fence
        skipped = fence or fenced or not line.strip() or line.startswith("#")
        if current and (skipped or line.startswith(("|", "- ", "* "))):     # the block so far ends
            blocks.append(" ".join(current))
            current = []
        if skipped:
            continue
        if line.startswith("|"):
            blocks.append(line)
        else:
            current.append(line.strip())
    return blocks + ([" ".join(current)] if current else [])


def clauses(block: str) -> list[str]:
    """Sentences cut at semicolons; a semicolon inside a code span cuts nothing."""
    masked = CODE_SPAN.sub(lambda m: m.group(0).replace(";", "\0"), block)
    return [c.replace("\0", ";") for c in CLAUSE_END.split(masked)]


def figures(clause: str) -> list[str]:
    """The figures of one clause, outside code spans, link targets and SETTINGS."""
    text = LINK_TARGET.sub("]", CODE_SPAN.sub(" ", clause))
    for phrase in SETTINGS:
        text = text.replace(phrase, " ")
    return [m.group(0) for m in FIGURE.finditer(text)]


def section_refs(clause: str) -> list[tuple[str, str | None, bool]]:
    """(path, anchor or heading or None, is_anchor) for each Markdown file the clause names."""
    refs = []
    for m in DOC_PATH.finditer(clause):
        after = AFTER_PATH.match(clause, m.end())
        name = after and (after.group(1) or after.group(2))
        refs.append((m.group(0), name, bool(after and after.group(1))))
    return refs


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(text: str) -> list[tuple[int, int, str]]:
    """(line index, level, text) of each heading outside fenced code."""
    found, fenced = [], False
    for i, line in enumerate(text.splitlines()):
        fenced ^= line.lstrip().startswith("```")
        m = None if fenced else re.match(r"(#+)\s+(.*)", line)
        if m:
            found.append((i, len(m.group(1)), m.group(2).strip()))
    return found


def section(path: str, name: str | None, is_anchor: bool) -> str | None:
    """The text of the named section of path, or None where there is no such section."""
    file = ROOT / path
    if name is None or not file.is_file():
        return None
    text = file.read_text()
    lines, heads = text.splitlines(), headings(text)
    for n, (start, level, title) in enumerate(heads):
        if (slug(title) == name) if is_anchor else title.startswith(name):
            end = next((i for i, lv, _ in heads[n + 1:] if lv <= level), len(lines))
            return "\n".join(lines[start:end])
    return None


def has_command(text: str) -> bool:
    """A command in a code span, a fenced block or an indented line of the text."""
    fenced = re.findall(r"```.*?```", text, re.S)
    code = CODE_SPAN.findall(text) + fenced + re.findall(r"^ {4,}\S.*$", text, re.M)
    return any(COMMAND.search(c.strip("`")) for c in code)


def why_not(path: str, name: str | None, text: str | None) -> str:
    if name is None:
        return f"{path} with no section named"
    return f"{path} {name!r}: " + ("no such section" if text is None else "no command in it")


def unreproduced(readme: str) -> list[str]:
    """Each figure whose clause names no section holding a command, with why."""
    problems = []
    for block in prose_blocks(readme):
        for clause in clauses(block):
            found = figures(clause)
            refs = section_refs(clause) if found else []
            texts = [section(*r) for r in refs]
            if found and not any(t is not None and has_command(t) for t in texts):
                why = "; ".join(why_not(p, n, t) for (p, n, _), t in zip(refs, texts)) or "names no doc section"
                problems.append(f"{', '.join(found)} in {clause[:90]!r}...: {why}")
    return problems


def test_every_readme_figure_names_the_section_with_its_command():
    """Every figure README.md states names the doc section whose command reproduces it.

    A figure is a measured quantity in the README's prose: a number directly followed by `x` (a
    speedup: `3.2x`, `6-8x`), or followed, with or without a space, by `tok/s`, `tokens/s`, `ms`, `s`
    or `%`, or `τ` followed by a number (`τ 1.49`). Not figures: anything inside a fenced code block or
    a code span (commands, versions, flags), link targets, and the phrases in SETTINGS (a period or a
    threshold that the code sets, not a measurement).

    Each figure's clause (its sentence, within one paragraph, list item or table row, cut at
    semicolons outside code spans) must name a section of a Markdown file of the repository, as
    `path.md#anchor` or as `path.md, "Heading"` (the heading's text or its beginning), and that
    section, down to the next heading of its level or above, must hold a command in code: a code span,
    a fenced block or an indented line that runs `python -m`/`python -c`, `tercel`, `train-drafter`,
    `make` or a script under bench/. One such section in the clause covers all its figures."""
    problems = unreproduced((ROOT / "README.md").read_text())
    assert not problems, "README figures without a reproducing section:\n" + "\n".join(problems)


def test_the_rule_finds_figures_and_their_sections():
    """On text made for it: a referenced figure passes, an unreferenced one, a reference to a
    missing section and figures in code are told apart."""
    good = 'It ran 3.2x faster (docs/performance.md, "A quantized draft").'
    assert figures(good) == ["3.2x"] and not unreproduced(good)
    assert figures("τ 1.49, 80% and 1.5 s; `--threads 2` and torch 2.13 are not.") == ["τ 1.49", "80%", "1.5 s"]
    assert "names no doc section" in unreproduced("Loads take 1.5 s.")[0]
    assert "no such section" in unreproduced('Loads take 1.5 s (docs/performance.md, "Nowhere").')[0]
    assert "with no section named" in unreproduced("Loads take 1.5 s (docs/performance.md).")[0]
    assert figures("x; `a; b` 2 ms") == ["2 ms"] and len(clauses("a 2 ms; b 3 ms. C `d; e`")) == 3
    readme = (ROOT / "README.md").read_text()
    assert any(figures(c) for b in prose_blocks(readme) for c in clauses(b))     # the README's are read


def test_every_setting_phrase_is_in_the_readme():
    """SETTINGS leaves out only phrases README still has."""
    readme = (ROOT / "README.md").read_text()
    assert [p for p in SETTINGS if p not in readme] == []
