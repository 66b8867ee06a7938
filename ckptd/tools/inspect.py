"""`ckptd inspect`: what is in a set of captures, as counts and per-QP flows.

inspect_captures(paths) reads every frame with parsers.capfile.open_capture, decodes
it with parsers.roce.decode_frame and returns a plain dict (JSON-serialisable as is):

    files         per file: path, name (the stream's: ckptd.core.streams), frames, roce_frames, icrc_valid, icrc_invalid,
                  classes, other_reasons, linktypes, first/last timestamp, error (or None)
    frames        frames read, all files
    roce_frames   frames to UDP port 4791, whatever their class
    icrc_valid / icrc_invalid   among roce_frames whose ICRC could be checked
    classes       {FrameClass value: count}, every class present (zeros included)
    other_reasons {why: count} for the "other" frames, most frequent first (also per
                  file): "IP protocol 6", "UDP port 53", "IP fragment (GRE)" (a remote
                  mirror session's tunnel fragmented on its way: the frames it wraps are lost)
    clock_ahead_ns  per file, how far its capture clock runs ahead of the first file's
                  (ckptd.core.clock: by the copies they share; 0 within the agreement
                  window or where no copy ties it in), what replay takes off before merging;
                  clock_notes says it in words
    opcodes       {opcode name: count} over roce_frames
    flows         one record per (src IP, dst IP, BTH dest QP), in order of first
                  appearance: src, dst, dest_qp, packets, messages (FIRST/ONLY seen),
                  payload_bytes, opcodes {name: count}, first_psn/last_psn (request
                  packets only: the first seen, the highest), last_ack_psn/last_msn
                  (ACKs), psn_gaps (forward PSN jumps within one file), psn_missing
                  (PSNs those jumps skipped that never came: packets not in the
                  capture), psn_late (PSNs that came after a higher one: reordered, or
                  sent again after a loss) and psn_repeats (PSNs seen again in one
                  file: retransmissions, duplicates), RC/UC only; dma_lengths and imm (hex)
                  (first few, in order), udp_sports, icrc_invalid, files {path: packets},
                  first_ts_ns/last_ts_ns
    tcp           one record per TCP direction (src, sport, dst, dport), in order of
                  first appearance: segments, payload_bytes, syn/fin, missing_bytes
                  (stream bytes no file delivered: the files are merged as mirror
                  copies), and `gloo` when the direction speaks torch.distributed's gloo
                  protocol: the connector's sequence number (its rank), messages by
                  opcode, data messages by collective (allreduce, broadcast, ...), the
                  tag range, and framing_lost (preambles lost in a hole); else null
    errors        capture-file errors ("file: frame N: ..."); the frames before the
                  error are counted, the rest of that file is not read

A flow is one direction of one QP: data flows to the responder's QP, and the ACKs
for it flow back on a flow keyed by the requester's QP.  Only frames whose opcode is
known contribute to flows (an unknown opcode's "dest QP" is not one).
"""
from __future__ import annotations

import contextlib
import os
import stat
from collections import Counter
from pathlib import Path

from ckptd.core.clock import shift_note, stream_shifts
from ckptd.core.psn import PSN_MASK, psn_diff
from ckptd.errors import one_line
from ckptd.transports.gloo.framing import OPCODE_NAMES, SLOT_PREFIXES, GlooFramer
from ckptd.transports.gloo.tcpstream import TcpReassembler
from parsers.capfile import CaptureError, open_capture
from parsers.roce import FrameClass, decode_frame
from parsers.tcp import decode_tcp_frame

MAX_LISTED = 8   # dma lengths / imm values / ports kept per flow: "the first few"
MAX_HOLES = 1 << 16  # PSNs a file's jumps skipped, listed per connection


