"""SONiC: CONFIG_DB JSON with a MIRROR_SESSION table (`config load FILE` or
`sonic-cfggen -j FILE --write-to-db`), and a validator for that table.

CONFIG_DB stores every value as a string; src_port is a comma list; one direction
per session (RX, TX or BOTH at the source port).
"""
from __future__ import annotations

import ipaddress
import json
import re

from .common import RenderError, gre_hex
from .select import Selection

# -- rendering -----------------------------------------------------------------------


def render(sel: Selection, switch) -> dict[str, str]:
    table = {}
    for s in sel.sessions_on(switch.name):
        entry = {"type": switch.mode.upper(), "src_port": ",".join(s.ports), "direction": s.direction.upper()}
        if switch.mode == "erspan":
            e = switch.erspan
            entry.update(src_ip=e.src_ip, dst_ip=s.collector.ip, gre_type=gre_hex(e.gre_type),
                         dscp=str(e.dscp), ttl=str(e.ttl))
            if e.queue is not None:
                entry["queue"] = str(e.queue)
        else:
            entry["dst_port"] = s.collector.port
        table[s.name] = entry
    doc = {"MIRROR_SESSION": table}
    errors = validate_config_db(doc, ports=sel.cabling.ports_of(switch.name))
    if errors:
        raise RenderError(f"{switch.name}: the SONiC config would not pass sonic-mirror-session.yang: "
                          + "; ".join(errors))
    return {"config_db.json": json.dumps(doc, indent=4, sort_keys=True) + "\n"}


# -- validation ----------------------------------------------------------------------
# The constraints of the MIRROR_SESSION list in sonic-net/sonic-buildimage
# src/sonic-yang-models/yang-models/sonic-mirror-session.yang (revision 2021-06-15,
# read at commit 23aa09005b906001fc4460069c447f3294b0b8a5).  YANG patterns are
# anchored at both ends, hence fullmatch.
NAME_RE = re.compile(r"[a-zA-Z0-9]{1}([-a-zA-Z0-9_]{0,31})")          # leaf name, length 1..32
GRE_TYPE_RE = re.compile(r"0[xX][0-9a-fA-F]*|([0-9]|[1-5]?[0-9]{2,4}|6[1-4][0-9]{3}"
                         r"|65[1-4][0-9]{2}|655[1-2][0-9]|6553[0-5])")  # leaf gre_type, length 1..6
SESSION_TYPES = ("ERSPAN", "SPAN")                                     # typedef session_type
SESSION_DIRECTIONS = ("RX", "TX", "BOTH")                              # typedef session_direction
ERSPAN_ONLY = ("src_ip", "dst_ip", "gre_type", "dscp", "ttl")          # when type = 'ERSPAN'
SPAN_ONLY = ("dst_port",)                                              # when type = 'SPAN'
LEAVES = ("type", "src_ip", "dst_ip", "gre_type", "dscp", "ttl", "queue", "dst_port",
          "src_port", "direction", "policer")


def validate_config_db(doc: dict, ports: set[str] | None = None, policers: set[str] | None = None) -> list[str]:
    """Errors of doc's MIRROR_SESSION table against the YANG model; [] when valid.

    `ports` stands for the PORT table dst_port is a leafref to (None: not checked);
    `policers` likewise for POLICER (taken from doc when None).  Beyond the model,
    the ERSPAN/SPAN destination a session needs to do anything is required too
    (marked "orchagent"), and src_port items are checked against `ports`."""
    errs = []
    table = doc.get("MIRROR_SESSION")
    if not isinstance(table, dict):
        return ["MIRROR_SESSION table missing or not an object"]
    if policers is None:
        policers = set((doc.get("POLICER") or {}).keys())
    for name, entry in table.items():
        where = f"MIRROR_SESSION|{name}"
        if not (1 <= len(name) <= 32 and NAME_RE.fullmatch(name)):
            errs.append(f"{where}: name must match [a-zA-Z0-9][-a-zA-Z0-9_]{{0,31}} (1..32 characters)")
        if not isinstance(entry, dict):
            errs.append(f"{where}: entry is not an object")
            continue
        for k in entry:
            if k not in LEAVES:
                errs.append(f"{where}: {k!r} is not a leaf of the model")
        stype = entry.get("type", "ERSPAN")             # default "ERSPAN"
        if stype not in SESSION_TYPES:
            errs.append(f"{where}: type {stype!r} not in {SESSION_TYPES}")
        for k in ERSPAN_ONLY:
            if k in entry and stype != "ERSPAN":
                errs.append(f"{where}: {k} is only allowed when type is ERSPAN")
        for k in SPAN_ONLY:
            if k in entry and stype != "SPAN":
                errs.append(f"{where}: {k} is only allowed when type is SPAN")
        for k in ("src_ip", "dst_ip"):
            if k in entry and not _is_ip(entry[k]):
                errs.append(f"{where}: {k} {entry[k]!r} is not an inet:ip-address")
        if "gre_type" in entry:
            g = str(entry["gre_type"])
            if not (1 <= len(g) <= 6 and GRE_TYPE_RE.fullmatch(g)):
                errs.append(f"{where}: gre_type {g!r} is not hex 0x... or decimal 0..65535 (1..6 characters)")
        for k, hi in (("dscp", 63), ("ttl", 255), ("queue", 255)):
            if k in entry and _uint(entry[k], hi) is None:
                errs.append(f"{where}: {k} {entry[k]!r} is not an integer in 0..{hi}")
        if "dst_port" in entry:
            dp = entry["dst_port"]
            if dp != "CPU" and ports is not None and dp not in ports:
                errs.append(f"{where}: dst_port {dp!r} is not a PORT (leafref) nor 'CPU'")
        if "src_port" in entry:
            sp = str(entry["src_port"])
            if not 1 <= len(sp) <= 2048:
                errs.append(f"{where}: src_port must be 1..2048 characters")
            elif ports is not None:
                bad = [p for p in sp.split(",") if p not in ports]
                if bad:
                    errs.append(f"{where}: src_port names unknown ports {bad}")
        if entry.get("direction", "BOTH") not in SESSION_DIRECTIONS:   # default "BOTH"
            errs.append(f"{where}: direction {entry.get('direction')!r} not in {SESSION_DIRECTIONS}")
        if "policer" in entry and entry["policer"] not in policers:
            errs.append(f"{where}: policer {entry['policer']!r} is not in the POLICER table (leafref)")
        need = ("src_ip", "dst_ip") if stype == "ERSPAN" else ("dst_port",)
        for k in need:
            if k not in entry:
                errs.append(f"{where}: a {stype} session needs {k} (orchagent)")
    return errs


def _is_ip(v) -> bool:
    # inet:ip-address allows an IPv6 zone index ("%eth0"); ipaddress does too since 3.9.
    try:
        ipaddress.ip_address(str(v))
        return True
    except ValueError:
        return False


def _uint(v, hi: int):
    """CONFIG_DB keeps numbers as decimal strings; accept those and ints."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        n = v
    elif isinstance(v, str) and v.isascii() and v.isdigit() and len(v) <= 18:
        n = int(v)
    else:
        return None
    return n if 0 <= n <= hi else None
