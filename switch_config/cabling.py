"""The cabling file: where every rank's NIC and every checkpoint host is plugged in.

YAML or JSON (format "ckptd-cabling", version 1); docs/MIRRORS.md documents it.
Three lists:

    switches    name, os (sonic|eos|nxos|comware|linux), mode (span|erspan), the
                mirror limits of the ASIC (max_sessions, max_source_ports per session,
                the directions it can mirror) and, for ERSPAN, the tunnel parameters
                (src_ip, gre_type, dscp, ttl, queue, vrf, egress_port)
    collectors  the checkpoint hosts' capture NICs: name, switch + port (where a SPAN
                destination is), ip (where an ERSPAN tunnel ends), capacity (how many
                mirrored link directions the port can take without dropping: a port
                as fast as a rank's takes 1, because a ring link runs at line rate),
                and optionally ifname (+ netns): the interface the checkpoint host
                sees it as, for the daemon's interfaces that mirror-config writes
    ranks       rank -> switch + port of its NIC (+ `ports`: every port of a merged NIC,
                NCCL's device order, the first = port; all on that switch)

Everything is checked here, once, so that the selection and the renderers can trust
what they get; each error names the entry and the field, and a key the format does not
have is an error, not ignored.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from ckptd.core.docload import DECIMAL
from ckptd.core.hostaddr import not_a_host
from ckptd.errors import CkptdError, show, unknown_keys

CABLING_FORMAT = "ckptd-cabling"
CABLING_VERSION = 1
OSES = ("sonic", "eos", "nxos", "comware", "linux")
MODES = ("span", "erspan")
DIRECTIONS = ("rx", "tx", "both")
# GRE protocols parsers/erspan.py decodes: ERSPAN II (0x88BE; type I when no sequence
# number), ERSPAN III (0x22EB), transparent Ethernet bridging (0x6558).
GRE_TYPES = (0x88BE, 0x22EB, 0x6558)


class CablingError(CkptdError, ValueError):
    """A cabling file that is malformed or inconsistent; the message names the entry."""


@dataclass(frozen=True)
class Erspan:
    src_ip: str
    gre_type: int = 0x88BE
    dscp: int = 0
    ttl: int = 64
    queue: int | None = None
    vrf: str | None = None
    egress_port: str | None = None   # H3C Comware: the monitor port the tunnel leaves by


@dataclass(frozen=True)
class Switch:
    name: str
    os: str
    mode: str
    max_sessions: int | None          # None: no limit (a Linux bridge)
    max_source_ports: int | None
    directions: tuple[str, ...] = DIRECTIONS
    erspan: Erspan | None = None
    netns: str | None = None          # Linux: the namespace the bridge lives in

    def supports(self, direction: str) -> bool:
        return direction in self.directions


@dataclass(frozen=True)
class Collector:
    name: str
    switch: str | None = None
    port: str | None = None
    ip: str | None = None
    capacity: int = 1
    # where the checkpoint host sees this NIC: the daemon's interfaces[].ifname and .netns
    # (mirror-config writes the daemon's interfaces for the collectors that give ifname)
    ifname: str | None = None
    netns: str | None = None


@dataclass(frozen=True)
class RankPort:
    rank: int
    switch: str
    port: str
    # the switch ports of every port of a merged NIC (NCCL_IB_MERGE_NICS), in NCCL's device
    # order; () for a NIC of one port: read them through switch_ports
    ports: tuple[str, ...] = ()

    @property
    def switch_ports(self) -> tuple[str, ...]:
        return self.ports or (self.port,)


@dataclass(frozen=True)
class Cabling:
    switches: tuple[Switch, ...]
    collectors: tuple[Collector, ...]
    ranks: tuple[RankPort, ...]

    def switch(self, name: str) -> Switch:
        return next(s for s in self.switches if s.name == name)

    def rank(self, rank: int) -> RankPort | None:
        return next((r for r in self.ranks if r.rank == rank), None)

    def ports_of(self, switch: str) -> set[str]:
        """Every port the file names on a switch (the SONiC validator's PORT table)."""
        return ({p for r in self.ranks if r.switch == switch for p in r.switch_ports}
                | {c.port for c in self.collectors if c.switch == switch and c.port}
                | {s.erspan.egress_port for s in self.switches
                   if s.name == switch and s.erspan and s.erspan.egress_port})


MAX_CABLING_BYTES = 16 << 20  # a cabling file larger than this is not one


def load_cabling(path: str | Path) -> Cabling:
    from ckptd.core.readfile import read_bounded
    path = Path(path)
    try:
        # bounded, and a FIFO nobody writes into is an error after a wait (read_text() hung)
        text = read_bounded(path, MAX_CABLING_BYTES, "a cabling file").decode()
    except (OSError, UnicodeDecodeError) as e:   # a binary file is no cabling file either
        raise CablingError(f"{path}: cannot read cabling file: {e}") from e
    try:
        from ckptd.core.docload import strict_json, strict_yaml  # a key given twice is an error
        doc = (strict_json(text) if path.suffix.lower() == ".json"
               else strict_yaml(text, decimal_only=False, check_scalar=_yaml11_check(str(path))))
    except CablingError:
        raise
    except Exception as e:  # json.JSONDecodeError, yaml.YAMLError, a key given twice: each says where
        raise CablingError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from e
    return cabling_from_doc(doc, str(path))


# The keys that hold numbers: the only ones where YAML may read a scalar as an integer,
# and there in hex or binary too (gre_type: 0x88be), never in octal or base 60.
INT_KEYS = ("version", "max_sessions", "max_source_ports", "gre_type", "dscp", "ttl", "queue", "capacity", "rank")


def _yaml11_check(where: str):
    """strict_yaml's check_scalar for a cabling file: YAML 1.1 reads port: 1.10 as 1.1,
    010 as 8, 1:30 as 90 and name: no as False; their text would name the wrong port or
    collector in the configs, so each is refused naming its key and line."""
    def check(path, line, written, value):
        key = next((k for k in reversed(path) if isinstance(k, str)), None)
        if key in INT_KEYS and (type(value) is not int or written.lstrip("+-")[:2].lower() in ("0x", "0b")
                                or DECIMAL.fullmatch(written)):
            return  # a number in a base it names, or digits grouped (6_4); a float or boolean is _int's to refuse
        at = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")
        quoted = f' ("{written}")' if len(written) <= 40 else ""   # a 5000-digit hex stays out of the line
        fix = "write the number in decimal" if key in INT_KEYS else f"quote it{quoted} to mean the text"
        raise CablingError(f"{where}: {at} is written {written[:40]} (line {line}), which YAML 1.1 reads as "
                           f"the {'boolean' if type(value) is bool else 'number'} {show(value)}: {fix}")
    return check


def cabling_from_doc(doc, where: str = "cabling") -> Cabling:
    if not isinstance(doc, dict) or doc.get("format") != CABLING_FORMAT:
        got = show(doc.get("format")) if isinstance(doc, dict) else show(doc)
        raise CablingError(f"{where}: not a ckptd cabling file (format is {got}, expected {CABLING_FORMAT!r})")
    _known(doc, TOP_KEYS, where)
    version = doc.get("version")
    if isinstance(version, bool) or version != CABLING_VERSION:
        raise CablingError(f"{where}: cabling version {show(version)} is not supported "
                           f"(this ckptd reads version {CABLING_VERSION})")
    switches = tuple(_switch(s, f"{where}: switches[{i}]") for i, s in enumerate(_list(doc, "switches", where)))
    names = [s.name for s in switches]
    _unique(names, f"{where}: switch names")
    collectors = tuple(_collector(c, f"{where}: collectors[{i}]", switches)
                       for i, c in enumerate(_list(doc, "collectors", where)))
    _unique([c.name for c in collectors], f"{where}: collector names")
    _unique_ips(collectors, where)
    _tunnel_ends(switches, collectors, where)
    # the daemon's interfaces (mirror-config writes them for one checkpoint host): one
    # interface is one NIC, so one collector; the daemon would refuse it listed twice
    _unique([(c.ifname, c.netns) for c in collectors if c.ifname],
            f"{where}: collectors' (ifname, netns) pairs (one interface of the checkpoint host is one collector)")
    ranks = tuple(_rank(r, f"{where}: ranks[{i}]", names) for i, r in enumerate(_list(doc, "ranks", where)))
    _unique([r.rank for r in ranks], f"{where}: ranks")
    _unique([(r.switch, p) for r in ranks for p in r.switch_ports] + [(c.switch, c.port) for c in collectors if c.port],
            f"{where}: (switch, port) pairs of ranks and collectors")
    return Cabling(switches, collectors, ranks)


# -- entries -------------------------------------------------------------------------
def _switch(d, ctx) -> Switch:
    d = _dict(d, ctx)
    name = _name(d, "name", ctx)
    ctx = f"{ctx} ({name})"
    _known(d, SWITCH_KEYS, ctx)
    os_ = _choice(d, "os", OSES, ctx)
    mode = _choice(d, "mode", MODES, ctx, default="span" if os_ == "linux" else None)
    if os_ == "linux" and mode != "span":
        raise CablingError(f"{ctx}: a Linux bridge mirrors with tc mirred, locally: mode must be span")
    limits = {}
    for key in ("max_sessions", "max_source_ports"):
        if d.get(key) is None:
            if os_ != "linux":
                raise CablingError(f"{ctx}: {key} is required (the ASIC's limit; see your switch's "
                                   "mirroring guide). Only a Linux bridge has no limit")
            limits[key] = None
        else:
            limits[key] = _int(d, key, ctx, 1, 4096)
    dirs = d.get("directions", list(DIRECTIONS))
    if not isinstance(dirs, list) or not dirs or any(x not in DIRECTIONS for x in dirs):
        raise CablingError(f"{ctx}: directions must be a non-empty list of {', '.join(DIRECTIONS)}")
    erspan = None
    if mode == "erspan":
        erspan = _erspan(_dict(d.get("erspan"), f"{ctx}: erspan"), f"{ctx}: erspan")
        if os_ == "comware" and not erspan.egress_port:
            raise CablingError(f"{ctx}: erspan.egress_port is required on Comware: ERSPAN there is a "
                               "local mirroring group whose monitor port sends the tunnel")
    elif d.get("erspan") is not None:
        raise CablingError(f"{ctx}: has erspan parameters but mode is {mode}")
    netns = _name(d, "netns", ctx, required=False)
    if netns is not None and os_ != "linux":
        raise CablingError(f"{ctx}: netns is for Linux bridges only")
    return Switch(name, os_, mode, limits["max_sessions"], limits["max_source_ports"],
                  tuple(dict.fromkeys(dirs)), erspan, netns)


def _erspan(d, ctx) -> Erspan:
    _known(d, ERSPAN_KEYS, ctx)
    src = _ip(d, "src_ip", ctx, required=True)
    raw = d.get("gre_type", 0x88BE)
    decodes = "ckptd decodes " + ", ".join(f"{g:#06x}" for g in GRE_TYPES)
    gre = None
    if isinstance(raw, int) and not isinstance(raw, bool):
        gre = raw
    elif isinstance(raw, str) and len(raw) <= 16:   # "0x88be", "35006"; longer is no protocol number
        try:
            gre = int(raw, 0)
        except ValueError:
            pass
    if gre is None:   # null, a float (35006.5 would truncate to 0x88be), a list, a mapping, garbage text
        raise CablingError(f"{ctx}: gre_type is {show(raw)}; expected an integer or a hex string "
                           f"such as 0x88be ({decodes})")
    if gre not in GRE_TYPES:
        got = f"{gre:#x}" if 0 <= gre < 1 << 64 else show(gre)
        raise CablingError(f"{ctx}: gre_type {got}: {decodes}")
    queue = d.get("queue")
    return Erspan(src, gre, _int(d, "dscp", ctx, 0, 63, default=0), _int(d, "ttl", ctx, 1, 255, default=64),
                  None if queue is None else _int(d, "queue", ctx, 0, 255),
                  _name(d, "vrf", ctx, required=False), _name(d, "egress_port", ctx, PORT_NAME, required=False))


def _collector(d, ctx, switches) -> Collector:
    d = _dict(d, ctx)
    name = _name(d, "name", ctx)
    ctx = f"{ctx} ({name})"
    _known(d, COLLECTOR_KEYS, ctx)
    sw = d.get("switch")
    if sw is not None and (not isinstance(sw, str) or sw not in [s.name for s in switches]):
        raise CablingError(f"{ctx}: switch {show(sw)} is not in switches")
    port = _name(d, "port", ctx, PORT_NAME, required=False)
    if (sw is None) != (port is None):
        raise CablingError(f"{ctx}: give switch and port together (where the host's NIC is plugged in)")
    ip = _ip(d, "ip", ctx, required=False)
    if sw is None and ip is None:
        raise CablingError(f"{ctx}: needs switch+port (a SPAN destination) or ip (an ERSPAN destination)")
    ifname = _name(d, "ifname", ctx, IFNAME, required=False)
    netns = _name(d, "netns", ctx, required=False)
    if netns is not None and ifname is None:
        raise CablingError(f"{ctx}: netns without ifname: give the interface the host sees this NIC as")
    return Collector(name, sw, port, ip, _int(d, "capacity", ctx, 1, 64, default=1),
                     ifname, netns)


def _rank(d, ctx, switch_names) -> RankPort:
    d = _dict(d, ctx)
    _known(d, RANK_KEYS, ctx)
    rank = _int(d, "rank", ctx, 0, 1 << 20)
    sw = _str(d, "switch", ctx)
    if sw not in switch_names:
        raise CablingError(f"{ctx}: rank {rank} is on switch {show(sw)}, which is not in switches")
    port = _name(d, "port", ctx, PORT_NAME)
    if "ports" not in d:
        return RankPort(rank, sw, port)
    raw = d["ports"]
    if not isinstance(raw, list) or not 1 <= len(raw) <= 4:
        raise CablingError(f"{ctx}: ports must list the 1 to 4 switch ports of the rank's merged NIC")
    ports = tuple(_name({"ports": p}, "ports", ctx, PORT_NAME) for p in raw)
    if ports[0] != port:
        raise CablingError(f"{ctx}: ports[0] is {ports[0]!r}, not port {port!r}: list the NIC's ports in "
                           "NCCL's device order, port first")
    return RankPort(rank, sw, port, ports)


# -- field helpers -------------------------------------------------------------------
def _list(doc, key, where):
    v = doc.get(key)
    if not isinstance(v, list) or not v:
        raise CablingError(f"{where}: {key} must be a non-empty list")
    return v


def _dict(d, ctx):
    if not isinstance(d, dict):
        raise CablingError(f"{ctx}: expected a mapping, got {type(d).__name__}")
    return d


def _str(d, key, ctx, number=False):
    v = d.get(key)
    if v is None or v == "":
        raise CablingError(f"{ctx}: {key} is required")
    if isinstance(v, str):
        return v
    # a port may be a plain number (port: 10); never a float or a boolean, whose text is
    # not what was written (1.10 is 1.1, true is True), nor a list (str() walks an alias
    # bomb whole) or a huge int (str() raises)
    if number and type(v) is int and 0 <= v < 1 << 64:
        return str(v)
    raise CablingError(f"{ctx}: {key} is {show(v)}; expected "
                       + ("a port name (text) or a whole number >= 0" if number else "a name (text)"))


# Names go into file names (a switch's) and into vendor CLI lines and comments (all of
# them): only these characters, so no name can leave --out, start a new CLI line, or
# split into two words. Each vendor's renderer checks its own, narrower set too.
SWITCH_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
PORT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./:@-]{0,63}")
IFNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,14}")   # a kernel interface name (IFNAMSIZ)

