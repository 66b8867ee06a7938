"""NCCL 2.14-2.21 (before the cell partition): cut, unchanged, the protocol classes
(ProtoSimple .. ProtoLL128) of the device primitives.h, the ring runRing of broadcast.h and
all_gather.h (each wrapped in its own namespace), and the host rules that feed them: 2.14-2.19
the LL lastChunkSize lines of computeColl, 2.20-2.21 computeCollAlignCount and the
per-channel cut of addCBDCollToPlan. Usage: genold.py <dir with primitives.h broadcast.h
all_gather.h enqueue.cc>; prints C++ and EXTRACTED."""
import sys
d = sys.argv[1]
ext, out = [], []


def read(name):
    return open(f"{d}/{name}").read().split("\n")


def block(lines, start):
    """from line start to the line closing the brace it opens"""
    depth, seen, j = 0, False, start
    while True:
        depth += lines[j].count("{") - lines[j].count("}")
        seen = seen or "{" in lines[j]
        if seen and depth == 0:
            return j
        j += 1


prim = read("primitives.h")
a = next(i for i, l in enumerate(prim) if l.startswith("template<int SlicePerChunk_1"))
b = block(prim, next(i for i, l in enumerate(prim) if l.startswith("struct ProtoLL128")))
out.append("\n".join(prim[a:b + 1]))
ext.append(f"primitives.h:{a + 1}-{b + 1}")
for name, ns in (("broadcast.h", "bcast"), ("all_gather.h", "ag")):
    src = read(name)
    s = next(i for i, l in enumerate(src) if "void runRing(ncclWorkElem *args)" in l) - 1
    e = block(src, s + 1)
    out.append(f"namespace {ns} {{\n" + "\n".join(src[s:e + 1]) + "\n}")
    ext.append(f"{name}:{s + 1}-{e + 1}")
enq = read("enqueue.cc")
if any("static ncclResult_t computeCollAlignCount" in l for l in enq):  # 2.20-2.21
    s = next(i for i, l in enumerate(enq) if l.startswith("static ncclResult_t computeCollAlignCount"))
    e = block(enq, s)
    out.append("\n".join(enq[s:e + 1]))
    ext.append(f"enqueue.cc:{s + 1}-{e + 1}")
    m = next(i for i, l in enumerate(enq) if "plan->maxBytesPerChannel = DIVUP(DIVUP(totalCBDBytes" in l)
    c = next(i for i, l in enumerate(enq) if "enqBytes = std::min(plan->maxBytesPerChannel - chans[c].collBytes" in l)
    assert "workCount = std::min(DIVUP(DIVUP(enqBytes" in enq[c + 1] and "enqBytes = workCount * typeSize" in enq[c + 2]
    ext.append(f"enqueue.cc:{m + 1},{c + 1}-{c + 3}")
    out.append(f"""
// addCBDCollToPlan's channel loop for one collective alone in its plan (collBytes 0)
static void cbdCut(ncclInfo* collInfo, ncclKernelPlan* plan, ncclTasks* tasks, size_t totalCBDBytes,
                   std::vector<std::pair<size_t, size_t>>& parts) {{
  size_t typeSize = 1, workBytesTotal = collInfo->count, workCountTotal = collInfo->count, enqBytes, workCount;
  size_t alignCount; computeCollAlignCount(collInfo, &alignCount);
  struct {{ size_t collBytes; }} chans[64] = {{}};
{enq[m]}
  size_t workOffset = 0;
  for (int c = 0; c < tasks->usableChannels; c++) {{
    if (workBytesTotal == 0) break;
{enq[c]}
{enq[c + 1]}
{enq[c + 2]}
    parts.push_back({{workOffset, workCount}});
    workBytesTotal -= enqBytes; workCountTotal -= workCount; workOffset += workCount;
  }}
}}""")
else:  # 2.14-2.19
    s = next(i for i, l in enumerate(enq) if "} else if (info->protocol == NCCL_PROTO_LL) {" in l)
    e = next(i for i in range(s, s + 10) if "work->lastChunkSize /= ncclTypeSize" in enq[i])
    ext.append(f"enqueue.cc:{s + 2}-{e + 1}")
    body = "\n".join(enq[s + 1:e + 1])
    out.append(f"static void llLastChunk(ncclInfo* info, ncclWorkElem* work, int stepSize) {{\n{body}\n}}")
print("\n".join(out))
print(f'static const char* EXTRACTED = "{"; ".join(ext)}";')
