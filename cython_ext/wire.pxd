# The wire-format constants the batch kernel shares with the Python reference, declared
# once for Cython. Each names its Python twin; tests/test_fastpath.py
# test_kernel_constants_equal_the_references checks every value against it
# (batch.WIRE exposes them), so the two cannot drift apart unnoticed.

# Link types (parsers/frame.py LINKTYPE_*)
cdef enum:
    LT_ETHERNET = 1
    LT_RAW = 101
    LT_LINUX_SLL = 113
    LT_IPV4 = 228
    LT_IPV6 = 229
    LT_LINUX_SLL2 = 276

# Ethernet types (parsers/ethernet.py ETH_TYPE_*, VLAN_TPIDS)
cdef enum:
    ETH_TYPE_IPV4 = 0x0800
    ETH_TYPE_IPV6 = 0x86DD
    TPID_8021Q = 0x8100
    TPID_8021AD = 0x88A8
    TPID_9100 = 0x9100

# IP protocols and the RoCEv2 port (parsers/ipv4.py PROTO_UDP, parsers/gre.py
# PROTO_GRE, parsers/udp.py ROCEV2_PORT)
cdef enum:
    PROTO_UDP = 17
    PROTO_GRE = 47
    ROCEV2_PORT = 4791
    UDP_LEN = 8
    BTH_LEN = 12
    ICRC_LEN = 4

# GRE and the mirror tunnels inside it (parsers/gre.py, parsers/erspan.py)
cdef enum:
    GRE_C = 0x8000          # checksum (and offset) word present
    GRE_R = 0x4000          # routing present (RFC 1701)
    GRE_K = 0x2000          # key word present
    GRE_S = 0x1000          # sequence number word present
    GRE_VERSION = 0x0007
    GRE_PROTO_ERSPAN = 0x88BE   # types I (no S) and II (S)
    GRE_PROTO_ERSPAN3 = 0x22EB
    GRE_PROTO_TEB = 0x6558
    ERSPAN2_LEN = 8
    ERSPAN3_LEN = 12
    ERSPAN3_PLATFORM_LEN = 8

# RC opcodes NCCL's data QPs use (ckptd/transports/roce/flows.py WRITE_*, ACK); every
# other opcode's properties come from parsers/opcodes.py as tables (opcode_tables)
cdef enum:
    WRITE_FIRST = 6
    WRITE_MIDDLE = 7
    WRITE_LAST = 8
    WRITE_LAST_IMM = 9
    WRITE_ONLY = 10
    WRITE_ONLY_IMM = 11
    ACKNOWLEDGE = 17

# PSNs (ckptd/core/psn.py PSN_MASK, PSN_MOD)
cdef enum:
    PSN_MASK = 0xFFFFFF
    PSN_MOD = 0x1000000
    PSN_HALF = 0x800000

# NCCL LL lines (ckptd/core/schedule.py LL_LINE, LL_DATA_PER_LINE)
cdef enum:
    LL_LINE = 16
    LL_DATA_PER_LINE = 8
