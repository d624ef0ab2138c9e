"""rollwise's version: one place, read by the package metadata (pyproject.toml) and the CLI."""

__version__ = "0.2.0"
