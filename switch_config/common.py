"""What every vendor renderer shares: the error type and the words that explain a session.

A renderer is `render(selection, switch) -> {file suffix: text}` and must be
deterministic (no dates, no paths): its output is checked in as golden files.
"""
from __future__ import annotations

import re

from .cabling import IFNAME
from .select import Selection, Session
from ckptd.errors import CkptdError


class RenderError(CkptdError, ValueError):
    """The selection asks for something this vendor's syntax cannot say."""


# What each vendor's CLI can take as one word: an interface, session or VRF name outside
# these sets (a space, a quote, a newline that would start a command of its own) is
# refused, never quoted or escaped. Linux names are kernel interface names (IFNAMSIZ).
SAYABLE = {
    "eos": re.compile(r"[A-Za-z0-9][A-Za-z0-9_./:-]{0,63}"),
    "nxos": re.compile(r"[A-Za-z0-9][A-Za-z0-9_./:-]{0,63}"),
    "comware": re.compile(r"[A-Za-z0-9][A-Za-z0-9_./:-]{0,63}"),
    "sonic": re.compile(r"[A-Za-z0-9][A-Za-z0-9_./:-]{0,63}"),
    "linux": IFNAME,
}


def check_sayable(sel: Selection, switch, vendor: str) -> None:
    """RenderError naming the switch, the field and the vendor for the first name that
    vendor's syntax cannot carry as one plain word."""
    allowed = SAYABLE[vendor]
    names = [("switch name", switch.name)]
    for s in sel.sessions_on(switch.name):
        names += [("session name", s.name), ("collector name", s.collector.name)]
        names += [("source port", p) for p in s.ports]
        if s.collector.port is not None:
            names.append(("destination port", s.collector.port))
    if switch.erspan is not None:
        names += [("erspan.vrf", switch.erspan.vrf), ("erspan.egress_port", switch.erspan.egress_port)]
    if switch.netns is not None:
        names.append(("netns", switch.netns))
    for what, value in names:
        if value is not None and not allowed.fullmatch(value):
            raise RenderError(f"{switch.name[:64]!r}: {what} {value[:80]!r} cannot be said safely in "
                              f"{vendor} syntax (allowed: {allowed.pattern})")


def links_seen(sel: Selection, session: Session) -> str:
    """'0>1 (ch0), 0>2 (ch1)': the directed links a session's sources carry, per channel."""
    out = []
    for port, rank in zip(session.ports, session.ranks):
        dirs = ("rx", "tx") if session.direction == "both" else (session.direction,)
        for ch in range(sel.ring.channels):
            ring = sel.ring.rings[ch]
            i = ring.index(rank)
            for d in dirs:
                a, b = (rank, ring[(i + 1) % len(ring)]) if d == "rx" else (ring[i - 1], rank)
                out.append(f"{a}>{b} (ch{ch})")
    return ", ".join(dict.fromkeys(out))


def describe(sel: Selection, session: Session) -> str:
    """One line: which ranks, which direction, which links, to which collector."""
    ranks = ", ".join(str(r) for r in session.ranks)
    return (f"{session.name}: rank {ranks} {session.direction.upper()} -> {session.collector.name}; "
            f"links {links_seen(sel, session)}")


def header(sel: Selection, switch, comment: str, what: str) -> list[str]:
    """Leading comment lines every text rendering starts with."""
    return [f"{comment} ckptd mirror-config for {switch.name} ({what}), {len(sel.sessions_on(switch.name))} "
            f"session(s): {sel.links_wanted} link(s) per ring, every chunk on >= {sel.min_streams} stream(s)"] + [
        f"{comment}   {describe(sel, s)}" for s in sel.sessions_on(switch.name)]


def gre_hex(value: int) -> str:
    return f"{value:#06x}"
