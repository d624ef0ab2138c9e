"""No module of rollwise imports one that imports it back (directly or around a loop), counting
deferred and TYPE_CHECKING imports too: a cycle is what makes an import order matter."""

from __future__ import annotations

import importlib.util

from tests.doc_examples import ROOT

spec = importlib.util.spec_from_file_location("code_counts", ROOT / "scripts/code_counts.py")
counts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(counts)


def _cycles(root):
    return counts.cycles(counts.import_edges(counts.modules(root))[0])


def test_no_module_import_cycle():
    assert _cycles(ROOT) == []


def test_a_cycle_is_found_even_through_a_deferred_type_only_import(tmp_path):
    pkg = tmp_path / "rollwise"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from rollwise.b import g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from rollwise.c import h\n")
    (pkg / "c.py").write_text("def h():\n    from rollwise import a\n")
    assert _cycles(tmp_path) == [["rollwise.a", "rollwise.b", "rollwise.c"]]
