"""The site's generated pages (scripts/docs_hooks.py): the configuration reference holds every
key of the config with its default, and the README's and BENCHMARKS.md's links land on pages
that exist once rewritten for the site."""

from __future__ import annotations

import importlib.util
import re

import pytest
import yaml

from rollwise.config import Config, defaults_yaml
from tests.doc_examples import ROOT

spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts/docs_hooks.py")
hooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hooks)


def _leaves(node: dict, prefix: str = ""):
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and not all(isinstance(k, int) for k in value) \
                and key not in ("tiers", "gym", "reward"):
            yield from _leaves(value, dotted + ".")
        else:
            yield dotted, value


def test_config_reference_has_every_key_with_its_default():
    page = (ROOT / "docs/reference/config.md").read_text()
    assert page == hooks.config_reference(), \
        "docs/reference/config.md is stale: python3 scripts/docs_hooks.py writes it again"
    rows = dict(re.findall(r"^\| `([\w.]+)` \| `(.*?)` \|", page, re.M))
    defaults = dict(_leaves(yaml.safe_load(defaults_yaml())))
    assert set(rows) == set(defaults)
    for key, value in defaults.items():
        assert yaml.safe_load(rows[key].replace("\\|", "|")) == value, key
    assert f"## {next(iter(Config.model_fields))}" in page


@pytest.mark.parametrize("name, up", [("README.md", ""), ("BENCHMARKS.md", "../")])
def test_root_documents_link_to_pages_that_exist(name, up):
    page = hooks._from_root(name, up)
    here = ROOT / "docs" / ("benchmarks" if up else "")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", page)
    assert links
    for target in links:
        assert not target.startswith("docs/"), target
        if not target.startswith("http") and target not in (
                "index.md", "benchmarks/index.md", "changelog.md"):  # generated pages
            assert (here / target).resolve().is_file(), target