# Every key each mapping may hold: any other is refused, as the daemon's config does, so
# a misspelt optional key (`ifnmae`, `max_source_port`) is never silently a default.
TOP_KEYS = ("format", "version", "switches", "collectors", "ranks")
SWITCH_KEYS = ("name", "os", "mode", "max_sessions", "max_source_ports", "directions", "erspan", "netns")
ERSPAN_KEYS = ("src_ip", "gre_type", "dscp", "ttl", "queue", "vrf", "egress_port")
COLLECTOR_KEYS = ("name", "switch", "port", "ip", "capacity", "ifname", "netns")
RANK_KEYS = ("rank", "switch", "port", "ports")


def _known(d: dict, keys, ctx) -> None:
    if why := unknown_keys(ctx, d, keys):
        raise CablingError(why)


def _name(d, key, ctx, pattern=SWITCH_NAME, required=True):
    """A name from the file, refused unless it matches `pattern` (and is not . or ..);
    a port's (PORT_NAME) may be given as a whole number."""
    v = d.get(key)
    if v is None and not required:
        return None
    v = _str(d, key, ctx, number=pattern is PORT_NAME)
    if not pattern.fullmatch(v) or v in (".", ".."):
        raise CablingError(f"{ctx}: {key} {v[:80]!r} is not a safe name: use letters, digits and "
                           f"{''.join(sorted(set(pattern.pattern) & set('_./:@-')))} only, "
                           "starting with a letter or digit")
    return v


