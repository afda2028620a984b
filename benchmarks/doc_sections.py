"""Marked sections of a generated markdown page, owned by different benchmarks.

A section is the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` (markers
included, each on its own line). ``benchmarks/scale.py`` writes its section of
``docs/performance.md`` with :func:`replace_section`; ``benchmarks/runtime.py``, which renders
the rest of that page, carries the sections it does not own over with :func:`keep_sections`.
"""

from __future__ import annotations

import re

__all__ = ["begin_marker", "end_marker", "keep_sections", "replace_section", "section"]

_BEGIN = re.compile(r"^<!-- ([\w.-]+):begin -->$", re.MULTILINE)


def begin_marker(name: str) -> str:
    """The line opening section ``name``."""
    return f"<!-- {name}:begin -->"


def end_marker(name: str) -> str:
    """The line closing section ``name``."""
    return f"<!-- {name}:end -->"


def section(text: str, name: str) -> str | None:
    """Section ``name`` of ``text``, markers included, or ``None`` when ``text`` lacks either marker
    (or the end comes before the begin)."""
    start = text.find(begin_marker(name))
    if start < 0:
        return None
    end = text.find(end_marker(name), start)
    if end < 0:
        return None
    return text[start : end + len(end_marker(name))]


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with section ``name`` holding ``body``.

    Args:
        text: the page (may be empty).
        name: the section's name (letters, digits, ``_``, ``.``, ``-``).
        body: the markdown between the markers; a trailing newline is added when missing.

    Returns:
        The page with the old section (markers included) replaced, or with the section appended
        after a blank line when the page had none. Text outside the section is unchanged.
    """
    block = f"{begin_marker(name)}\n{body.rstrip(chr(10))}\n{end_marker(name)}"
    old = section(text, name)
    if old is not None:
        return text.replace(old, block, 1)
    head = text.rstrip("\n")
    return (head + "\n\n" if head else "") + block + "\n"


def keep_sections(new_text: str, old_text: str) -> str:
    """``new_text`` plus every section of ``old_text`` that ``new_text`` lacks, appended in their
    order in ``old_text``: a page renderer that rewrites the whole file keeps the sections other
    benchmarks own."""
    out = new_text
    for match in _BEGIN.finditer(old_text):
        name = match.group(1)
        if section(out, name) is None:
            kept = section(old_text, name)
            if kept is not None:
                out = out.rstrip("\n") + "\n\n" + kept + "\n"
    return out
