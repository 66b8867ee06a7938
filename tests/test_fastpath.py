"""The fast path (cython_ext/batch.pyx driven by ckptd/fast/pipeline.py) against the reference.

The pure-Python pipeline is the judge: on the same captures both must produce identical
IterationAssembly buffers, coverage (total and per stream), conflicts, packet and byte
counts, extractor counters and examples, frame classes, per-stream loss, reports, and
even *when* things happen (the frame at which each bucket is stepped and each iteration
finalized).
"""
from __future__ import annotations

import heapq
import os
import random
import resource
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from ckptd.fast.batches import (ReaderStage, _merged, _pcap_chunks, batch_from_frames, load_capture, load_captures,
                                reader_cpu, stream_batches)
from ckptd.core.checkpoint import load_checkpoint
from ckptd.transports.roce.extract import ll_unpack
from ckptd.fast.icrc import crc_choices, fold_constants, icrc_checker, reduction_constants
from ckptd.testing.tunnel import gre_tunnel
from ckptd.fast.pipeline import FastExtractor, FastPipeline, fast_replay, trusted_frame
from ckptd.pipeline import Pipeline, ReplayOptions, file_source, replay
from ckptd.core.plan import load_plan
from cython_ext import batch as kernel
from cython_ext.filemap import MappedFiles
from parsers import icrc
from parsers.capfile import CapturedFrame, open_capture
from parsers.pcap import ChunkedFile, PcapWriter
from parsers.roce import FrameClass, decode_frame

from helpers import pcaps, synth

REPO = Path(__file__).resolve().parents[1]

FLOWCHECK_PLAN = Path(__file__).parent / "data" / "flowcheck_allreduce_plan.json"


# -- running both and comparing -------------------------------------------------------------
def _record(pipe):
    """Record on a pipeline (the reference, or the one inside the fast path) every
    finalized assembly and the frame count at each bucket step and finalize."""
    inner = getattr(pipe, "pipeline", pipe)
    pipe.snaps, pipe.events = [], []

    def frames():
        return sum(c["frames"] for c in inner.classes)

    finalize, apply_ready = inner._finalize, inner._apply_ready_buckets

    def _finalize(asm, **kw):
        pipe.snaps.append(dict(
            it=asm.iteration, data=[d.copy() for d in asm.data], cov=[c.copy() for c in asm.covered],
            by_stream=[[c.copy() for c in maps] for maps in asm.by_stream],
            conflicts=list(asm.conflicts), packets=asm.packets, bytes=asm.bytes,
            ncovered=asm.ncovered, bucket_covered=list(asm.bucket_covered)))
        pipe.events.append(("finalize", asm.iteration, frames()))
        finalize(asm, **kw)

    def _apply_ready_buckets(asm):
        before = inner.next_bucket
        apply_ready(asm)
        pipe.events.extend(("step", asm.iteration, b, frames()) for b in range(before, inner.next_bucket))

    inner._finalize, inner._apply_ready_buckets = _finalize, _apply_ready_buckets
    return pipe


def run_both(plan, paths, start_path=None, trust_icrc=False, abandon=False, frames=None, dumps=None,
             chunk_bytes=None, **opts):
    """(reference pipeline, fast pipeline) after replaying the same captures; `dumps`:
    (reference's, fast one's) gradient dump directories. With chunk_bytes the fast one
    reads the files in chunks of that size on the reader thread (many Batches, their
    ICRCs checked there), else all at once (one Batch, ICRCs checked by the kernel)."""
    # Frame-exact equality (the same frame finalizes each iteration in both) holds with
    # commits at once; with the agreement window the fast path commits at the batch end
    # after the window passed, and tests/test_agreement.py compares the outcomes.
    opts.setdefault("agree_window_ms", 0)

    def new(cls, dump=None, **kw):
        start = load_checkpoint(start_path) if start_path else None
        return _record(cls(plan, start, len(paths), ReplayOptions(dump_gradients=dump, **opts), **kw))

    ref = new(Pipeline, dumps and str(dumps[0]))
    src = frames() if frames else file_source(paths, ref.errors)
    if trust_icrc:  # the reference with the ICRC not looked at
        src = ((s, trusted_frame(fr)) for s, fr in src)
    ref.run(src, abandon=abandon)
    fast = new(FastPipeline, dumps and str(dumps[1]), trust_icrc=trust_icrc)
    if frames:
        fast.run(frames(), abandon=abandon)
    elif chunk_bytes:  # as fast_replay reads: ICRCs checked on the reader's thread
        batches = stream_batches(paths, fast.errors, chunk_bytes, None if trust_icrc else icrc_checker())
        for batch in ReaderStage(batches):
            fast.run_batch(batch)
        fast.finish(abandon)
    else:
        batch, errors = load_captures(paths)
        fast.errors += errors
        fast.run_batch(batch)
        fast.finish(abandon)
    return ref, fast


def assert_same(ref, fast):
    assert len(ref.snaps) == len(fast.snaps)
    for a, b in zip(ref.snaps, fast.snaps):
        for key in ("it", "conflicts", "packets", "bytes", "ncovered", "bucket_covered"):
            assert a[key] == b[key], (a["it"], key)
        for x, y in zip(a["cov"], b["cov"]):
            np.testing.assert_array_equal(x, y, err_msg=f"iteration {a['it']} cov")
        # the data where some stream delivered it: the kernel leaves the rest of a reused
        # buffer as it was (nothing reads it), the reference's is zeros
        for x, y, c in zip(a["data"], b["data"], a["cov"]):
            have = np.unpackbits(c, bitorder="little")[:len(x)].astype(bool)
            np.testing.assert_array_equal(x[have], y[have], err_msg=f"iteration {a['it']} data")
        for ma, mb in zip(a["by_stream"], b["by_stream"]):
            for x, y in zip(ma, mb):
                np.testing.assert_array_equal(x, y, err_msg=f"iteration {a['it']} by_stream")
    assert ref.events == fast.events
    assert ref.extract.counters == fast.extract.counters
    assert ref.extract.examples == fast.extract.examples
    assert ref.extract.flag_base == fast.extract.flag_base
    assert ref.classes == fast.classes
    assert ref.late == fast.late
    assert ref.errors == fast.errors
    assert ref.highest == fast.highest and ref.done == fast.done

    def rows(p):
        return [(r.iteration, r.status, r.packets, r.grad_bytes, r.coverage, r.loss, r.missing,
                 r.note, r.exact) for r in p.reports]
    assert rows(ref) == rows(fast)


def synth_pair(tmp_path, trust_icrc=False, shadow=True, chunk_bytes=None, **kw):
    kw.setdefault("iterations", 3)
    synth(tmp_path, **kw)
    plan = load_plan(tmp_path / "plan.json")
    opts = dict(reference=str(tmp_path / "reference")) if shadow else {}
    return run_both(plan, pcaps(tmp_path), tmp_path / "init.pt" if shadow else None,
                    trust_icrc=trust_icrc, chunk_bytes=chunk_bytes, **opts)


