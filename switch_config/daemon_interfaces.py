"""The daemon's side of a selection: the `interfaces` entries of `ckptd run`'s config
(docs/DAEMON.md) for the collectors the sessions reach, written by mirror-config as
daemon-interfaces.yaml.

A collector is one stream, unless several ERSPAN sessions reach it and every one of
them carries a session ID we set: then each session is a stream of its own (the
daemon's `erspan_session`, which captures only that session), so a loss on one mirror
link is counted for that link and not for the others that share the NIC. Only NX-OS
lets the ID be set (erspan-id); EOS, SONiC and Comware choose it themselves, and a
collector that gets one of theirs stays one stream. A collector reached by SPAN too
stays one stream: its SPAN copies carry no session.
"""
from __future__ import annotations

import json

from .select import Selection, Session

SETS_ERSPAN_ID = ("nxos",)   # switch os whose renderer writes Session.erspan_id
NAME_MAX = 64                # the daemon's stream names (interfaces[].name)


def daemon_interfaces(sel: Selection) -> tuple[str | None, list[str]]:
    """(the file's text, or None when no collector gives its ifname; notes to print)."""
    entries, notes = [], []
    for col in sel.cabling.collectors:
        sessions = [s for s in sel.sessions if s.collector.name == col.name]
        if not sessions:
            continue
        if col.ifname is None:
            notes.append(f"collector {col.name} has no ifname in the cabling file, so daemon-interfaces.yaml "
                         "has no entry for it: add ifname (the interface the checkpoint host sees it as)")
            continue
        base = {"ifname": col.ifname, **({"netns": col.netns} if col.netns else {})}
        if len(sessions) > 1 and all(_has_id(s) for s in sessions):
            for s in sessions:
                suffix = f".{s.erspan_id}"
                name = col.name[:NAME_MAX - len(suffix)] + suffix
                entries.append(({"name": name, **base, "erspan_session": s.erspan_id}, _about(s)))
            continue
        if len(sessions) > 1:
            fixed = sorted({s.switch.os for s in sessions if not _has_id(s)})
            notes.append(f"collector {col.name} receives {len(sessions)} mirror sessions "
                         f"({', '.join(f'{s.switch.name} {s.name}' for s in sessions)}); "
                         + ("some are SPAN, which carries no session ID" if any(s.switch.mode != "erspan"
                                                                                 for s in sessions)
                            else f"{', '.join(fixed)} choose the ERSPAN session ID themselves")
                         + ", so the daemon captures them as one stream (a loss on one is counted for all)")
        entries.append(({"name": col.name, **base}, "; ".join(_about(s) for s in sessions)))
    if not entries:
        return None, notes
    lines = ["# ckptd mirror-config: the daemon's `interfaces` (docs/DAEMON.md) for the collectors of this",
             "# selection; copy them into the daemon's config and add ring sizes there as needed.",
             "interfaces:"]
    for entry, about in entries:
        lines += [f"  # {about}",
                  "  - {" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in entry.items()) + "}"]
    return "\n".join(lines) + "\n", notes


def _has_id(s: Session) -> bool:
    return s.switch.mode == "erspan" and s.switch.os in SETS_ERSPAN_ID


def _about(s: Session) -> str:
    ranks = ",".join(map(str, s.ranks))
    what = ("SPAN" if s.switch.mode != "erspan" else
            f"ERSPAN session {s.erspan_id}" if _has_id(s) else f"ERSPAN ({s.switch.os} chooses the session ID)")
    return f"{s.switch.name} {s.name}: rank {ranks} {s.direction.upper()}, {what}"