class _PsnsSeen:
    """The request PSNs one file holds of one connection: the highest, and the PSNs the
    jumps to it skipped that have not come yet (a reordered or resent packet fills its
    hole; a skip of more than MAX_HOLES PSNs is counted, not listed, and stays missing)."""

    def __init__(self, psn: int):
        self.highest, self.holes, self.unlisted = psn, set(), 0

    @property
    def missing(self) -> int:
        return len(self.holes) + self.unlisted

    def add(self, psn: int) -> str:
        """"next", "gap" (a forward jump), "late" (fills a hole) or "repeat" (held already)."""
        step = psn_diff(psn, self.highest)
        if step > 0:
            if step > 1 and step - 1 + len(self.holes) <= MAX_HOLES:
                self.holes.update((self.highest + k) & PSN_MASK for k in range(1, step))
            elif step > 1:
                self.unlisted += step - 1
            self.highest = psn
            return "gap" if step > 1 else "next"
        if psn in self.holes:
            self.holes.discard(psn)
            return "late"
        return "repeat"


class _Flow:
    def __init__(self, src, dst, dest_qp):
        self.src, self.dst, self.dest_qp = src, dst, dest_qp
        self.packets = 0
        self.messages = 0          # FIRST/ONLY opcodes seen (a cut-off start is not counted)
        self.payload_bytes = 0
        self.opcodes = Counter()
        self.first_psn = self.last_psn = None   # request packets only (see add)
        self.last_ack_psn = self.last_msn = None
        self.psn_gaps = 0          # request PSN jumped forward within one file
        self.psn_late = 0          # a PSN a jump skipped, come later (reordered, or sent again)
        self.psn_repeats = 0       # a PSN the file had already held: retransmission, duplicate
        self._seen_in = {}         # path -> _PsnsSeen of that file (two files may be two mirrors)
        self.dma_lengths = []      # RETH DMA lengths, first few, in order
        self.imm = []              # ImmDt raw bytes (hex), first few, in order
        self.sports = []           # UDP source ports seen, first few
        self.icrc_invalid = 0
        self.files = Counter()     # path -> packets
        self.first_ts_ns = self.last_ts_ns = None

    def add(self, d, path, ts_ns):
        self.packets += 1
        self.files[path] += 1
        self.opcodes[d.opcode.name] += 1
        if d.opcode.starts_message:
            self.messages += 1
        # An ACK carries the PSN (and MSN) of the opposite direction's data, so mixing
        # it into this flow's PSN range would be meaningless: keep them apart.
        if d.opcode.is_ack:
            self.last_ack_psn = d.bth.psn
            if d.aeth is not None:
                self.last_msn = d.aeth.msn
        else:
            if self.first_psn is None:
                self.first_psn = d.bth.psn
            if self.last_psn is None or psn_diff(d.bth.psn, self.last_psn) > 0:
                self.last_psn = d.bth.psn  # the highest (24-bit PSNs wrap), not the last to arrive
            # PSN continuity is a property of one RC/UC connection seen by one capture:
            # UD PSNs are per sender (QP 1 hears many), and two files may be two mirrors.
            if d.opcode.transport in ("RC", "UC"):
                seen = self._seen_in.get(path)
                if seen is None:
                    self._seen_in[path] = _PsnsSeen(d.bth.psn)
                else:
                    kind = seen.add(d.bth.psn)
                    self.psn_gaps += kind == "gap"
                    self.psn_late += kind == "late"
                    self.psn_repeats += kind == "repeat"
        self.payload_bytes += d.payload_len or 0
        if d.reth is not None and len(self.dma_lengths) < MAX_LISTED:
            self.dma_lengths.append(d.reth.dma_len)
        if d.immdt is not None and len(self.imm) < MAX_LISTED:
            self.imm.append(d.immdt.raw.hex())
        if d.sport not in self.sports and len(self.sports) < MAX_LISTED:
            self.sports.append(d.sport)
        if d.icrc_ok is False:
            self.icrc_invalid += 1
        if ts_ns is not None:
            self.first_ts_ns = ts_ns if self.first_ts_ns is None else self.first_ts_ns
            self.last_ts_ns = ts_ns

    def as_dict(self):
        return {
            "src": self.src, "dst": self.dst, "dest_qp": self.dest_qp,
            "packets": self.packets, "messages": self.messages,
            "payload_bytes": self.payload_bytes,
            "opcodes": dict(self.opcodes),
            "first_psn": self.first_psn, "last_psn": self.last_psn,
            "last_ack_psn": self.last_ack_psn, "last_msn": self.last_msn,
            "psn_gaps": self.psn_gaps, "psn_missing": sum(v.missing for v in self._seen_in.values()),
            "psn_late": self.psn_late, "psn_repeats": self.psn_repeats,
            "dma_lengths": self.dma_lengths,
            "imm": self.imm,
            "udp_sports": self.sports,
            "icrc_invalid": self.icrc_invalid,
            "files": dict(self.files),
            "first_ts_ns": self.first_ts_ns, "last_ts_ns": self.last_ts_ns,
        }


