"""The names of capture streams given as paths: replay's `stream NAME:` and
coverage[NAME=...] lines, inspect's. One rule for every command that reads captures
(`--names A,B,C` overrides it in ckptd.cli). And what a stream's frames lost before any
placing, in words (stream_faults)."""
from __future__ import annotations

import re
from pathlib import Path

STDIN = "-"                # a capture argument that means stdin (as tcpdump -r - and tshark -r -)
STDIN_PATH = "/dev/stdin"  # what `-` is read as: a pipe is read like a FIFO, a redirected file mapped
_FD_PATH = re.compile(r"/(dev|proc/[^/]+)/fd/[0-9]+")  # bash/zsh process substitution, <(zcat x.gz)


def stream_names(paths: list[str]) -> list[str]:
    """One name per path, all distinct:

    - a file or named FIFO: its stem (m0.pcap -> m0), as always;
    - `-` or /dev/stdin: `stdin`;
    - /dev/fd/N, /proc/PID/fd/N (`<(zcat x.pcap.gz)`): `streamK`, K its 1-based position
      among the captures (the fd number, 63, says nothing and differs between shells);
    - stems given twice (m0/mirror.pcap m1/mirror.pcap) take as many of their parent
      directories as tell them apart (m0/mirror, m1/mirror): two per-stream lines of one
      name cannot be told apart, and the directory is what the user told them apart by;
    - any name still taken (the same path spelt alike, `stdin.pcap` and `-`, a file
      stream2.pcap next to a positional stream2): the later ones get `#K`, K their 1-based
      position. Everything depends on the arguments alone, not on the files, so the same
      command line always names its streams alike."""
    texts = [str(p) for p in paths]
    positional = {k for k, t in enumerate(texts) if t in (STDIN, STDIN_PATH) or _FD_PATH.fullmatch(t)}
    out = []
    for k, t in enumerate(texts):
        if t in (STDIN, STDIN_PATH):
            out.append("stdin")
        elif k in positional:
            out.append(f"stream{k + 1}")
        else:
            out.append(Path(t).stem or f"stream{k + 1}")
    # the same stem twice: as many trailing path components as tell the group apart (a
    # stem holds no '/', so a group's new names never meet another group's stem)
    for stem in sorted({n for n in out if out.count(n) > 1}):
        group = [k for k, n in enumerate(out) if n == stem and k not in positional]
        parts = {k: Path(texts[k]).with_suffix("").parts for k in group}
        for depth in range(2, max((len(v) for v in parts.values()), default=0) + 1):
            tails = ["/".join(parts[k][-depth:]) for k in group]
            if len(set(tails)) == len(tails):
                for k, t in zip(group, tails):
                    out[k] = t
                break
    seen: set[str] = set()
    for k, n in enumerate(out):
        while n in seen:
            n += f"#{k + 1}"
        out[k] = n
        seen.add(n)
    return out


def stream_faults(stream: str, classes) -> dict[str, str]:
    """Frames of a stream whose copies were lost before any placing, {class: one line}
    from its class counts (cmd_replay warns each, the daemon logs each kind once per
    stream): only the stream's coverage fell, and nothing said why.

    - truncated: captured with fewer bytes than the frame carried (a snap length below the
      frames', or a mirror session that truncates);
    - bad_icrc: RoCE frames whose ICRC fails (damaged, or rewritten on the way);
    - gre_fragment: IP fragments of a remote mirror session's GRE packets
      (parsers.roce.RoceFrame.tunnel_fault): a router on the way has a smaller MTU;
    - gre_unopened: GRE carrying no mirror the decoder opens."""
    out = {}
    if classes.get("truncated"):
        out["truncated"] = (f"stream {stream}: {classes['truncated']} frames were cut short (captured with fewer bytes "
                            "than they carried: a snap length below the frames', or a mirror session that truncates): "
                            "the copies in them are lost; capture whole frames (tcpdump -s 0)")
    if classes.get("bad_icrc"):
        out["bad_icrc"] = (f"stream {stream}: {classes['bad_icrc']} RoCE frames failed their ICRC (damaged on the "
                           "way to the capture, or rewritten in a field the ICRC covers): their copies are not used")
    if classes.get("gre_fragment"):
        out["gre_fragment"] = (
            f"stream {stream}: {classes['gre_fragment']} frames were IP fragments of GRE packets (a remote mirror "
            "session's tunnel): the mirrored frames in them are lost. The path from the switch to this host "
            "fragments the tunnel: its MTU must take a mirrored frame and the tunnel's headers (50-70 bytes more)")
    if classes.get("gre_unopened"):
        out["gre_unopened"] = (f"stream {stream}: {classes['gre_unopened']} GRE packets carried no mirror ckptd "
                               "opens (`ckptd inspect` lists why, under Other)")
    return out
