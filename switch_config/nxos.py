"""Cisco NX-OS (Nexus 9000): numbered `monitor session`s, local SPAN or erspan-source.

SPAN destinations must be in `switchport monitor` mode.  ERSPAN takes its origin
address globally (`monitor erspan origin ip-address ... global`); the session carries
erspan-id (numbered over every switch of the selection, so that the daemon can tell
apart the sessions that reach one collector: Session.erspan_id), vrf, destination ip, `ip ttl`, `ip dscp`, and
`header-type 3` for ERSPAN type III.  The GRE protocol itself cannot be chosen.
"""
from __future__ import annotations

from .common import RenderError, header
from .select import Selection

MAX_SESSION = 32       # monitor session 1..32
MAX_ERSPAN_ID = 1023   # erspan-id 1..1023
GRE_HEADER = {0x88BE: None, 0x22EB: 3}   # type II is the default header


def render(sel: Selection, switch) -> dict[str, str]:
    sessions = sel.sessions_on(switch.name)
    if any(s.index > MAX_SESSION for s in sessions):
        raise RenderError(f"{switch.name}: NX-OS numbers sessions 1..{MAX_SESSION}, {len(sessions)} needed")
    if any(s.erspan_id is not None and s.erspan_id > MAX_ERSPAN_ID for s in sessions):
        raise RenderError(f"{switch.name}: NX-OS erspan-ids are 1..{MAX_ERSPAN_ID}, and the selection has "
                          f"{max(s.erspan_id for s in sessions)} ERSPAN sessions")
    lines = header(sel, switch, "!", "Cisco NX-OS")
    if switch.mode == "erspan":
        e = switch.erspan
        if e.gre_type not in GRE_HEADER:
            raise RenderError(f"{switch.name}: NX-OS sends ERSPAN type II (0x88be) or III (0x22eb), "
                              f"not GRE protocol {e.gre_type:#06x}")
        lines += ["!", f"monitor erspan origin ip-address {e.src_ip} global"]
    else:
        for port in dict.fromkeys(s.collector.port for s in sessions):
            lines += ["!", f"interface {port}", "  switchport", "  switchport monitor"]
    for s in sessions:
        lines.append("!")
        if switch.mode == "erspan":
            lines += [f"monitor session {s.index} type erspan-source", f"  description {s.name}"]
            if GRE_HEADER[e.gre_type]:
                lines.append(f"  header-type {GRE_HEADER[e.gre_type]}")
            lines += [f"  erspan-id {s.erspan_id}", f"  vrf {e.vrf or 'default'}",
                      f"  destination ip {s.collector.ip}", f"  ip ttl {e.ttl}", f"  ip dscp {e.dscp}"]
            lines += [f"  source interface {p} {s.direction}" for p in s.ports]
        else:
            lines += [f"monitor session {s.index}", f"  description {s.name}"]
            lines += [f"  source interface {p} {s.direction}" for p in s.ports]
            lines.append(f"  destination interface {s.collector.port}")
        lines.append("  no shut")
    return {"nxos.cfg": "\n".join(lines) + "\n"}