class _Conversations:
    """TCP directions, reassembled across files (mirror copies) and framed as gloo."""

    def __init__(self):
        self.reasm = TcpReassembler()
        self.framers: dict[tuple, GlooFramer] = {}
        self.stats: dict[tuple, Counter] = {}
        self.gloo: dict[tuple, dict] = {}

    def add(self, data, linktype, origlen, stream: int) -> bool:
        seg, _ = decode_tcp_frame(data, linktype, origlen)
        if seg is None:
            return False
        st = self.stats.setdefault(seg.key, Counter())
        st["segments"] += 1
        st["payload_bytes"] += len(seg.payload)
        for key, piece in self.reasm.feed(seg, stream):
            self._frame(key, piece)
        return True

    def _frame(self, key, piece):
        fr = self.framers.get(key)
        if fr is None:
            d = self.reasm.dirs[key]
            fr = self.framers[key] = GlooFramer(None if not d.syn else bool(d.initiator), lambda h: True)
        g = self.gloo.setdefault(key, {"messages": Counter(), "collectives": Counter(), "tags": []})
        for m in fr.feed(piece):
            h = m.header
            g["messages"][OPCODE_NAMES[h.opcode]] += 1
            if h.is_data:
                g["collectives"][SLOT_PREFIXES.get(h.prefix, hex(h.prefix))] += 1
            t = h.tag
            g["tags"] = [min(g["tags"][0], t), max(g["tags"][1], t)] if g["tags"] else [t, t]

    def records(self) -> list[dict]:
        for key, piece in self.reasm.flush():
            self._frame(key, piece)
        out = []
        for key, st in self.stats.items():
            d = self.reasm.dirs[key]
            fr = self.framers.get(key)
            g = self.gloo.get(key)
            gloo = None
            if fr is not None and not fr.not_gloo and g and g["messages"]:
                gloo = {"sequence": fr.sequence, "messages": dict(g["messages"]),
                        "collectives": dict(g["collectives"]), "tags": g["tags"],
                        "framing_lost": fr.counts["framing_lost"]}
            out.append({"src": key[0], "sport": key[1], "dst": key[2], "dport": key[3],
                        "segments": st["segments"], "payload_bytes": st["payload_bytes"],
                        "syn": d.syn, "fin": d.fin_at is not None,
                        "missing_bytes": sum(e - s for s, e in d.missing()), "gloo": gloo})
        return out


OTHER_SHOWN = 6  # reasons of "other" frames in the table, most frequent first


def _empty_classes():
    return {c.value: 0 for c in FrameClass}