# -- the kernel's pieces ---------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["zlib", "clmul", "vclmul"])
def test_crc32_matches_zlib(impl):
    if impl != "zlib" and impl not in crc_choices():
        pytest.skip(f"this CPU cannot run the {impl} CRC")
    rng = random.Random(1)
    k = kernel.CRC_IMPLS.index(impl)
    for n in list(range(0, 300)) + [1024, 4095, 4096, 4097, 65536 + 7]:
        data = rng.randbytes(n)
        init = rng.getrandbits(32)
        assert kernel.crc32(np.frombuffer(data, np.uint8), init, k) == zlib.crc32(data, init), n


def test_fold_and_reduction_constants_are_what_the_math_says():
    for distance, pair in kernel.FOLD_CONSTANTS.items():
        if pair != (0, 0):  # 0: not an x86 build
            assert pair == fold_constants(distance)
    if kernel.REDUCTION_CONSTANTS[0]:
        assert kernel.REDUCTION_CONSTANTS == reduction_constants()


def test_kernel_constants_equal_the_references():
    """cython_ext/wire.pxd declares the wire constants once for the kernel; each must be
    its Python twin's value."""
    from ckptd.core import psn, schedule
    from ckptd.transports.roce import flows
    from parsers import bth, ethernet, frame, gre, ipv4, udp
    w = kernel.WIRE
    assert {k: w[k] for k in w if k.startswith("LT_")} == {
        "LT_" + name[len("LINKTYPE_"):]: getattr(frame, name) for name in dir(frame)
        if name.startswith("LINKTYPE_")}
    assert (w["ETH_TYPE_IPV4"], w["ETH_TYPE_IPV6"]) == (ethernet.ETH_TYPE_IPV4, ethernet.ETH_TYPE_IPV6)
    assert set(w["TPIDS"]) == ethernet.VLAN_TPIDS
    assert (w["PROTO_UDP"], w["PROTO_GRE"], w["ROCEV2_PORT"]) == (ipv4.PROTO_UDP, gre.PROTO_GRE, udp.ROCEV2_PORT)
    for name in ("WRITE_FIRST", "WRITE_MIDDLE", "WRITE_LAST", "WRITE_LAST_IMM", "WRITE_ONLY", "WRITE_ONLY_IMM"):
        assert w[name] == getattr(flows, name), name
    assert w["ACKNOWLEDGE"] == flows.ACK
    assert (w["PSN_MASK"], w["PSN_MOD"]) == (psn.PSN_MASK, psn.PSN_MOD)
    assert (w["LL_LINE"], w["LL_DATA_PER_LINE"]) == (schedule.LL_LINE, schedule.LL_DATA_PER_LINE)
    assert (w["UDP_LEN"], w["BTH_LEN"]) == (udp.UDP.LEN, bth.BTH.LEN)
    from parsers import erspan
    assert (w["GRE_PROTO_ERSPAN"], w["GRE_PROTO_ERSPAN3"], w["GRE_PROTO_TEB"]) == (
        erspan.GRE_PROTO_ERSPAN, erspan.GRE_PROTO_ERSPAN3, erspan.GRE_PROTO_TEB)
    assert (w["ERSPAN2_LEN"], w["ERSPAN3_LEN"], w["ERSPAN3_PLATFORM_LEN"]) == (
        erspan.ERSPAN2.LEN, erspan.ERSPAN3.LEN, erspan.ERSPAN3Platform.LEN)


def test_stream_newest_is_each_streams_latest_time_and_refuses_a_foreign_stream():
    k = kernel.BatchKernel(3)
    stream = np.array([2, 0, 2, 0, 2], np.int32)
    ts = np.array([50, 7, 40, 9, 60], np.int64)
    assert k.stream_newest(stream, ts) == [9, 0, 60]  # stream 1 sent nothing: 0
    assert k.stream_newest(stream[::2], ts[::2]) == [0, 0, 60]  # strided views too
    with pytest.raises(IndexError, match="frame 1: stream 3"):
        k.stream_newest(np.array([0, 3], np.int32), np.array([1, 2], np.int64))


