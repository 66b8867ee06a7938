"""Readable reference decoders for mirrored RoCEv2 traffic (plain Python, dpkt-like).

One small module per header, fields declared once (see header.py):
    ethernet, sll, ipv4, ipv6, udp        link and network layers
    bth, reth, aeth, immdt, deth          InfiniBand transport headers
    opcodes                               BTH opcode table
    icrc                                  RoCEv2 invariant CRC
    pcap, pcapng, capfile, frame         capture files (open_capture sniffs the format)
    roce                                  decode_frame: a whole frame -> RoceFrame
"""
from .capfile import CaptureError, CapturedFrame, open_capture
from .roce import FrameClass, RoceFrame, decode_frame

__all__ = ["open_capture", "CaptureError", "CapturedFrame", "decode_frame", "RoceFrame",
           "FrameClass"]
