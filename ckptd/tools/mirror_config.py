"""`ckptd mirror-config`: choose the switch ports to mirror and write their configuration.

The selection (switch_config.select) and the vendor syntaxes (switch_config.sonic,
eos, nxos, comware, linux_render) live in switch_config/; this module is the command:
read the plan and the cabling file, select, render every file in memory, and only
then write them, so that a request that cannot be met writes nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_INPUT = 2        # the plan or the cabling file is unreadable or inconsistent
EXIT_UNMET = 3        # the request cannot be met with this cabling (nothing written)

DESCRIPTION = """\
Choose which switch ports to mirror, in which direction and to which checkpoint host,
so that every chunk of every channel's ring reaches at least --min-streams capture
streams and at least --links distinct directed links per ring are mirrored; then
write the mirror configuration of every switch involved.

Why it works: in the allgather phase the link r -> next(r) carries the final value
of every chunk except next(r)'s, so 2 mirrored links of a ring see every chunk and 3
see every chunk at least twice. A switch port's RX (what the rank sends) is the link
rank -> next(rank) in every channel; its TX is prev(rank) -> rank. A "stream" is one
collector (capture NIC): copies reaching the same collector drop together, so it is
streams that are counted, not copies. A collector takes `capacity` link directions
(default 1: a ring link runs at line rate, so two of them would overrun a port of
the same speed).

