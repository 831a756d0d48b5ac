"""Find one release's entry in a changelog (pure, no I/O).

`changelog_entry(text, version)` returns the section as the maintainers wrote
it, heading stripped. Headings it knows: Markdown (`## 1.2.0`,
`## [1.2.0] - 2024-01-01`, `### v1.2 (date)`), reST titles over an underline
(and overline) of `=-~^*+#"'.:_` (`1.2.0 (2024-01-01)`, `Version 1.2.0`,
`attrs 1.2.0 (date)` as towncrier writes it, `` `v1.2.0 <url>`__ `` links)
and unmarked, unindented lines
that hold only a version and a date (`v1.2.0`, `1.2.0 - 2024-01-01`).
Without such a heading, a bullet per release (`- 1.2.0: Fix tabs.`, more
lines indented under it) is read too. Versions compare by `packaging` (`1.2`
is `1.2.0`). Not understood: Sphinx
`:release:` bullet lists and towncrier fragment directories.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator

from packaging.version import InvalidVersion, Version

_VERSION = r"v?(?P<v>\d+(?:\.\d+)+(?:[-._]?(?:a|b|rc|alpha|beta|post|dev|c)\.?\d*)*)"
_HEAD = re.compile(
    r"^\s*(?:[*_]{2})?\[?(?:(?:version|release|changes\s+in|changes\s+for|what's\s+new\s+in)\s+"
    r"|[A-Za-z][\w.-]*\s+(?=v?\d))?\[?" + _VERSION + r"\]?(?:[*_]{2})?(?P<rest>.*)$", re.I)
_DATEISH = re.compile(
    r"^\s*(?:[-–—:,]\s*)?(?:\(?\s*(?:\d{4}[-/.]\d{1,2}[-/.]\d{1,2}|\d{1,2}\s+\w+\.?\s+\d{4}"
    r"|\w+\.?\s+\d{1,2}(?:st|nd|rd|th)?,?\s+\d{4}|unreleased|not\s+released\s*\w*|released.*"
    r"|tbd|in\s+development|\d{4})\s*\)?)?\s*:?\s*$", re.I)
_UNDERLINE = re.compile(r"^\s*([=\-~^*+#\"'`.:_])\1{2,}\s*$")
_MD_HEAD = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK_REF = re.compile(r"^\s*\[[^\]]+\]:\s*\S+\s*$")
_RELEASED_LINE = re.compile(r"^\s*[*_]*(?:released|release\s+date|date)\b.*$", re.I)


@dataclasses.dataclass(frozen=True)
class _Heading:
    start: int  # first line of the heading (an overline counts)
    end: int  # first line after it
    kind: str  # "md", "rst" or "plain"
    level: object
    version: str | None


def _same_version(a: str, b: str) -> bool:
    a, b = a.lower().lstrip("v"), b.lower().lstrip("v")
    if a == b:
        return True
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return False


_RST_LINK = re.compile(r"`([^`<]+?)\s*<[^>`]*>`_{1,2}")


def _head_version(text: str, strict: bool) -> str | None:
    """The version a heading names; `strict` (an unmarked line) also wants
    nothing after the version but a date. A reST link heading names its text
    (`` `v1.2.0 <https://…/compare/1.1.0...1.2.0>`__ ``)."""
    m = _HEAD.match(_RST_LINK.sub(r"\1", text))
    if m is None:
        return None
    rest = m.group("rest")
    if rest and not re.match(r"^[\s(\-–—:,\]]", rest):
        return None
    if strict and not _DATEISH.match(rest):
        return None
    return m.group("v")


def _headings(lines: list[str]) -> Iterator[_Heading]:
    rst_styles: list[tuple[str, bool]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        md = _MD_HEAD.match(line)
        if md:
            yield _Heading(i, i + 1, "md", len(md.group(1)), _head_version(md.group(2), False))
            i += 1
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() and not _UNDERLINE.match(line) and _UNDERLINE.match(nxt):
            over = i > 0 and _UNDERLINE.match(lines[i - 1]) is not None
            style = (nxt.strip()[0], over)
            if style not in rst_styles:
                rst_styles.append(style)
            yield _Heading(i - over, i + 2, "rst", rst_styles.index(style),
                           _head_version(line.strip(), False))
            i += 2
            continue
        if line[:1].strip() and (v := _head_version(line, True)) is not None:
            yield _Heading(i, i + 1, "plain", 0, v)
        i += 1


def changelog_entry(text: str, version: str) -> str | None:
    """The changelog section of `version` without its heading, or None.

    Understands Markdown (`## 1.2.0`, `## [1.2.0] - 2024-01-01`), reST
    (`1.2.0 (2024-01-01)` or `Version 1.2.0` over a `-----` line, overlines
    too) and plain lines (`v1.2.0`, `1.2.0 - 2024-01-01`). The section ends at
    the next version heading or a heading of the same or a higher level.
    A leading "Released 2024-01-01" line and link references are dropped.
    """
    lines = text.replace("\r\n", "\n").split("\n")
    heads = list(_headings(lines))
    for n, h in enumerate(heads):
        if h.version is None or not _same_version(h.version, version):
            continue
        stop = len(lines)
        for later in heads[n + 1:]:
            if later.version is not None or (later.kind == h.kind and later.level <= h.level):
                stop = later.start
                break
        body = [ln.rstrip() for ln in lines[h.end:stop] if not _LINK_REF.match(ln)]
        while body and (not body[0].strip() or _RELEASED_LINE.match(body[0])):
            body.pop(0)
        while body and not body[-1].strip():
            body.pop()
        entry = "\n".join(body).strip("\n")
        return entry if entry.strip() else None
    return _bullet_entry(lines, version)


_BULLET = re.compile(r"^(?P<indent>\s*)[-*]\s+" + _VERSION + r"\s*:\s*(?P<text>.*)$")


def _bullet_entry(lines: list[str], version: str) -> str | None:
    """A changelog kept as one bullet per release (`- 1.2.0: Fix tabs.`,
    more lines indented under it), as tabulate writes it."""
    for i, line in enumerate(lines):
        m = _BULLET.match(line)
        if m is None or not _same_version(m.group("v"), version):
            continue
        body = [m.group("text").rstrip()]
        for nxt in lines[i + 1:]:
            if not nxt.strip() or len(nxt) - len(nxt.lstrip()) <= len(m.group("indent")):
                break
            body.append(nxt.strip())
        entry = "\n".join(body).strip()
        return entry or None
    return None
