"""Which NCCL algorithm and protocol a job's allreduce can run with, and refusing the
ones ckptd cannot decode.

ckptd rebuilds gradients from ring allreduce only: in Tree, NVLS and CollNet the final
values travel other paths (tree edges, NVLink multicast, the switch's SHARP
aggregation), and nothing in a ring schedule says where their bytes go. NCCL picks
the algorithm and protocol per call from its tuning model unless the job restricts
them with NCCL_ALGO / NCCL_PROTO, so a plan is only exact when those settings leave
one choice. These checks run on a plan's ring section and on NCCL INFO logs
(ckptd.tools.nccl_log); the traffic checks are in ckptd.transports.roce.flows.
"""
from __future__ import annotations

from ckptd.errors import CkptdError

# src/init.cc:40-41@v2.19.4-1 and src/init.cc:44-46@v2.27.5-1 (PAT added in 2.23).
FUNCTIONS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")
ALGORITHMS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
PROTOCOLS = ("LL", "LL128", "Simple")
PROTOCOL_NAMES = {"LL": "ll", "LL128": "ll128", "Simple": "simple"}


class CollectiveRefused(CkptdError, ValueError):
    """A job setting or traffic that is not ring allreduce (or not one protocol): the
    message names the cause and the job setting that fixes it."""


def enabled(spec: str | None, elems: tuple[str, ...], function: str = "AllReduce") -> set[str]:
    """The elements NCCL enables for `function` under an NCCL_ALGO / NCCL_PROTO value.

    src/graph/tuning.cc:53-120@v2.27.5-1 parseList: ';'-separated entries, each an
    optional 'function:' prefix (only the first entry may lack one, and it applies
    to every function) and a ','-list of names, case-insensitive; a leading '^'
    enables all but the names. An entry resets the list of the functions it names.
    2.19 (tuning.cc:34@v2.19.4-1) knows only the unprefixed form, which this reads
    the same way. None (unset): everything."""
    on = set(elems)
    if spec is None:
        return on
    for i, entry in enumerate(spec.split(";")):
        prefix, _, names = entry.rpartition(":")
        if not prefix and i > 0:
            raise CollectiveRefused(f"NCCL setting {spec!r}: every entry but the first needs a 'function:' prefix")
        if prefix and prefix.lower() not in {f.lower() for f in FUNCTIONS}:
            raise CollectiveRefused(f"NCCL setting {spec!r}: unknown function {prefix!r}")
        if prefix and prefix.lower() != function.lower():
            continue
        negate = names.startswith("^")
        listed = set()
        for name in names.lstrip("^").split(","):
            match = [e for e in elems if e.lower() == name.strip().lower()]
            if not match:
                raise CollectiveRefused(f"NCCL setting {spec!r}: unknown name {name!r} (one of {', '.join(elems)})")
            listed.add(match[0])
        on = set(elems) - listed if negate else listed
    return on


def check_allreduce_algorithm(algo: str | None, *, nnodes: int | None = None, nvls_channels: int | None = None,
                              collnet: bool | None = None, where: str = "") -> None:
    """Refuse an NCCL_ALGO that lets NCCL run allreduce as anything but Ring.

    NCCL disables some algorithms itself (src/graph/tuning.cc:442-451@v2.27.5-1):
    NVLSTree on one node; CollNet unless CollNet is enabled, and NVLS across nodes
    with it; NVLS needs NVLS channels (src/init.cc "nvls channels" count). What is
    not known (None) is assumed possible. PAT never runs AllReduce
    (src/graph/tuning.cc:259@v2.27.5-1)."""
    on = enabled(algo, ALGORITHMS) - {"PAT"}
    if nnodes == 1:
        on.discard("NVLSTree")
    if collnet is False:
        on -= {"CollNetDirect", "CollNetChain"}
        if nnodes is not None and nnodes > 1:
            on.discard("NVLS")
    if nvls_channels == 0:
        on -= {"NVLS", "NVLSTree"}
    others = [a for a in ALGORITHMS if a in on and a != "Ring"]
    setting = "NCCL_ALGO is not set" if algo is None else f"NCCL_ALGO={algo}"
    if others:
        raise CollectiveRefused(f"{where}{setting}: NCCL may run allreduce as {'/'.join(others)}, which "
                                "ckptd cannot decode (only ring allreduce puts every final value on ring "
                                "links); run the job with NCCL_ALGO=Ring")
    if "Ring" not in on:
        raise CollectiveRefused(f"{where}{setting} leaves allreduce no algorithm ckptd decodes; "
                                "run the job with NCCL_ALGO=Ring")


def allreduce_protocol(proto: str | None, where: str = "") -> str:
    """The one protocol NCCL_PROTO leaves allreduce (ckptd's name: simple, ll, ll128);
    refused when several remain, since NCCL then picks per message size
    (src/enqueue.cc:1791 topoGetAlgoInfo@v2.27.5-1) and the plan could not say which."""
    on = enabled(proto, PROTOCOLS)
    if len(on) != 1:
        setting = "NCCL_PROTO is not set" if proto is None else f"NCCL_PROTO={proto}"
        raise CollectiveRefused(f"{where}{setting}: NCCL picks the protocol of each allreduce among "
                                f"{'/'.join(p for p in PROTOCOLS if p in on)} by size; run the job with "
                                "NCCL_PROTO=Simple (or LL, or LL128) so that the plan names the one it uses")
    return PROTOCOL_NAMES[on.pop()]
