"""MkDocs hook: ``reference/knobs.md``'s table of every mesh knob, written from the code at build time.

The rows are the fields of the public ``hf_meshtune.MeshConfig`` (the ``MeshArguments`` mixin that
``MeshTrainingArguments``, the TRL configs and ``MeshPlugin`` share) in their declared order: the name (its
command-line flag), the type, the declared default, what the two presets resolve it to where they differ,
and the field's ``metadata["help"]``. A knob without help text is a warning, so the strict build fails on it.
"""

from __future__ import annotations

import dataclasses
import logging
import re

MARKER = "<!-- knobs: generated from hf_meshtune.MeshConfig -->"
END = "<!-- /knobs -->"  # what lies between the two markers (a note for readers of the raw file) is replaced
PAGE = "reference/knobs.md"
log = logging.getLogger("mkdocs.hooks.knobs")


def _cell(text: str) -> str:
    """Help text as one Markdown table cell, shown as written (no emphasis, links, HTML or cell breaks)."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([\\`*_\[\]|])", r"\\\1", " ".join(text.split()))


def _code(value) -> str:
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def knob_table() -> str:
    from hf_meshtune import MeshConfig

    presets = {name: MeshConfig(preset=name) for name in ("quality", "paper")}
    lines = [
        "| knob (flag) | type | default | what it does |",
        "|---|---|---|---|",
    ]
    for field in dataclasses.fields(MeshConfig):
        help_text = (field.metadata or {}).get("help")
        if not help_text:
            log.warning(f"knobs: MeshConfig.{field.name} has no metadata['help']: the knob reference needs one")
            help_text = "(no help text)"
        default = _default(field)
        shown = "required" if default is dataclasses.MISSING else _code(default)
        resolved = {name: getattr(config, field.name) for name, config in presets.items()}
        if field.name != "preset" and len(set(map(repr, resolved.values()))) > 1:
            shown += "<br>" + ", ".join(f"{name}: {_code(value)}" for name, value in resolved.items())
        name = f"`{field.name}`<br>`--{field.name}`"
        type_ = _cell(field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type)))
        lines.append(f"| {name} | {type_} | {shown} | {_cell(help_text)} |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if markdown.count(MARKER) != 1 or markdown.count(END) != 1 or markdown.index(END) < markdown.index(MARKER):
        log.warning(f"knobs: {PAGE} needs one {MARKER!r} and, after it, one {END!r}: the table has nowhere to go")
        return markdown
    before, rest = markdown.split(MARKER)
    return before + knob_table() + rest.split(END, 1)[1]
