"""A griffe extension for mkdocstrings: the package's docstrings use Sphinx roles (:func:`~fsdp_optim.x`), which
Markdown would print as they are. Each role becomes an *optional* cross-reference (autorefs' ``<autoref ...
optional>``): a link where the target is rendered in the docs, plain code where it is not, never a warning (so
``mkdocs build --strict`` stays clean while docstrings name modules the pages do not render). A public name
(``fsdp_optim.load_checkpoint``) is resolved to the module that defines it, where the API page renders it.
"""

from __future__ import annotations

import html
import re
from typing import Any

from griffe import Extension, Object

from fsdp_optim import _HOME

ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|data|attr|exc|obj|const):`(?P<body>[^`]+)`")
TITLED = re.compile(r"(?P<title>.+?)\s*<(?P<target>[^>]+)>$")


def target_of(name: str, scope: str, package: str) -> str:
    """The identifier a role names, as the docs' anchors spell it: ``scope`` is where a bare name is looked up
    (the docstring's module or class), ``package`` where a relative one (``.rank_file``) is."""
    if name.startswith("."):
        return f"{package}.{name.lstrip('.')}"
    head, _, tail = name.partition(".")
    if head == "fsdp_optim" and tail.split(".")[0] in _HOME:
        public, _, rest = tail.partition(".")
        return ".".join(filter(None, ["fsdp_optim", _HOME[public], public, rest]))
    if "." in name:  # a full path (ours, torch's): as written
        return name
    return f"{scope}.{name}"


def replace_roles(text: str, scope: str, package: str) -> str:
    """``text`` with every Sphinx role made an optional autoref, and reST's ``::`` literal marker made ``:``."""

    def one(match: re.Match[str]) -> str:
        body = match["body"]
        titled = TITLED.match(body)
        if titled:
            title, name = titled["title"], titled["target"]
        else:
            name = body.lstrip("~")
            title = name.rsplit(".", 1)[-1] if body.startswith("~") else name
        identifier = html.escape(target_of(name, scope, package), quote=True)
        return f'<autoref identifier="{identifier}" optional><code>{html.escape(title)}</code></autoref>'

    text = ROLE.sub(one, text)
    return re.sub(r"(\S)::\n", r"\1:\n", text)


class SphinxRoles(Extension):
    """Rewrites every docstring's roles once it is loaded."""

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:  # noqa: ARG002 - griffe passes its agent too
        if obj.docstring is None:
            return
        scope = obj.path if obj.is_module or obj.is_class or obj.parent is None else obj.parent.path
        module = obj.module
        package = module.path if module.is_package else module.path.rsplit(".", 1)[0]
        obj.docstring.value = replace_roles(obj.docstring.value, scope, package)
