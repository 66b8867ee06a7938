"""Render a Selection for each switch in its vendor's syntax: {file name: text}.

vendors: "auto" renders each switch in the syntax of its `os`; "all" renders every
switch in every syntax that can express it (the Linux backend only mirrors locally,
so ERSPAN switches are not rendered as Linux); or an explicit list.
"""
from __future__ import annotations

from . import comware, eos, linux_render, nxos, sonic
from .common import RenderError, check_sayable
from .select import Selection

RENDERERS = {"sonic": sonic.render, "eos": eos.render, "nxos": nxos.render,
             "comware": comware.render, "linux": linux_render.render}


def render_all(sel: Selection, vendors="auto") -> dict[str, str]:
    files = {}
    for sw in sel.switches():
        if vendors == "auto":
            names = [sw.os]
        elif vendors == "all":
            names = [v for v in RENDERERS if not (v == "linux" and sw.mode == "erspan")]
        else:
            names = list(vendors)
        for v in names:
            if v not in RENDERERS:
                raise RenderError(f"unknown vendor {v!r} (known: {', '.join(RENDERERS)})")
            if v == "linux" and sw.mode == "erspan":
                raise RenderError(f"{sw.name}: the Linux tc backend mirrors locally; "
                                  "it cannot render an ERSPAN switch")
            check_sayable(sel, sw, v)
            for suffix, text in RENDERERS[v](sel, sw).items():
                files[f"{sw.name}.{suffix}"] = text
    return files
