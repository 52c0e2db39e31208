"""The README's and docs/ pages' text for the tests that run or check what they say.

A page is named by its path from the repository root (`README.md`, `docs/cli.md`); a section by
its heading's title, at any level: it runs to the next heading of the same level or higher, so a
section keeps its subsections. Lines inside code blocks are never headings (a `# comment` in a
python or bash block is not one).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pages() -> list[str]:
    """README.md, then every docs/ page."""
    return ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]


@functools.cache
def page(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def headings(text: str) -> list[tuple[int, int, str]]:
    """(offset of the heading's line, level, title) of each heading outside code blocks."""
    found, fenced, offset = [], False, 0
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"(#+) (.+)", line)):
            found.append((offset, len(match.group(1)), match.group(2).strip()))
        offset += len(line)
    return found


def section(name: str, title: str) -> str:
    """The body of `title`'s section of page `name`, without its heading line."""
    text = page(name)
    marks = headings(text)
    for i, (start, level, found) in enumerate(marks):
        if found == title:
            end = next((s for s, lv, _ in marks[i + 1 :] if lv <= level), len(text))
            return text[text.index("\n", start) + 1 : end]
    raise AssertionError(f"{name} has no section {title!r}")


def blocks(text: str, kind: str) -> list[str]:
    """The bodies of the ```kind fenced blocks in `text`."""
    return re.findall(rf"^```{kind}\n(.*?)^```", text, re.S | re.M)


def console_commands(text: str) -> list[str]:
    """The `$ ` lines of the ```console blocks in `text`, without the prompt."""
    return [
        line[2:].strip() for block in blocks(text, "console") for line in block.splitlines() if line.startswith("$ ")
    ]


def all_text() -> str:
    """Every page, one after another: for what a test quotes wherever it now stands."""
    return "\n\n".join(page(name) for name in pages())


def prose(text: str) -> str:
    """`text` with its line breaks undone, so that a quoted phrase may span lines."""
    return " ".join(text.split())


def run_as_main(source: str, filename: str) -> dict[str, object]:
    """Run a snippet pasted from a page as a user's script (`__name__ == "__main__"`), in this
    process, and return its globals. A test's process has torch and autotune imported already: an
    interpreter of the snippet's own spent 2 s of CPU importing torch again, for a snippet whose
    point is what it computes, not that it starts."""
    scope: dict[str, object] = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), scope)
    return scope