@pytest.mark.parametrize("lines", [0, 1, 2, 3, 64, 255, 256])
def test_ll_unpack_matches_reference(lines):
    rng = np.random.default_rng(lines)
    words = rng.integers(0, 2**32, (lines, 4), dtype=np.uint32)
    words[:, 1] = words[:, 3] = 77
    out = np.zeros(lines * 8, np.uint8)
    assert kernel.ll_unpack_into(words.view(np.uint8).reshape(-1), out, 77)
    data, flag, ok = ll_unpack(words.tobytes(), 77)
    assert ok and out.tobytes() == data
    if lines:
        words[lines // 2, 3] = 78  # one flag off, anywhere
        assert not kernel.ll_unpack_into(words.view(np.uint8).reshape(-1), out, 77)
        assert not ll_unpack(words.tobytes(), 77)[2]


def test_merge_order_is_heapq_merge_even_when_time_goes_back():
    rng = random.Random(3)
    streams = [[rng.randrange(50) for _ in range(rng.randrange(0, 40))] for _ in range(4)]
    want = [(k, i) for _, k, i in heapq.merge(
        *[[(t, k, i) for i, t in enumerate(ts)] for k, ts in enumerate(streams)],
        key=lambda x: x)]
    which, idx = kernel.merge_order([np.array(ts, np.int64) for ts in streams])
    assert list(zip(which.tolist(), idx.tolist())) == want


# -- decode: every frame gets decode_frame's class ---------------------------------------------
def _reicrc(frame: bytearray, ip_off: int, udp_off: int):
    end = len(frame) - 4
    frame[end:] = icrc.pack(icrc.compute(frame, ip_off, udp_off, end))


def _variants(frame: bytes, rng: random.Random):
    """(link type, frame bytes, origlen) variants of an Ethernet/IPv4|IPv6 frame."""
    eth, rest = frame[:12], frame[12:]
    ethertype = rest[:2]
    out = [(1, frame, len(frame))]
    for tags in ([0x8100], [0x88A8, 0x8100], [0x9100], [0x8100, 0x8100, 0x8100]):
        tagged = eth + b"".join(struct.pack(">HH", t, rng.randrange(4096)) for t in tags) + rest
        out.append((1, tagged, len(tagged)))
    ip = frame[14:]
    out.append((101, ip, len(ip)))                                   # raw IP
    out.append((228 if ip[0] >> 4 == 4 else 229, ip, len(ip)))      # IPv4 / IPv6 link types
    out.append((229 if ip[0] >> 4 == 4 else 228, ip, len(ip)))      # the wrong one: malformed
    sll = struct.pack(">HHHQ", 0, 1, 6, 0) + ethertype + ip
    out.append((113, sll, len(sll)))
    sll2 = ethertype + b"\0\0" + struct.pack(">IHBBQ", 3, 1, 0, 6, 0) + ip
    out.append((276, sll2, len(sll2)))
    if ip[0] >> 4 == 4:
        # IPv4 options (covered by the ICRC, unmasked) and fragments
        opt = bytearray(frame[:14] + bytes([0x46]) + frame[15:34] + b"\x01\x01\x01\x00" + frame[34:])
        struct.pack_into(">H", opt, 16, struct.unpack_from(">H", frame, 16)[0] + 4)
        _reicrc(opt, 14, 38)
        out.append((1, bytes(opt), len(opt)))
        frag = bytearray(frame)
        frag[20] |= 0x20
        out.append((1, bytes(frag), len(frag)))
    else:
        # IPv6 hop-by-hop + destination options, then a fragment header (atomic or not)
        for ext, nxt in ((bytes([60, 0]) + b"\x01\x04\0\0\0\0" + bytes([17, 0]) + b"\x01\x04\0\0\0\0", 0),
                         (bytes([17, 0, 0, 0, 0, 0, 0, 0]), 44), (bytes([17, 0, 0, 8, 0, 0, 0, 0]), 44)):
            v6 = bytearray(frame[:14 + 40] + ext + frame[54:])
            v6[14 + 6] = nxt
            struct.pack_into(">H", v6, 18, struct.unpack_from(">H", frame, 18)[0] + len(ext))
            _reicrc(v6, 14, 54 + len(ext))
            out.append((1, bytes(v6), len(v6)))
    # cut by a snap length, or cut with the record saying so
    for cut in (10, 13, 20, 33, 41, 45, 53, 60, 70, len(frame) - 5, len(frame) - 1):
        if cut < len(frame):
            out.append((1, frame[:cut], len(frame)))
            out.append((1, frame[:cut], cut))
    # header bytes flipped
    for _ in range(12):
        bad = bytearray(frame)
        pos = rng.randrange(12, min(len(frame), 80))
        bad[pos] ^= 1 << rng.randrange(8)
        out.append((1, bytes(bad), len(bad)))
    # mirror tunnels, whole, cut and with header bits flipped (the kernel unwraps the
    # healthy ones and leaves the rest to the reference)
    fr = CapturedFrame(1, 0, 1, len(frame), len(frame), frame)
    for wrapped in (_erspan(fr, 3), _erspan3(fr, 5), _erspan3(fr, 6), _gretap(fr, 1), _gretap(fr, 3)):
        data = wrapped.data
        out.append((1, data, len(data)))
        cut = rng.randrange(14, len(data))
        out.append((1, data[:cut], len(data)))
        bad = bytearray(data)
        bad[rng.randrange(14, min(len(data), 140))] ^= 1 << rng.randrange(8)
        out.append((1, bytes(bad), len(bad)))
    # GRE whose IP length ends inside the tunnel (the reference says why)
    if ip[0] >> 4 == 4:
        gre = bytearray(frame[:14] + frame[14:34])
        gre[14 + 9] = 47
        out.append((1, bytes(gre) + struct.pack(">HH", 0x1000, 0x88BE) + struct.pack(">I", 1)
                    + struct.pack(">II", 0x10000001, 0) + frame, 0))
    return out


def test_kernel_classifies_every_frame_as_decode_frame(tmp_path):
    synth(tmp_path, ranks=2, channels=1, protocol="ll", mtu=1024, mirrors=1, iterations=1)
    synth(tmp_path / "v6", ranks=2, channels=1, protocol="simple", mtu=4096, mirrors=1, iterations=1,
          ipv6=True)
    rng = random.Random(7)
    frames = []
    for path in pcaps(tmp_path) + pcaps(tmp_path / "v6"):
        got = [fr.data for fr in open_capture(path)]
        frames += rng.sample(got, 60)
    items = []
    for f in frames:
        items += _variants(f, rng)
    batch = batch_from_frames([(0, CapturedFrame(i + 1, 0, lt, len(d), o or len(d), d))
                               for i, (lt, d, o) in enumerate(items)])
    ex = FastExtractor(load_plan(tmp_path / "plan.json"), 1)
    got = ex.classify(batch)
    seen = set()
    for (lt, data, origlen), cls in zip(items, got):
        want = decode_frame(data, lt, origlen or len(data))
        if cls == "encapsulated":
            assert want.encap is not None or want.cls in (FrameClass.TRUNCATED, FrameClass.MALFORMED,
                                                          FrameClass.OTHER)
            seen.add(cls)
            continue
        assert cls == want.cls.value, (lt, data.hex(), want.reason)
        seen.add(cls)
    assert {"roce_data", "roce_ack", "truncated", "malformed", "other", "bad_icrc",
            "encapsulated"} <= seen
    # the reader's ICRC check: good exactly where decoding finds RoCE with a good ICRC
    checked = icrc_checker().check_icrc(batch.buf, batch.offsets, batch.caplen, batch.origlen, batch.linktype)
    assert checked.tolist() == [int(c in ("roce_data", "roce_ack")) for c in got]


# -- source: capture files into batches --------------------------------------------------------
@pytest.mark.parametrize("order,ns", [("<", True), (">", True), ("<", False), (">", False)])
def test_load_capture_reads_what_open_capture_reads(tmp_path, order, ns):
    rng = random.Random(5)
    path = tmp_path / "x.pcap"
    with open(path, "wb") as f:
        w = PcapWriter(f, linktype=1, nanosecond=ns, byteorder=order)
        for i in range(50):
            data = rng.randbytes(rng.randrange(0, 200))
            w.write(data, 1_700_000_000_000_000_000 + rng.randrange(10**12), origlen=len(data) + i % 3)
    batch, err = load_capture(path, stream=2)
    ref = list(open_capture(path))
    assert err is None and len(batch) == len(ref)
    for i, fr in enumerate(ref):
        assert batch.frame(i) == fr
    assert set(batch.stream.tolist()) == {2}
    # cut inside the last record: the good frames, then the reference's error
    cut = tmp_path / "cut.pcap"
    cut.write_bytes(path.read_bytes()[:-7])
    batch, err = load_capture(cut)
    errors = []
    good = [fr for _, fr in file_source([str(cut)], errors)]
    assert [batch.frame(i) for i in range(len(batch))] == good and [err] == errors


def test_load_capture_reads_a_fifo_whole(tmp_path):
    """A FIFO (the txring sender's capture from a pipe) was sniffed and then read again
    past the bytes sniffed: "not a pcap file", no frame. Now its frames equal the file's."""
    import os
    import subprocess
    path = tmp_path / "x.pcap"
    with open(path, "wb") as f:
        w = PcapWriter(f, linktype=1)
        for i in range(20):
            w.write(bytes([i]) * (60 + i), 1_700_000_000_000_000_000 + i)
    fifo = tmp_path / "x.fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f'exec cat "{path}" > "{fifo}"'])
    got = []
    reader = threading.Thread(target=lambda: got.append(load_capture(fifo)))
    reader.start()
    try:
        reader.join(60)
    finally:
        writer.kill()
        writer.wait(30)
        if reader.is_alive():   # a second open waits for a writer: give it one that writes nothing
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(30)
    assert got, "load_capture did not return"
    batch, err = got[0]
    assert err is None and [batch.frame(i) for i in range(len(batch))] == list(open_capture(path))


def _stream_files(tmp_path, rng, n=3, frames=300):
    """n pcap files whose times interleave, tie, and sometimes go backwards."""
    paths = []
    for k in range(n):
        path = tmp_path / f"s{k}.pcap"
        with open(path, "wb") as f:
            w = PcapWriter(f, linktype=1, nanosecond=bool(k % 2), byteorder="<>"[k % 2])
            t = 1_700_000_000_000_000_000
            for i in range(frames + 37 * k):
                t += rng.choice([0, 1000, 5000, 20000, -3000])
                data = rng.randbytes(rng.randrange(0, 1600))
                w.write(data, t, origlen=len(data))
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("chunk", [100, 4096, 70_000, 1 << 24])
def test_stream_batches_yield_file_sources_frames_in_its_order(tmp_path, chunk):
    """The pcap files are mapped into one buffer and merged by index: every Batch
    points into that buffer, no bytes copied."""
    paths = _stream_files(tmp_path, random.Random(chunk))
    # a file cut inside its last record among them
    errors_ref, errors = [], []
    cut = tmp_path / "cut.pcap"
    cut.write_bytes(Path(paths[1]).read_bytes()[:-5])
    paths[1] = str(cut)
    want = [(k, fr) for k, fr in file_source(paths, errors_ref)]
    got, bufs = [], set()
    nbatches = 0
    for b in ReaderStage(stream_batches(paths, errors, chunk_bytes=chunk), depth=2):
        nbatches += 1
        bufs.add(b.buf.ctypes.data)
        got += [(int(b.stream[i]), b.frame(i)) for i in range(len(b))]
    assert got == want and errors == errors_ref and len(errors) == 1
    assert len(bufs) == 1
    if chunk <= 4096:
        assert nbatches > 10


@pytest.mark.parametrize("chunk", [100, 3000, 70_000])
def test_mapped_merge_makes_the_batches_of_the_per_file_merge(tmp_path, chunk):
    """PcapMerge (every file a mapped pcap: index and merge in one call without the GIL)
    and the per-file merge it stands in for (_pcap_chunks + _merged, still used where a
    stream is pcapng) give the same Batches, frame for frame and cut for cut, ICRC flags
    and the error of a file cut inside a record included."""
    synth(tmp_path, ranks=4, channels=2, protocol="simple", mtu=1024, mirrors=3, loss=1e-3,
          corrupt=2e-2, iterations=2)
    paths = pcaps(tmp_path)
    cut = tmp_path / "cut.pcap"
    cut.write_bytes(Path(paths[1]).read_bytes()[:-5])
    paths[1] = str(cut)
    paths.append(str(tmp_path / "missing.pcap"))
    checker = icrc_checker()
    errors = []
    got = list(stream_batches(paths, errors, chunk, checker))
    files = MappedFiles(paths[:3])
    buf = np.frombuffer(files, np.uint8)
    errors_ref = errors[:1]  # the missing file, reported as it is opened
    sources = [_pcap_chunks(p, k, files, buf, k, chunk, errors_ref, checker) for k, p in enumerate(paths[:3])]
    want = list(_merged(sources + [iter(())], len(paths), checker))
    assert len(got) == len(want) > (3 if chunk < 70_000 else 1)
    for g, w in zip(got, want):
        for name in ("offsets", "caplen", "origlen", "stream", "linktype", "frame_no", "ts", "icrc_checked"):
            a, b = getattr(g, name), getattr(w, name)
            assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
    assert errors == errors_ref and len(errors) == 2
    flags = np.concatenate([b.icrc_checked for b in got])
    assert 0 < flags.sum() < len(flags)


def _pcapng(frames) -> bytes:
    """A pcapng file: section, one Ethernet interface (microseconds), a packet block per
    (time in us, data)."""
    def block(btype, body):
        body += b"\0" * (-len(body) % 4)
        return struct.pack("<II", btype, len(body) + 12) + body + struct.pack("<I", len(body) + 12)
    blocks = [block(0x0A0D0D0A, struct.pack("<IHHq", 0x1A2B3C4D, 1, 0, -1)),
              block(1, struct.pack("<HHI", 1, 0, 0))]
    for t, data in frames:
        blocks.append(block(6, struct.pack("<IIIII", 0, t >> 32, t & 0xFFFFFFFF, len(data), len(data)) + data))
    return b"".join(blocks)


def test_stream_batches_mix_mapped_pcap_and_pcapng(tmp_path):
    """A pcapng stream (parsers' reader, its own buffer) merged with mapped pcap
    streams: the frames are copied into one buffer, in file_source's order; an empty
    pcap file and a missing one are reported as file_source reports them."""
    paths = _stream_files(tmp_path, random.Random(7), n=2)
    ng = tmp_path / "s.pcapng"
    t, rng, frames = 1_700_000_000_000_000, random.Random(8), []
    for _ in range(200):
        t += rng.choice([0, 2, 7])
        frames.append((t, rng.randbytes(rng.randrange(0, 900))))
    ng.write_bytes(_pcapng(frames))
    empty = tmp_path / "empty.pcap"
    empty.write_bytes(b"")
    paths += [str(ng), str(empty), str(tmp_path / "missing.pcap")]
    errors_ref, errors = [], []
    want = [(k, fr) for k, fr in file_source(paths, errors_ref)]
    got = []
    for b in stream_batches(paths, errors, chunk_bytes=5000):
        got += [(int(b.stream[i]), b.frame(i)) for i in range(len(b))]
    assert got == want and errors == errors_ref and len(errors) == 2


@pytest.mark.parametrize("mixed", [False, True], ids=["pcap", "pcap+pcapng"])
def test_stream_batches_take_each_streams_clock_shift_as_file_source_does(tmp_path, mixed):
    """Capture clocks set right (ckptd.core.clock): PcapMerge (every file a pcap) and the
    merge of separate sources (a pcapng among them) take the same ns off each stream's
    times as file_source, and merge in its order."""
    paths = _stream_files(tmp_path, random.Random(11), n=3)
    if mixed:
        ng = tmp_path / "s.pcapng"
        t, rng = 1_700_000_000_000_000, random.Random(12)
        ng.write_bytes(_pcapng([(t + 3 * i, rng.randbytes(rng.randrange(60, 900))) for i in range(200)]))
        paths.append(str(ng))
    shifts = [0, 40_000, -25_000, 7_000_000][:len(paths)]
    want = list(file_source(paths, [], shifts=shifts))
    assert [k for k, _ in want] != [k for k, _ in file_source(paths, [])]  # the shifts move frames
    got = []
    for b in stream_batches(paths, [], chunk_bytes=5000, shifts=shifts):
        got += [(int(b.stream[i]), b.frame(i)) for i in range(len(b))]
    assert got == want


def _rss_file_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    pytest.skip("no RssFile in /proc/self/status")


def test_mapped_pages_behind_the_reader_are_released(tmp_path):
    """release_before unmaps the pages of a file before a position (in 64 MiB steps):
    the resident size falls, and the bytes still read the same (mapped again from the
    page cache)."""
    data = np.random.default_rng(1).integers(0, 256, 80 << 20, dtype=np.uint8)
    path = tmp_path / "big"
    data.tofile(path)
    files = MappedFiles([str(path)])
    buf = np.frombuffer(files, np.uint8)
    assert int(buf[::4096].astype(np.int64).sum()) == int(data[::4096].astype(np.int64).sum())
    before = _rss_file_kb()
    files.release_before(10 << 20)  # less than a step: nothing
    assert _rss_file_kb() > before - (8 << 10)
    files.release_before(len(buf) - 1)
    assert _rss_file_kb() < before - (64 << 10)
    np.testing.assert_array_equal(buf, data)


PMD = 2 << 20


def _file_pmd_mapped_kb(lo: int, hi: int) -> int:
    """FilePmdMapped of this process's mappings inside [lo, hi)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            a, b = (int(x, 16) for x in head.split("-"))
            inside = lo <= a and b <= hi
        elif inside and head == "FilePmdMapped:":
            total += int(line.split()[1])
    return total


def test_each_mapped_file_starts_on_a_pmd_boundary(tmp_path):
    """Files of sizes that are not multiples of anything still start 2 MiB-aligned in the
    buffer and in memory (what a PMD mapping of the page cache needs), bytes intact."""
    rng = np.random.default_rng(2)
    datas = [rng.integers(0, 256, n, dtype=np.uint8) for n in (4097, 3 * PMD + 5, 1, PMD)]
    paths = []
    for k, d in enumerate(datas):
        paths.append(str(tmp_path / f"f{k}"))
        d.tofile(paths[-1])
    files = MappedFiles(paths)
    buf = np.frombuffer(files, np.uint8)
    for d, start, size in zip(datas, files.starts, files.sizes):
        assert size == len(d) and start % PMD == 0 and (buf.ctypes.data + start) % PMD == 0
        np.testing.assert_array_equal(buf[start:start + size], d)


def _thp_for_files() -> bool:
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    release = tuple(int(x) for x in os.uname().release.split(".")[:2])
    return "[never]" not in thp and release >= (6, 16)  # ext4's large folios: Linux 6.16


def test_a_capture_read_from_disk_is_mapped_with_pmd_entries(tmp_path):
    """A file not in the page cache, read through the mapping, comes in as PMD-sized
    folios (MADV_HUGEPAGE readahead) and is mapped 2 MiB at a time; releasing the pages
    behind a position unmaps them."""
    if not _thp_for_files():
        pytest.skip("no transparent huge pages for file mappings on this kernel")
    data = np.random.default_rng(3).integers(0, 256, 70 << 20, dtype=np.uint8)
    path = tmp_path / "cold"
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache
    finally:
        os.close(fd)
    files = MappedFiles([str(path)])
    buf = np.frombuffer(files, np.uint8)
    lo = buf.ctypes.data
    np.testing.assert_array_equal(buf, data)
    assert _file_pmd_mapped_kb(lo, lo + len(buf)) >= (32 << 10)  # most of the 70 MiB
    files.release_before(len(buf) - 1)
    assert _file_pmd_mapped_kb(lo, lo + len(buf)) < (8 << 10)
    np.testing.assert_array_equal(buf, data)


def _fs_type(path) -> str:
    """The file system `path` is on (the longest mount point above it)."""
    best, kind = "", ""
    for line in open("/proc/self/mounts"):
        _, point, fs = line.split()[:3]
        if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
            best, kind = point, fs
    return kind


def _faults_to_touch(path) -> tuple[int, int]:
    """(page faults, pages) of reading one byte per page of a file through MappedFiles."""
    files = MappedFiles([str(path)])
    buf = np.frombuffer(files, np.uint8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    int(buf[::4096].sum())
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, len(buf) // 4096


def test_a_capture_written_in_whole_chunks_maps_a_large_folio_per_fault(tmp_path):
    """The synthesizer's captures (parsers.pcap.ChunkedFile: whole 4 MiB writes) are held
    in large folios right after writing, and a replay maps each with one fault; the same
    records written 8 KiB at a time (Python's default buffer) take a fault per 16 pages
    (the kernel's fault-around). The bytes are PcapWriter's either way."""
    if not _thp_for_files() or _fs_type(tmp_path) not in ("ext4", "xfs"):
        pytest.skip(f"large page-cache folios need Linux 6.16+ on ext4 or xfs ({_fs_type(tmp_path)} here)")
    rng = random.Random(4)
    frames = [(rng.randrange(1 << 60), rng.randbytes(rng.randrange(60, 4200))) for _ in range(24_000)]
    paths = [tmp_path / "chunked.pcap", tmp_path / "plain.pcap"]
    for path, f in zip(paths, (ChunkedFile(paths[0]), open(paths[1], "wb"))):
        w = PcapWriter(f)
        for ts, data in frames:
            w.write(data, ts)
        f.close()
    assert paths[0].read_bytes() == paths[1].read_bytes()
    chunked, pages = _faults_to_touch(paths[0])
    plain, _ = _faults_to_touch(paths[1])
    assert chunked <= pages // 64 and plain >= pages // 32, (chunked, plain, pages)


def test_a_capture_that_shrinks_under_the_mapping_stops_in_one_line(tmp_path):
    """A file truncated while mapped faults on read (SIGBUS): the process ends with exit 2
    and one line naming the file, not a core dump."""
    path = tmp_path / "rotated.pcap"
    path.write_bytes(bytes(range(256)) * 64)
    code = (
        "import os, sys, numpy as np\n"
        "from cython_ext.filemap import MappedFiles\n"
        f"p = {str(path)!r}\n"
        "f = MappedFiles([p]); buf = np.frombuffer(f, np.uint8)\n"
        "assert int(buf[-1]) == 255\n"
        "os.truncate(p, 0)\n"
        "print(int(buf[-1]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "shrank" in lines[0], out.stderr
    assert out.stdout == ""


def test_reader_stage_raises_the_readers_error_after_its_batches():
    def batches():
        yield batch_from_frames([])
        raise RuntimeError("disk gone")
    stage = ReaderStage(batches())
    seen = []
    with pytest.raises(RuntimeError, match="disk gone"):
        for b in stage:
            seen.append(b)
    assert len(seen) == 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to give the reader one of its own")
def test_a_reader_on_a_cpu_of_its_own_runs_there_and_is_never_held():
    mask = os.sched_getaffinity(0)
    cpu = reader_cpu()
    assert cpu == max(mask)
    seen = {}

    def batches():
        seen["cpus"] = os.sched_getaffinity(0)  # asked on the reader's thread: its own mask
        yield batch_from_frames([])
    stage = ReaderStage(batches(), cpu=cpu)
    stage.pause(True)
    assert stage._go.is_set()  # holding it measured slower (ReaderStage.pause)
    assert len(list(stage)) == 1 and seen["cpus"] == {cpu}
    assert os.sched_getaffinity(0) == mask  # this thread is left as it was
    shared = ReaderStage(iter(()))
    shared.pause(True)
    assert not shared._go.is_set()  # sharing cores, the reader still yields to the commit
    shared.close()


def test_load_capture_reports_broken_files_as_file_source_does(tmp_path):
    bad = tmp_path / "bad.pcap"
    bad.write_bytes(b"not a capture at all")
    batch, err = load_capture(bad)
    errors = []
    assert list(file_source([str(bad)], errors)) == [] and len(batch) == 0 and [err] == errors


# -- the pipeline, end to end ---------------------------------------------------------------
SCENARIOS = {
    "simple-1024-1ch-2ranks-1stream-loss": dict(ranks=2, channels=1, protocol="simple", mtu=1024,
                                                 mirrors=1, loss=1e-3),
    "simple-1024-1ch-2ranks-2streams-loss": dict(ranks=2, channels=1, protocol="simple", mtu=1024,
                                                  mirrors=2, loss=1e-3),
    "ll-4096-3ch-8ranks-3streams-reorder-dup": dict(ranks=8, channels=3, protocol="ll", mtu=4096,
                                                    mirrors=3, loss=1e-3, reorder=2e-3, duplicate=2e-3),
    "simple-1024-3ch-8ranks-wrap-retx-corrupt": dict(ranks=8, channels=3, protocol="simple", mtu=1024,
                                                     mirrors=2, loss=1e-3, psn_wrap=True,
                                                     retransmit=0.02, corrupt=1e-3),
    "ll-1024-1ch-2ranks-3streams-wrap": dict(ranks=2, channels=1, protocol="ll", mtu=1024, mirrors=3,
                                             wrap_mirrors=True,
                                             loss=1e-3, psn_wrap=True, reorder=1e-3),
    "ll-4096-1ch-4ranks-1stream": dict(ranks=4, channels=1, protocol="ll", mtu=4096, mirrors=1),
    "simple-4096-nccl2.20-2qps-ipv6-fused": dict(ranks=4, channels=3, protocol="simple", mtu=4096,
                                                 mirrors=3, loss=1e-3, nccl_version="2.20", qps=2,
                                                 shuffle_rings=True, optimizer="fused", ipv6=True),
    "ll-2048-split-qps-forloop-clip": dict(ranks=3, channels=2, protocol="ll", mtu=2048, mirrors=2,
                                           loss=1e-3, qps=2, optimizer="for-loop", max_grad_norm=0.5,
                                           lr_schedule="linear"),
    # LL128: a small buffer makes many ring loops per bucket (NCCL_LL128_BUFFSIZE)
    "ll128-4096-2ch-3ranks-nccl2.29-loops": dict(ranks=3, channels=2, protocol="ll128", mtu=4096,
                                                  mirrors=2, loss=1e-3, nccl_version="2.29", buffsize=65536),
    "ll128-1024-split-qps-nccl2.19-reorder": dict(ranks=2, channels=1, protocol="ll128", mtu=1024,
                                                   mirrors=2, loss=1e-3, qps=2, reorder=1e-3, buffsize=98304),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fast_pipeline_equals_reference(tmp_path, name):
    # every other scenario reads its files in small chunks on the reader thread
    k = sorted(SCENARIOS).index(name)
    ref, fast = synth_pair(tmp_path, seed=k, chunk_bytes=(200_000 if k % 2 else None), **SCENARIOS[name])
    assert_same(ref, fast)
    assert fast.kernel_frames > 0.9 * sum(c["frames"] for c in fast.classes)
    if SCENARIOS[name]["mirrors"] > 1:
        assert all(r.status == "committed" and r.exact for r in fast.reports)


def test_gradient_dumps_of_incomplete_iterations_are_zero_where_nothing_arrived(tmp_path):
    """One lossy stream, enough iterations that the kernel reuses an iteration's
    buffers (it does not zero their data): the dumped gradients equal the reference's,
    zeros where no stream delivered an element, in complete and incomplete iterations."""
    synth(tmp_path, ranks=2, channels=1, protocol="simple", mtu=1024, mirrors=1, loss=3e-3, iterations=6)
    plan = load_plan(tmp_path / "plan.json")
    a, b = tmp_path / "ref", tmp_path / "fast"
    ref, fast = run_both(plan, pcaps(tmp_path), dumps=(a, b))
    assert_same(ref, fast)
    names = sorted(p.name for p in a.iterdir() if not p.name.endswith("_coverage.npy"))
    assert names == sorted(p.name for p in b.iterdir() if not p.name.endswith("_coverage.npy"))
    holes = 0
    for n in names:
        got, cov = np.load(b / n), np.load(b / n.replace(".npy", "_coverage.npy"))
        np.testing.assert_array_equal(np.load(a / n), got, err_msg=n)
        assert not got[~cov].any(), n
        holes += int((~cov).sum())
    assert holes > 0, "the lossy stream must leave some element undelivered"


@pytest.mark.parametrize("protocol,mtu", [("ll", 1024), ("simple", 4096)])
def test_trusting_the_nic_with_corrupted_frames(tmp_path, protocol, mtu):
    """ICRC off: corrupted payloads get through and disagree with the other streams'
    copies (conflicts), corrupted headers are rejected past the 20 examples."""
    ref, fast = synth_pair(tmp_path, trust_icrc=True, shadow=False, ranks=4, channels=2,
                           protocol=protocol, mtu=mtu, mirrors=3, loss=1e-3, corrupt=2e-2,
                           psn_wrap=protocol == "simple")
    assert_same(ref, fast)
    assert sum(len(s["conflicts"]) for s in ref.snaps) > 0
    assert fast.classes[0]["bad_icrc"] == 0


def test_indexing_checks_each_frames_icrc_as_check_icrc_does(tmp_path):
    """stream_batches with a checker checks ICRCs while it indexes (index_pcap with a
    checker, prefetching the next header): the flags are check_icrc's on the same frames,
    at every chunk size, corrupted frames (0) included; a pcapng stream is checked as read."""
    synth(tmp_path, ranks=4, channels=2, protocol="simple", mtu=1024, mirrors=2, loss=1e-3,
          corrupt=2e-2, iterations=2)
    paths = pcaps(tmp_path)
    ng = tmp_path / "m.pcapng"
    ng.write_bytes(_pcapng([(fr.ts_ns // 1000, fr.data) for fr in open_capture(paths[1])]))
    checker = icrc_checker()
    for files in (paths, [paths[0], str(ng)]):
        for chunk in (3000, 100_000, 1 << 24):
            errors, flags = [], []
            for b in stream_batches(files, errors, chunk, checker):
                want = checker.check_icrc(b.buf, b.offsets, b.caplen, b.origlen, b.linktype)
                np.testing.assert_array_equal(b.icrc_checked, want)
                flags.append(want)
            flags = np.concatenate(flags)
            assert not errors and 0 < flags.sum() < len(flags), (files, chunk)


def test_icrcs_checked_on_the_reader_thread_with_corrupted_frames(tmp_path):
    """fast_replay's reading: the ICRCs are checked ahead on the reader's thread and the
    kernel computes none for the frames found good; corrupted ones are left to it, and
    it classes and counts them as the reference does."""
    ref, fast = synth_pair(tmp_path, shadow=False, chunk_bytes=100_000, ranks=4, channels=2,
                           protocol="simple", mtu=1024, mirrors=3, loss=1e-3, corrupt=2e-2)
    assert_same(ref, fast)
    assert fast.classes[0]["bad_icrc"] > 0


def _tagged(fr: CapturedFrame, k: int) -> CapturedFrame:
    tags = [[0x8100], [0x88A8, 0x8100], [0x9100]][k % 3]
    data = fr.data[:12] + b"".join(struct.pack(">HH", t, 100 + k % 7) for t in tags) + fr.data[12:]
    return CapturedFrame(fr.index, fr.ts_ns, fr.linktype, len(data), len(data), data)


def _tunnel(fr: CapturedFrame, gre_flags: int, proto: int, header: bytes, inner: bytes,
            outer_v: int = 4) -> CapturedFrame:
    """fr's frame as a mirror tunnel delivers it (ckptd.testing.tunnel.gre_tunnel), ended by
    4 bytes of Ethernet trailer (the outer IP length rules)."""
    data = gre_tunnel(inner, proto, header, flags=gre_flags, seq=fr.index, outer_v=outer_v, trailer=b"\0" * 4)
    return CapturedFrame(fr.index, fr.ts_ns, fr.linktype, len(data), len(data), data)


def _erspan(fr: CapturedFrame, k: int) -> CapturedFrame:
    # IPv4 / GRE (S) / ERSPAN II / the mirrored frame
    return _tunnel(fr, 0x1000, 0x88BE, struct.pack(">II", 0x10000000 | k % 1024, 0), fr.data)


def _erspan3(fr: CapturedFrame, k: int) -> CapturedFrame:
    # IPv6 / GRE (K, S) / ERSPAN III with the platform sub-header (O) / the mirrored IP
    # packet, its Ethernet header taken off (frame type 2); every 5th a whole frame (type 0)
    ft = 0 if k % 5 == 0 else 2
    hdr = struct.pack(">HHIHH", 2 << 12, k % 1024, k, 0, ft << 10 | 1) + b"\x11" * 8
    return _tunnel(fr, 0x3000, 0x22EB, hdr, fr.data if ft == 0 else fr.data[14:], outer_v=6)


def _gretap(fr: CapturedFrame, k: int) -> CapturedFrame:
    # IPv4 / GRE (C, K) / transparent Ethernet bridging; every 3rd ERSPAN type I
    return _tunnel(fr, 0xA000, 0x6558 if k % 3 else 0x88BE, b"", fr.data)


@pytest.mark.parametrize("wrap", [_tagged, _erspan, _erspan3, _gretap])
def test_tagged_and_mirror_tunnelled_frames(tmp_path, wrap):
    """VLAN/QinQ tags, and the mirror tunnels (GRE with ERSPAN I, II, III or transparent
    Ethernet), are decoded by the kernel with the reference's results."""
    synth(tmp_path, ranks=2, channels=1, protocol="ll", mtu=1024, mirrors=2, loss=1e-3, iterations=2)
    plan = load_plan(tmp_path / "plan.json")
    paths = pcaps(tmp_path)

    def frames():
        return ((s, wrap(fr, k)) for k, (s, fr) in enumerate(file_source(paths, [])))
    ref, fast = run_both(plan, paths, frames=frames)
    assert_same(ref, fast)
    assert ref.extract.counters["ag_packets"] > 0
    assert fast.kernel_frames > 0.9 * sum(c["frames"] for c in fast.classes)
    assert fast.stops["encapsulated"] == 0


def test_tunnels_the_kernel_leaves_to_the_reference(tmp_path):
    """GRE with routing, version 1, another protocol, GRE in GRE, and tunnelled frames
    cut short or truncated inside are decapsulated (or refused) by the reference, frame
    by frame; the results are the same."""
    synth(tmp_path, ranks=2, channels=1, protocol="simple", mtu=1024, mirrors=1, iterations=1)
    plan = load_plan(tmp_path / "plan.json")
    paths = pcaps(tmp_path)
    odd = [
        lambda fr: _tunnel(fr, 0x4000, 0x6558, b"\0\0\0\0", fr.data),            # routing: a null SRE
        lambda fr: _tunnel(fr, 0x0001, 0x88BE, b"", fr.data),                      # version 1
        lambda fr: _tunnel(fr, 0x0000, 0x0800, b"", fr.data[14:]),                 # IP in GRE
        lambda fr: _tunnel(fr, 0x0000, 0x6558, b"", _erspan(fr, 1).data),          # GRE in GRE
        lambda fr: _tunnel(fr, 0x1000, 0x88BE, struct.pack(">II", 0x20000000, 0), fr.data),  # II, version 2
        lambda fr: _tunnel(fr, 0x0000, 0x6558, b"", fr.data[:60]),                 # inner cut short
    ]

    def frames():
        for k, (s, fr) in enumerate(file_source(paths, [])):
            yield s, odd[k % len(odd)](fr)
    ref, fast = run_both(plan, paths, frames=frames)
    assert_same(ref, fast)
    assert fast.stops["encapsulated"] == sum(c["frames"] for c in fast.classes)


def test_abandon_and_the_frame_iterator_api(tmp_path):
    synth(tmp_path, ranks=2, channels=1, protocol="simple", mtu=4096, mirrors=2, iterations=3)
    plan = load_plan(tmp_path / "plan.json")
    paths = pcaps(tmp_path)
    total = sum(1 for _ in file_source(paths, []))
    for fraction in (0.5, 0.6, 0.75, 0.85, 0.95):  # stop mid-iteration, with one open
        cut = int(total * fraction)

        def frames():
            return (x for k, x in enumerate(file_source(paths, [])) if k < cut)
        ref, fast = run_both(plan, paths, frames=frames, abandon=True)
        assert_same(ref, fast)
        if any(r.status == "abandoned" for r in fast.reports):
            break
    else:
        pytest.fail("no cut left an iteration open")


def test_fast_replay_writes_the_reference_checkpoints(tmp_path):
    synth(tmp_path, ranks=3, channels=2, protocol="simple", mtu=2048, mirrors=2, loss=1e-3, iterations=4)
    plan = load_plan(tmp_path / "plan.json")
    opts = ReplayOptions(out=str(tmp_path / "fast"), reference=str(tmp_path / "reference"))
    cpus = os.sched_getaffinity(0)
    pipe = fast_replay(plan, pcaps(tmp_path), load_checkpoint(tmp_path / "init.pt"), opts)
    assert [r.status for r in pipe.reports] == ["committed"] * 4 and all(r.exact for r in pipe.reports)
    assert os.sched_getaffinity(0) == cpus  # only the reader's thread was pinned
    ref = replay(plan, pcaps(tmp_path), load_checkpoint(tmp_path / "init.pt"),
                 ReplayOptions(out=str(tmp_path / "ref")))
    assert [r.loss for r in ref.reports] == [r.loss for r in pipe.reports]
    with pytest.raises(FileNotFoundError):
        fast_replay(plan, [str(tmp_path / "missing.pcap")], None, ReplayOptions())


# -- the real captures ----------------------------------------------------------------------
def test_real_flowcheck_captures(flowcheck_dir, tmp_path):
    plan = load_plan(FLOWCHECK_PLAN)
    files = sorted(str(p) for p in flowcheck_dir.glob("*.pcapng"))
    assert files
    a, b = tmp_path / "ref", tmp_path / "fast"
    for paths in [[p] for p in files] + [files]:  # each alone, then all as streams at once
        ref, fast = run_both(plan, paths, dumps=(a, b))  # dumps: reduce-scatter steps go via Python
        assert_same(ref, fast)
        names = sorted(p.name for p in a.iterdir())
        assert names == sorted(p.name for p in b.iterdir())
        for n in names:
            np.testing.assert_array_equal(np.load(a / n), np.load(b / n))
        for d in (a, b):
            for p in d.iterdir():
                p.unlink()
    allreduce = [p for p in files if "allreduce" in p]
    assert allreduce
    got = fast_replay(plan, allreduce[:1], None, ReplayOptions(dump_gradients=str(b)))
    grad = np.load(b / "iter_000000_bucket_000.npy")
    np.testing.assert_array_equal(grad, 2 * (np.arange(5000) % 10))
    assert got.extract.counters["ll_flag_mismatch"] == 0


def test_transmit_side_mirrors_stop_holding_acks_of_unseen_hops(tmp_path, monkeypatch):
    """A port's transmit side carries its rank's ACKs of the hop into it, whose data the
    mirrors never show: after enough of them both paths stop keeping them, alike."""
    import ckptd.transports.roce.flows
    monkeypatch.setattr(ckptd.transports.roce.flows, "ACKS_WITHOUT_DATA", 20)
    ref, fast = synth_pair(tmp_path, ranks=4, channels=2, protocol="simple", mtu=1024, mirrors=2,
                           mirror_direction="tx", loss=1e-3, seed=5)
    assert_same(ref, fast)
    assert ref.extract.binder.acks_ignored and \
        ref.extract.binder.acks_ignored == fast.extract.binder.acks_ignored
    assert fast.stops["ack"] < 60


def test_reader_stage_pause_holds_the_next_read():
    import time as _time
    reads = []

    def batches():
        for k in range(50):
            reads.append(k)
            yield batch_from_frames([])
    stage = ReaderStage(batches(), depth=1)
    while len(reads) < 2:  # one queued, one waiting for room
        _time.sleep(0.01)
    stage.pause(True)
    it = iter(stage)
    next(it)  # room for the waiting one; the reader then stops before its next read
    _time.sleep(0.3)
    assert len(reads) == 2
    stage.pause(False)
    assert 1 + len(list(it)) == 50 and len(reads) == 50


@pytest.mark.parametrize("kw", [dict(ranks=3, channels=2, protocol="simple", mtu=2048),
                                dict(ranks=3, channels=1, protocol="ll", mtu=1024),
                                # QP rotations of 3 and 2 iterations: layouts 1-3, 1-2
                                dict(ranks=2, channels=2, protocol="simple", mtu=1024, qps=3, nccl_version="2.22"),
                                dict(ranks=2, channels=2, protocol="ll", mtu=1024, qps=4, nccl_version="2.29")])
def test_the_buffers_reserved_ahead_are_all_a_run_takes(tmp_path, kw):
    """FastPipeline.reserve_iterations (the daemon calls it before capturing) makes the
    kernel's iteration buffers a run takes: replaying the job afterwards allocates none,
    and every iteration commits exactly as without the reservation. Iteration 0's
    buffers (a layout of its own, never seen again) are let go once it is done."""
    synth(tmp_path, mirrors=2, iterations=7, **kw)
    plan = load_plan(tmp_path / "plan.json")
    ref = tmp_path / "reference"
    fast = FastPipeline(plan, load_checkpoint(tmp_path / "init.pt"), 2, ReplayOptions(reference=str(ref)))
    before = fast.kernel.buffer_bytes()
    assert before == {"lent": 0, "kept": 0, "received_maps": 0}
    reserved = fast.reserve_iterations()
    assert reserved > 0 and fast.kernel.buffer_bytes()["kept"] == reserved
    with pytest.raises(ValueError, match="layout"):
        fast.kernel.reserve(fast.kernel.nlayouts, 1)
    batch, errors = load_captures(pcaps(tmp_path))
    assert not errors
    fast.run_batch(batch)
    fast.finish()
    assert [r.status for r in fast.reports] == ["committed"] * 7 and all(r.exact for r in fast.reports)
    first = FastPipeline(plan, None, 2, ReplayOptions()).kernel
    first.reserve(0, 1)
    iteration0 = first.buffer_bytes()["kept"]
    assert 0 < iteration0 < reserved
    assert fast.kernel.buffer_bytes() == {"lent": 0, "kept": reserved - iteration0, "received_maps": 0}
