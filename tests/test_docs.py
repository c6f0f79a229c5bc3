"""Every code reference in docs/design.md and docs/serving.md resolves: `path.py` names a file of the repository,
`path.py:Name` a class or function defined at its top level, `path.py:Class.method` a method
of that class. A rename that forgets the page fails here."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
