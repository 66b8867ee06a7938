"""Linux bridge mirroring with tc: the rule list switch_config/linux.py applies, and
the same rules as a shell script.

A rule is (bridge port, capture port, direction): direction as on a switch port, rx =
what the port receives (what the rank sends: tc's ingress hook), tx = what it sends
(egress hook), both.  The script uses `u32 match u32 0 0` (matches every frame)
rather than matchall because kernels without CONFIG_NET_CLS_MATCHALL refuse the
latter (docs WIRE.md); switch_config/linux.py tries matchall first.  Every (port,
hook) gets one mirror rule only, so the mirred action's default "pipe" is enough.
"""
from __future__ import annotations

import json
import shlex

from .common import header
from .select import Selection

HOOKS = {"rx": ("ingress",), "tx": ("egress",), "both": ("ingress", "egress")}


def rules(sel: Selection, switch) -> list[tuple[str, str, str]]:
    """[(bridge port, capture port, direction)] for one Linux bridge."""
    return [(port, s.collector.port, s.direction)
            for s in sel.sessions_on(switch.name) for port in s.ports]


def apply(rule_list, add_mirror, netns=None) -> None:
    """Hand each rule to the backend: add_mirror(src_ifname, dst_ifname, direction, netns=)."""
    for src, dst, direction in rule_list:
        add_mirror(src, dst, direction, netns=netns)


def shell(rule_list, netns: str | None = None) -> str:
    pre = f"ip netns exec {shlex.quote(netns)} " if netns else ""
    lines, qdiscs = [], []
    for src, dst, direction in rule_list:
        if src not in qdiscs:
            qdiscs.append(src)
            lines.append(f"{pre}tc qdisc add dev {shlex.quote(src)} clsact")
        for hook in HOOKS[direction]:
            lines.append(f"{pre}tc filter add dev {shlex.quote(src)} {hook} protocol all u32 match u32 0 0 "
                         f"action mirred egress mirror dev {shlex.quote(dst)}")
    return "\n".join(lines)


def render(sel: Selection, switch) -> dict[str, str]:
    rl = rules(sel, switch)
    script = "\n".join(["#!/bin/sh"] + header(sel, switch, "#", "Linux bridge, tc mirred")
                       + ["set -e", shell(rl, switch.netns)]) + "\n"
    doc = {"switch": switch.name, "netns": switch.netns,
           "rules": [{"src": a, "dst": b, "direction": d} for a, b, d in rl]}
    return {"tc.sh": script, "tc.json": json.dumps(doc, indent=1) + "\n"}
