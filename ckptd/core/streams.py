"""The names of capture streams given as paths: replay's `stream NAME:` and
coverage[NAME=...] lines, inspect's. One rule for every command that reads captures
(`--names A,B,C` overrides it in ckptd.cli)."""
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