Writes into --out: <switch>.config_db.json (SONiC CONFIG_DB MIRROR_SESSION table,
checked against sonic-mirror-session.yang), <switch>.eos.cfg (Arista EOS),
<switch>.nxos.cfg (Cisco NX-OS), <switch>.comware.cfg (H3C Comware),
<switch>.tc.sh and <switch>.tc.json (Linux bridge: tc mirred rules),
selection.json (sessions, links and streams per chunk per channel, and the plan's
`mirrors` entries), and daemon-interfaces.yaml (the `interfaces` of `ckptd run`'s
config for every collector that gives its `ifname`: one stream per collector, or per
ERSPAN session where several reach one collector and each carries an ID we set, as
NX-OS's erspan-id). The cabling file format is in docs/MIRRORS.md.

Exit status: 0 written; 2 the plan or cabling file is wrong; 3 the request cannot be
met (the message names each channel's uncovered chunks and what blocked every
further mirror) and nothing was written."""


def add_subparser(subparsers) -> argparse.ArgumentParser:
    # the command line's path type: an empty --out wrote every file into the current
    # directory, an empty --plan or --cabling read as '.' ("Is a directory")
    from ckptd.cli import _path
    p = subparsers.add_parser(
        "mirror-config", help="choose the ports to mirror and write switch mirror configs",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", type=_path, required=True, help="the job's plan (JSON, docs/PLAN.md): ranks and ring orders")
    p.add_argument("--cabling", type=_path, required=True,
                   help="cabling file, YAML or JSON (docs/MIRRORS.md): switches and their mirror limits, "
                        "collectors, and each rank's switch port")
    p.add_argument("--links", type=int, default=3,
                   help="distinct directed links to mirror per ring (default 3; capped at the ring size)")
    p.add_argument("--min-streams", type=int, default=2,
                   help="streams (collectors) every chunk must reach (default 2: one lost copy is "
                        "recovered from another stream)")
    p.add_argument("--vendor", default="auto",
                   help="'auto' (each switch in its own os's syntax), 'all', or a comma list of "
                        "sonic,eos,nxos,comware,linux")
    p.add_argument("--out", type=_path, help="directory to write the configuration files into (required unless --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="print the selection, write nothing")
    p.set_defaults(func=run)
    return p


def run(a) -> int:
    if a.out is None and not a.dry_run:
        print("error: --out is required (the directory to write into), or --dry-run to write nothing",
              file=sys.stderr)
        return EXIT_INPUT
    if a.out is not None and not a.dry_run:
        from ckptd.cli import out_directory
        out_directory(a.out)  # before the selection is printed as if it would be written
    from ckptd.core.plan import PlanError, load_plan
    from switch_config.cabling import CablingError, load_cabling
    from switch_config.common import RenderError
    from switch_config.daemon_interfaces import daemon_interfaces
    from switch_config.render import RENDERERS, render_all
    from switch_config.select import SelectionError, network_links, select_mirrors

    try:
        plan = load_plan(a.plan, check_optimizer=False)  # the ring and ranks only: no torch
        cabling = load_cabling(a.cabling)
    except (PlanError, CablingError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return EXIT_INPUT
    extra = sorted(r.rank for r in cabling.ranks if r.rank >= plan.nranks)
    if extra:
        print(f"error: {a.cabling} places ranks {extra}, but the plan has ranks 0..{plan.nranks - 1}: "
              "is it the cabling of another job?", file=sys.stderr)
        return EXIT_INPUT
    for r in cabling.ranks:
        if len(r.switch_ports) != plan.ring.ndevs:
            print(f"error: {a.cabling}: rank {r.rank} has {len(r.switch_ports)} switch port(s), but the plan's "
                  f"NICs are merged from {plan.ring.ndevs} ports (ranks[].ports): list every port's switch "
                  "port in ports, NCCL's device order", file=sys.stderr)
            return EXIT_INPUT
    vendors = a.vendor if a.vendor in ("auto", "all") else [v.strip() for v in a.vendor.split(",") if v.strip()]
    bad = [f"--{k} must be at least 1, not {v}" for k, v in (("links", a.links), ("min-streams", a.min_streams)) if v < 1]
    bad += [f"--vendor: {v} stands alone, not in a list" if v in ("auto", "all") else
            f"--vendor: unknown vendor {v!r} (known: {', '.join(RENDERERS)}, or auto, all)"
            for v in (vendors if isinstance(vendors, list) else []) if v not in RENDERERS]
    if bad or vendors == []:
        print("error: " + "; ".join(bad or ["--vendor names no vendor"]), file=sys.stderr)
        return EXIT_INPUT
    try:
        network = network_links(plan) if not plan.one_host_per_rank else None
        sel = select_mirrors(plan.ring, cabling, links=a.links, min_streams=a.min_streams, network=network)
        files = render_all(sel, vendors)
    except (SelectionError, RenderError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return EXIT_UNMET
    summary = sel.to_json()
    daemon, notes = daemon_interfaces(sel)
    if daemon is not None:
        files["daemon-interfaces.yaml"] = daemon
    summary["files"] = sorted({*files, "selection.json"})  # what this run wrote: the next run's stale ones
    files["selection.json"] = compact_json(summary)
    print(format_summary(summary))
    for n in notes:
        print(f"note: {n}")
    if a.dry_run:
        print("dry run: nothing written")
        return 0
    out = Path(a.out)
    for name in files:  # the names are checked (switch_config.cabling): this holds anyway
        if Path(name).name != name or name.startswith("."):
            print(f"error: refusing to write {name!r}: not a plain file name inside {out}", file=sys.stderr)
            return EXIT_INPUT
    stale = _earlier_files(out) - set(files)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in sorted(files.items()):
            _write_new(out / name, text)
            print(f"wrote {out / name}")
        for name in sorted(stale):
            (out / name).unlink(missing_ok=True)
            print(f"removed {out / name} (an earlier run's: not in this selection)")
    except OSError as e:
        print(f"error: cannot write into {out}: {e}", file=sys.stderr)
        return EXIT_INPUT
    return 0


def _earlier_files(out: Path) -> set[str]:
    """The files an earlier run wrote into `out`, as its selection.json lists them. Left
    there, a switch had two configurations in `out` (an earlier run's eos.cfg beside this
    run's config_db.json), and nothing said which was current. A selection.json that is
    not ckptd's, or of a version that listed no files, names none."""
    try:
        doc = json.loads((out / "selection.json").read_text())
    except (OSError, ValueError):
        return set()
    names = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(names, list):
        return set()
    return {n for n in names if isinstance(n, str) and Path(n).name == n and not n.startswith(".")
            and (out / n).is_file()}


def _write_new(path: Path, text: str) -> None:
    """Write (replacing) a file, never through a symlink planted at its name."""
    import os
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def compact_json(doc) -> str:
    """Indented JSON with every list of plain values on one line (readable, diffable)."""
    def inline(x):
        return isinstance(x, list) and all(not isinstance(v, (list, dict)) for v in x)

    def dump(x, depth):
        pad = " " * depth
        if isinstance(x, dict) and x:
            items = [f'{pad} {json.dumps(k)}: {dump(v, depth + 1)}' for k, v in x.items()]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}"
        if isinstance(x, list) and x and not inline(x):
            return "[\n" + ",\n".join(f"{pad} {dump(v, depth + 1)}" for v in x) + f"\n{pad}]"
        return json.dumps(x)
    return dump(doc, 0) + "\n"


def format_summary(doc: dict) -> str:
    lines = []
    for s in doc["sessions"]:
        lines.append(f"session {s['name']} on {s['switch']}: {s['type']} {s['direction'].upper()} "
                     f"{','.join(s['source_ports'])} (rank {','.join(map(str, s['ranks']))}) "
                     f"-> {s['collector']} ({s['destination']})")
    for ch in doc["channels"]:
        worst = min(len(v) for v in ch["streams_per_chunk"].values())
        lines.append(f"channel {ch['channel']} ring {'>'.join(map(str, ch['ring']))}: mirrored links "
                     f"{' '.join(ch['links'])}; every chunk reaches >= {worst} stream(s)")
    lines += [f"note: {n}" for n in doc["notes"]]
    return "\n".join(lines)