def _choice(d, key, allowed, ctx, default=None):
    v = d.get(key, default)
    if not isinstance(v, str) or v not in allowed:
        raise CablingError(f"{ctx}: {key} is {show(v)}; expected one of {', '.join(allowed)}")
    return v


def _int(d, key, ctx, lo, hi, default=None):
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise CablingError(f"{ctx}: {key} is {show(v)}; expected an integer in {lo}..{hi}")
    return v


def _ip(d, key, ctx, required):
    v = d.get(key)
    if v is None:
        if required:
            raise CablingError(f"{ctx}: {key} is required")
        return None
    try:
        if not isinstance(v, str):   # str() of a list walks it whole; an int is no address here
            raise ValueError(v)
        addr = str(ipaddress.ip_address(v))
    except ValueError:
        raise CablingError(f"{ctx}: {key} {show(v)} is not an IP address") from None
    if why := not_a_host(addr):  # a tunnel end is one host
        raise CablingError(f"{ctx}: {key} {addr} is {why}: an ERSPAN tunnel ends at one host's unicast address")
    return addr


def _unique(items, what):
    seen = set()
    for x in items:
        if x in seen:
            shown = repr(x) if isinstance(x, tuple) else show(x)  # (a `!r` here applied to both: "'leaf1'")
            raise CablingError(f"{what} must be unique; {shown} appears twice")
        seen.add(x)