def inspect_captures(paths, names: list[str] | None = None) -> dict:
    """`names`: the streams' names (ckptd.core.streams.stream_names; by default theirs from the
    paths). Each file is opened once: a pipe (stdin, `<(zcat x.pcap.gz)`) read a second
    time for the TCP conversations was empty, or a FIFO waited for a writer for ever, so
    a pipe's TCP frames are kept from the first pass."""
    if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__"):
        paths = [paths]
    paths = [str(p) for p in paths]
    if names is None:
        from ckptd.core.streams import stream_names
        names = stream_names(paths)
    kept: dict[int, list] = {}   # stream -> its TCP frames, for a file that is no regular one
    files, errors = [], []
    flows: dict[tuple, _Flow] = {}
    opcodes = Counter()
    tcp_frames = 0
    for k, path in enumerate(paths):
        with contextlib.suppress(OSError):  # (open_capture below says why)
            if not stat.S_ISREG(os.stat(path).st_mode):
                kept[k] = []
        fi = {"path": path, "name": names[k], "frames": 0, "roce_frames": 0, "icrc_valid": 0, "icrc_invalid": 0,
              "classes": _empty_classes(), "other_reasons": Counter(), "linktypes": {}, "first_ts_ns": None,
              "last_ts_ns": None, "error": None}
        files.append(fi)
        try:
            for fr in open_capture(path):
                fi["frames"] += 1
                lt = str(fr.linktype)
                fi["linktypes"][lt] = fi["linktypes"].get(lt, 0) + 1
                if fr.ts_ns is not None:
                    fi["first_ts_ns"] = fi["first_ts_ns"] if fi["first_ts_ns"] is not None else fr.ts_ns
                    fi["last_ts_ns"] = fr.ts_ns
                d = decode_frame(fr.data, fr.linktype, fr.origlen)
                fi["classes"][d.cls.value] += 1
                if d.cls is FrameClass.OTHER:  # what they were: a fragmented mirror tunnel is data lost
                    fi["other_reasons"][d.reason or "not IP"] += 1
                if not d.is_roce:
                    tcp_frames += 1
                    if k in kept:
                        kept[k].append(((fr.merge_time, k, fr.index), (k, fr)))
                    continue
                fi["roce_frames"] += 1
                if d.icrc_ok is True:
                    fi["icrc_valid"] += 1
                elif d.icrc_ok is False:
                    fi["icrc_invalid"] += 1
                if d.bth is None:
                    continue
                opcodes[d.opcode.name] += 1
                if not d.opcode.known:
                    continue
                key = (str(d.src), str(d.dst), d.bth.dest_qp)
                if key not in flows:
                    flows[key] = _Flow(*key)
                flows[key].add(d, path, fr.ts_ns)
        except (CaptureError, OSError) as e:
            fi["error"] = one_line(e)
            errors.append(one_line(e))

    tcp = _Conversations()
    if tcp_frames:  # the files as mirror copies of one another, merged in capture-time order
        import heapq
        from ckptd.pipeline import file_source
        # the second pass over the regular files (their interfaces were warned of in the
        # first), merged as file_source merges with the pipes' frames kept from the first
        again = [k for k in range(len(paths)) if k not in kept]
        reread = (((fr.merge_time, again[j], fr.index), (again[j], fr))
                  for j, fr in file_source([paths[k] for k in again], [], warn=lambda msg: None))
        for _, (k, fr) in heapq.merge(reread, *kept.values(), key=lambda x: x[0]):
            tcp.add(fr.data, fr.linktype, fr.origlen, k)
    classes = _empty_classes()
    other = Counter()
    for fi in files:
        for k, v in fi["classes"].items():
            classes[k] += v
        other.update(fi["other_reasons"])
        fi["other_reasons"] = dict(fi["other_reasons"].most_common())
    shifts, shifted = stream_shifts(paths)  # what replay would set right before merging
    return {
        "files": files,
        "clock_ahead_ns": shifts,
        "clock_notes": [shift_note(names, *x) for x in shifted],
        "frames": sum(fi["frames"] for fi in files),
        "roce_frames": sum(fi["roce_frames"] for fi in files),
        "icrc_valid": sum(fi["icrc_valid"] for fi in files),
        "icrc_invalid": sum(fi["icrc_invalid"] for fi in files),
        "classes": classes,
        "other_reasons": dict(other.most_common()),
        "opcodes": dict(opcodes),
        "flows": [f.as_dict() for f in flows.values()],
        "tcp": tcp.records(),
        "errors": errors,
    }


