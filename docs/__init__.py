"""The documentation site's tools (not part of the package): ``python -m docs.regenerate`` rewrites the CLI output
the pages show from real runs; ``sphinx_roles`` is the griffe extension mkdocstrings loads (mkdocs.yml)."""