def _tunnel_ends(switches, collectors, where):
    """An ERSPAN tunnel runs from the switch's src_ip to a collector's ip: one IP version
    at both ends (a GRE packet has one IP header), and two different hosts. A switch's
    sessions may go to any collector with an ip, so each pair is checked."""
    for i, sw in enumerate(switches):
        if sw.erspan is None:
            continue
        src = ipaddress.ip_address(sw.erspan.src_ip)
        src = getattr(src, "ipv4_mapped", None) or src
        for j, c in enumerate(collectors):
            if c.ip is None:
                continue
            dst = ipaddress.ip_address(c.ip)
            dst = getattr(dst, "ipv4_mapped", None) or dst
            if dst.version != src.version:
                raise CablingError(f"{where}: switches[{i}] ({sw.name}): erspan.src_ip {src} is IPv{src.version} "
                                   f"but collectors[{j}] ({c.name}) has the IPv{dst.version} ip {dst}: an ERSPAN "
                                   "tunnel's two ends are of one IP version")
            if dst == src:
                raise CablingError(f"{where}: switches[{i}] ({sw.name}): erspan.src_ip {src} is collectors[{j}] "
                                   f"({c.name})'s own ip: the tunnel would start where it ends; give the switch an "
                                   "address of its own")


def _unique_ips(collectors, where):
    """One IP is one capture NIC, so one stream: two collectors with the same ip would be
    counted as two streams (every chunk 'reaches 2') while every ERSPAN copy lands on the
    same host. A NIC that is both a SPAN destination and an ERSPAN one is one entry with
    switch, port and ip, so the format never needs two entries with one address.
    IPv4-mapped IPv6 addresses (::ffff:a.b.c.d) count as their IPv4 address."""
    seen = {}
    for i, c in enumerate(collectors):
        if c.ip is None:
            continue
        a = ipaddress.ip_address(c.ip)
        key = str(getattr(a, "ipv4_mapped", None) or a)
        if key in seen:
            j, other = seen[key]
            raise CablingError(f"{where}: collectors[{j}] ({other.name}) and collectors[{i}] ({c.name}) have "
                               f"the same ip {key}: one NIC is one stream, not two; give each its own address (a NIC "
                               "that is also a SPAN destination is one entry with switch, port and ip)")
        seen[key] = (i, c)