def _short_opcode(name: str) -> str:
    # "RC_RDMA_WRITE_LAST_WITH_IMMEDIATE" -> "WRITE_LAST_IMM": keeps the table narrow
    return (name.replace("RDMA_", "").replace("_WITH_IMMEDIATE", "_IMM")
            .replace("RC_", "").replace("ACKNOWLEDGE", "ACK"))


def _table(headers, rows) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    fmt = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()
    return [fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def format_inspect(result: dict) -> str:
    """Human-readable summary, like `tshark -z conv` for RoCE QPs and TCP/gloo."""
    out = []
    for fi in result["files"]:
        named = "" if fi.get("name") in (None, Path(fi["path"]).stem) else f" (stream {fi['name']})"
        line = (f"{fi['path']}{named}: {fi['frames']} frames, {fi['roce_frames']} RoCEv2, "
                f"ICRC {fi['icrc_valid']} ok / {fi['icrc_invalid']} bad")
        out.append(line + (f"  ERROR: {fi['error']}" if fi["error"] else ""))
    out.append("")
    out.append(f"Total: {result['frames']} frames, {result['roce_frames']} RoCEv2 (UDP/4791), "
               f"ICRC valid {result['icrc_valid']}, invalid {result['icrc_invalid']}")
    out.append("Classes: " + ", ".join(f"{k} {v}" for k, v in result["classes"].items() if v))
    if result["other_reasons"]:
        shown = list(result["other_reasons"].items())
        out.append("Other: " + ", ".join(f"{why} {n}" for why, n in shown[:OTHER_SHOWN])
                   + (f", {len(shown) - OTHER_SHOWN} more reasons (--json lists them)" if len(shown) > OTHER_SHOWN else ""))
    out += [f"Clock: {note}" for note in result["clock_notes"]]
    if result["opcodes"]:
        out.append("Opcodes: " + ", ".join(f"{_short_opcode(k)} {v}"
                                           for k, v in sorted(result["opcodes"].items())))
    if result["flows"]:
        out.append("")
        out.append("RoCEv2 flows (one direction of one QP)")
        rows = []
        for f in result["flows"]:
            ops = " ".join(f"{_short_opcode(k)}:{v}" for k, v in sorted(f["opcodes"].items()))
            dma = ",".join(map(str, f["dma_lengths"][:4])) + (",..." if len(f["dma_lengths"]) > 4 else "")
            rows.append([f["src"], f["dst"], f["dest_qp"], f["packets"], f["messages"],
                         f["payload_bytes"],
                         "" if f["first_psn"] is None else f"{f['first_psn']}-{f['last_psn']}",
                         f["psn_missing"] or "", f["icrc_invalid"] or "", dma, ops])
        out += _table(["src", "dst", "QP", "pkts", "msgs", "bytes", "PSN", "lost", "badICRC",
                       "DMA lengths", "opcodes"], rows)
    if result.get("tcp"):
        out.append("")
        # (the sequence number a connecting side presents is its rank in a gloo job; without a
        # plan inspect cannot tell whether it is one: "gloo rank 7" in a 3-rank job misled)
        out.append("TCP conversations (one direction each; gloo: torch.distributed's gloo protocol, "
                   "seq: the sequence number the connecting side presented, its rank in a job)")
        rows = []
        for c in result["tcp"]:
            g = c["gloo"]
            what = "" if g is None else (
                f"gloo seq {g['sequence']} " if g["sequence"] is not None else "gloo ") + \
                " ".join(f"{k}:{v}" for k, v in sorted(g["collectives"].items())) + \
                (f" tags {g['tags'][0]}-{g['tags'][1]}" if g["tags"] else "") + \
                (f" framing lost {g['framing_lost']}x" if g["framing_lost"] else "")
            rows.append([f"{c['src']}:{c['sport']}", f"{c['dst']}:{c['dport']}", c["segments"],
                         c["payload_bytes"], c["missing_bytes"] or "", what])
        out += _table(["src", "dst", "segs", "bytes", "missing", "gloo"], rows)
    if result["errors"]:
        out.append("")
        out += [f"error: {e}" for e in result["errors"]]
    return "\n".join(out) + "\n"
