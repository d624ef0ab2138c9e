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


def test_plot_directives_draw_from_the_recorded_logs_and_name_a_bad_one():
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    from docs_plots import PlotError, expand
    page = expand("text\n<!-- plot: curves docs/bench-logs/smollm2/seed*-metrics.jsonl "
                  "eval/pass1 -->\nmore\n<!-- plot: bars docs/bench-logs/smollm2/e2e-trl.json "
                  "medians seconds_per_step -->\n")
    assert page.count('src="data:image/png;base64,') == 2 and "<!-- plot" not in page
    with pytest.raises(PlotError, match="no file matches"):
        expand("<!-- plot: curves docs/bench-logs/none*.jsonl eval/pass1 -->")
    with pytest.raises(PlotError, match="has no 'eval/nope'"):
        expand("<!-- plot: curves docs/bench-logs/smollm2/seed0-metrics.jsonl eval/nope -->")
    with pytest.raises(PlotError, match="no 'medianz'"):
        expand("<!-- plot: bars docs/bench-logs/smollm2/e2e-trl.json medianz x -->")
