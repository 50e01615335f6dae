"""MkDocs hooks of racecpu's documentation site (wired in mkdocs.yml, ``hooks:``).

racecpu's docstrings are NumPy style with Sphinx cross-reference roles
(``:func:`racecpu.hyperplanes```, ``:mod:`racecpu.cuda```, ``:class:``,
``:meth:``, ``:data:``, ``:attr:``...).  mkdocstrings renders the backquoted
part as a code span and leaves the role in front of it as text, so a page
would read ``:func:racecpu.hyperplanes``.  :func:`on_page_content` drops the
role and keeps the code span (and drops Sphinx's ``~`` "show the last name
only" marker inside it), on every page and therefore in the search index too;
a role shown verbatim (inside a parameter's type) is reduced to its target.
It also shows reStructuredText's ``::`` before a code block as Sphinx does.
"""

from __future__ import annotations

import re

#: Sphinx's Python-domain roles, with or without the ``py:`` domain.
ROLES = ("func", "mod", "class", "meth", "data", "attr", "obj", "exc", "const", "type")

_NAMES = "|".join(ROLES)

#: A role as text right before the code span that renders its target, with Sphinx's ``~``
#: ("show the last name only") at the start of that target: ``:mod:`~racecpu.x``` is ``racecpu.x`` here.
_ROLE_CODE = re.compile(r":(?:py:)?(?:%s):<code>~?" % _NAMES)

#: A role as text right before a link (a cross-reference that was resolved).
_ROLE_LINK = re.compile(r":(?:py:)?(?:%s):(?=<a\s)" % _NAMES)

#: A role left as written, backquotes and all: where the docstring's text was not Markdown
#: (a parameter's type is shown verbatim in a code span, e.g. ``ops : :class:`ArrayOps```).
_ROLE_RAW = re.compile(r":(?:py:)?(?:%s):`~?([^`<>]*)`" % _NAMES)

#: An inline code span (not a code block) that shows reST's double backquotes verbatim: a
#: parameter's type or default, e.g. ``beta : float, default ``DEFAULT_BETA````.
_RAW_LITERAL = re.compile(r"(?<!<pre>)<code>([^<]*``[^<]*)</code>")

#: reStructuredText's literal-block marker: a paragraph ending in ``::`` before a code block
#: (Sphinx shows ``text::`` as ``text:`` and drops a ``::`` that stands alone).
_LITERAL_MARK = re.compile(r"(\s?)::(</p>\s*<pre)")


def strip_roles(html: str) -> str:
    """``html`` without the text of Sphinx roles in front of code spans and links, with
    roles left verbatim reduced to their target, and without reST's double backquotes
    inside inline code spans."""
    html = _ROLE_LINK.sub("", _ROLE_CODE.sub("<code>", html))
    html = _ROLE_RAW.sub(r"\1", html)
    return _RAW_LITERAL.sub(lambda m: "<code>" + m.group(1).replace("``", "") + "</code>", html)


def strip_literal_marks(html: str) -> str:
    """``html`` with reST's ``::`` before code blocks shown as Sphinx shows it."""
    return _LITERAL_MARK.sub(lambda m: ("" if m.group(1) else ":") + m.group(2), html)


def on_page_content(html, page, config, files):  # noqa: ARG001 - MkDocs' hook signature
    return strip_literal_marks(strip_roles(html))
