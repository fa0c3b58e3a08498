"""Griffe extension: the names ``hf_meshtune`` imports on first use (``_LAZY`` in its ``__init__``: the TRL
trainers and configs, ``MeshAccelerator``, ``MeshPlugin``) become members of the package, so the API page
documents them at their public path ``hf_meshtune.<name>`` like every other name of ``__all__``. The
mapping is read from the package itself, so a module that moves moves here too."""

from __future__ import annotations

import ast

import griffe


class LazyExports(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        if pkg.path != "hf_meshtune" or "_LAZY" not in pkg.members:
            return
        lazy = ast.literal_eval(str(pkg.members["_LAZY"].value))
        for name, module in lazy.items():
            if name not in pkg.members:
                pkg.set_member(name, griffe.Alias(name, f"hf_meshtune.{module}.{name}", parent=pkg))
