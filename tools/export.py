"""Write the package's operation modules from the chapters: one source for lesson and library.

    python tools/export.py           # write src/stepkernels/<wing>/<module>.py from the chapters
    python tools/export.py --check   # fail if a module differs from its chapter (make test)

A chapter marks each code cell that belongs to the package with a first line ``# @save WING/NAME``:
the cell's code, up to the next ``# %%``, goes into ``src/stepkernels/WING/NAME.py`` (``ops/softmax``
for an operation; ``runtime/waiting`` for device code that several operations share). The cells of
one module are written in the order they appear (a module may collect cells from more than one
chapter, in chapter order). Everything else in a chapter (checks, pictures, benchmarks) stays
in the lesson. So the kernel a reader edits in the notebook and the kernel ``import
stepkernels`` runs are one text, written once, in the chapter.
"""

from __future__ import annotations

from pathlib import Path
import re
import sys
import textwrap

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = ROOT / "tutorials"
PACKAGE = ROOT / "src" / "stepkernels"
MARKER = re.compile(r"^# ?@save (\w+/\w+)\s*$")  # "# @save WING/NAME": ruff format adds the space
CELL = re.compile(r"^# ?%%")
GENERATED = "# Generated from {sources} by tools/export.py: edit the chapter, then `make export`."


def saved_cells(chapter: Path) -> list[tuple[str, str]]:
    """(module, code) for every ``#@save`` cell of a chapter, in order."""
    cells, module, lines = [], None, []

    def close():
        if module is not None:
            cells.append((module, "\n".join(lines).strip("\n")))

    for line in chapter.read_text().splitlines():
        if CELL.match(line):
            close()
            module, lines = None, []
        elif (found := MARKER.match(line)) is not None:
            close()
            module, lines = found.group(1), []
        elif line.startswith(("# @save", "#@save")):
            sys.exit(f"{chapter.name}: {line!r} names no WING/NAME (as '# @save ops/softmax')")
        elif module is not None:
            lines.append(line)
    close()
    return cells


def title(chapter: Path) -> str:
    """The chapter's title: the first non-empty line of its docstring."""
    text = chapter.read_text().split('"""', 2)[1]
    return next(line.strip() for line in text.splitlines() if line.strip())


def modules() -> dict[Path, str]:
    """The text of every module the chapters define."""
    collected: dict[str, list[tuple[Path, str]]] = {}
    for chapter in sorted(CHAPTERS.glob("[0-9][0-9]-*.py")):
        for module, code in saved_cells(chapter):
            collected.setdefault(module, []).append((chapter, code))
    texts = {}
    for module, cells in collected.items():
        chapters = list(dict.fromkeys(chapter for chapter, _ in cells))
        docstring = "; ".join(f"chapter {c.name[:2]}, {title(c)}" for c in chapters)
        sources = ", ".join(f"tutorials/{c.name}" for c in chapters)
        summary = textwrap.fill(f"{module.replace('/', '.')}: the code of {docstring}.", 96)
        generated = textwrap.fill(GENERATED.format(sources=sources), 98, subsequent_indent="# ")
        header = f'"""{summary}"""\n\n{generated}\n'
        texts[PACKAGE / f"{module}.py"] = header + "\n" + "\n\n\n".join(code for _, code in cells) + "\n"
    return texts


def is_generated(path: Path) -> bool:
    """Was ``path`` written by this tool? Its header says so, on the line after the docstring."""
    return any(line.startswith("# Generated from ") for line in path.read_text().splitlines()[:8])


def main(*flags: str) -> None:
    texts = modules()
    written = {path for path in PACKAGE.glob("**/*.py") if is_generated(path)}
    if "--check" in flags:
        stale = [p for p, text in texts.items() if not p.exists() or p.read_text() != text]
        stale += sorted(written - set(texts))  # generated once, no chapter saves into it now
        if stale:
            names = ", ".join(str(p.relative_to(ROOT)) for p in stale)
            sys.exit(f"{names}: not what the chapters say; run `make export` (tools/export.py).")
        return
    for path in written - set(texts):
        path.unlink()
    for path, text in texts.items():
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
