"""MkDocs hooks for the documentation site (mkdocs.yml names this file).

Three pages are generated at build time so that they cannot drift from their sources: index.md
from README.md, benchmarks/index.md from BENCHMARKS.md and changelog.md from CHANGELOG.md,
their links rewritten from the repository's root to the site's. The configuration reference,
docs/reference/config.md, is written from the config classes by `python3 scripts/docs_hooks.py`
(kept as a file so that it reads on GitHub too; tests/test_docs_site.py fails when it is
stale, as for
configs/default.yaml).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent


def on_page_markdown(markdown, page, config, files):
    """Plot directives (scripts/docs_plots.py) drawn from the recorded logs."""
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    from docs_plots import expand
    return expand(markdown)


def on_page_content(html, page, config, files):
    """Inline code without a space (a key, a value, a command word) marked `ident`, which the
    stylesheet keeps on one line: a browser would otherwise break it at a hyphen or mid-word
    in a narrow table column."""
    return re.sub(r"<code>([^<\s]+)</code>", r'<code class="ident">\1</code>', html)


def on_files(files, config):
    pages = {
        "index.md": _from_root("README.md", ""),
        "benchmarks/index.md": _from_root("BENCHMARKS.md", "../"),
        "changelog.md": _from_root("CHANGELOG.md", ""),
    }
    for uri, text in pages.items():
        files.append(File.generated(config, uri, content=text))
    return files


def _from_root(name: str, up: str) -> str:
    """A root document as a site page: `docs/x.md` links become site links; the root's own
    documents map to their generated pages."""
    text = (ROOT / name).read_text()
    here = "benchmarks/" if up else ""

    def link(m: re.Match) -> str:
        target = m.group(1)
        if target.startswith("docs/"):
            target = target[len("docs/"):]
            if here and target.startswith(here):
                target = target[len(here):]
            else:
                target = up + target
        elif target == "BENCHMARKS.md":
            target = ("" if here else "benchmarks/") + "index.md"
        elif target == "README.md":
            target = up + "index.md"
        elif target == "CHANGELOG.md":
            target = up + "changelog.md"
        return f"]({target})"

    return re.sub(r"\]\(([^)#\s]+(?:#[^)\s]*)?)\)", link, text)


def config_reference() -> str:
    """Every config key with its default and description, a table per section."""
    from rollwise.config import Config

    cfg = Config()
    out = ["# Configuration reference", "",
           "Every key, its default and what it does, generated from the config classes "
           "(`rollwise/config.py`). Set a key in a YAML file given with `--config`, on the "
           "command line as `section.key=value`, or in Python as "
           "`rollwise.train(section={\"key\": value})`. `rollwise config show` prints a "
           "resolved config the same way.", ""]
    for name, field in type(cfg).model_fields.items():
        section = getattr(cfg, name)
        about = _one_line(field.description or type(section).__doc__)
        out += [f"## {name}", "", *([about, ""] if about else []),
                "| key | default | what it does |", "|---|---|---|"]
        out += [f"| `{key}` | `{value}` | {about} |" for key, value, about in _rows(section, name)]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _rows(section, prefix: str):
    from pydantic import BaseModel

    for name, field in type(section).model_fields.items():
        value, key = getattr(section, name), f"{prefix}.{name}"
        if isinstance(value, BaseModel):
            yield from _rows(value, key)
            continue
        flow = yaml.safe_dump([value], default_flow_style=True, width=10**6).strip()[1:-1]
        if isinstance(value, str) and "\n" in value:  # one table line: escaped, double-quoted
            flow = json.dumps(value)
        yield key, flow.replace("|", "\\|"), _one_line(field.description).replace("|", "\\|")


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


if __name__ == "__main__":
    (ROOT / "docs/reference/config.md").write_text(config_reference())
    print("wrote docs/reference/config.md")
