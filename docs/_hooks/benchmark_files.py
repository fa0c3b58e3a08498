"""MkDocs hook: the committed benchmark results become part of the site, at their paths in the repository.

Every ``benchmarks/**/*.md`` and ``benchmarks/**/*.png`` (a benchmark folder's ``README.md`` aside: its page
includes it) is served at ``benchmarks/<the same path>``, so a page such as ``docs/benchmarks/wan.md`` links
``wan/results/wan.md`` and shows ``wan/results/wan_time_to_quality.png``, and the results files' own relative
links (``loss.png`` beside ``report.md``) keep working. They are pages outside the nav; strict mode checks
every link to and in them like any other page's.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

SUFFIXES = {".md", ".png"}


def on_files(files: Files, config) -> Files:
    root = Path(config.config_file_path).parent
    for path in sorted((root / "benchmarks").rglob("*")):
        if path.suffix not in SUFFIXES or path.name == "README.md" or not path.is_file():
            continue
        src_uri = path.relative_to(root).as_posix()
        if src_uri in files:  # a page of docs/ at the same path would be ambiguous: refuse it
            raise ValueError(f"docs/{src_uri} shadows the committed {src_uri}: move the page")
        files.append(File.generated(config, src_uri, abs_src_path=str(path), inclusion=InclusionLevel.NOT_IN_NAV))
    return files


MARKER = "<!-- committed results -->"
END = "<!-- /committed results -->"  # between the two: a note for readers of the raw file, replaced by the list


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """A benchmark page ``benchmarks/<folder>.md`` gets, at its marker, a link to every committed result of
    ``benchmarks/<folder>/`` that the site serves (``on_files`` above), so none is left unlinked."""
    src = page.file.src_uri
    if MARKER not in markdown or not src.startswith("benchmarks/"):
        return markdown
    folder = src[: -len(".md")] + "/"
    served = sorted(f.src_uri for f in files if f.src_uri.startswith(folder) and Path(f.src_uri).suffix in SUFFIXES)
    root = Path(config.config_file_path).parent
    by_folder: dict[str, list[str]] = {}
    for path in sorted((root / folder).rglob("*.json")):
        by_folder.setdefault(path.parent.relative_to(root).as_posix(), []).append(path.name)
    items = [f"- [`{uri}`]({uri[len('benchmarks/') :]})" for uri in served]
    if by_folder:
        json = [
            f"`{d}/{names[0]}`" if len(names) == 1 else f"`{d}/*.json` ({len(names)})" for d, names in by_folder.items()
        ]
        items.append("- the JSON they are written from: " + ", ".join(json))
    before, rest = markdown.split(MARKER, 1)
    return before + "\n".join(items or ["- (none committed)"]) + rest.split(END, 1)[1]
