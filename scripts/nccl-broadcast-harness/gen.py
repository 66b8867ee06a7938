"""Cut NCCL's ncclFuncTrafficPerByte, calcCollChunking and the cell-partition block of
scheduleCollTasksToPlan out of one tag's enqueue.cc, unchanged, wrapped as partition()."""
import re, sys
src = open(sys.argv[1]).read()
lines = src.split("\n")
def func(start_pat, nth=-1):
    """a whole definition starting at the line matching start_pat (last one by default)"""
    idx = [i for i, l in enumerate(lines) if re.search(start_pat, l)]
    i = idx[nth]
    depth, seen, j = 0, False, i
    while True:
        depth += lines[j].count("{") - lines[j].count("}")
        seen = seen or "{" in lines[j]
        if seen and depth == 0:
            break
        j += 1
    return i + 1, j + 1, "\n".join(lines[i:j + 1])
out, ext = [], []
for pat in [r"^static inline int ncclFuncTrafficPerByte", r"^static ncclResult_t calcCollChunking\("]:
    a, b, t = func(pat)
    ext.append(f"enqueue.cc:{a}-{b}")
    out.append(t)
# partition block of scheduleCollTasksToPlan: the trafficPerChannel line and the cbd block
idx = [i for i, l in enumerate(lines) if "trafficPerChannel = " in l and "size_t trafficPerChannel" not in l][0]
tpc = lines[idx].strip()
ext.append(f"enqueue.cc:{idx+1}")
s = [i for i, l in enumerate(lines) if "// not task->isCollnet" in l][0]  # 2.30: on its own line

e = [i for i, l in enumerate(lines) if "devWork->direct = directFlags;" in l and i > s][0]
ext.append(f"enqueue.cc:{s+2}-{e+1}")
block = "\n".join(lines[s + 1:e + 1])
mtp = [l for l in lines if "constexpr size_t MinTrafficPerChannel" in l][0].strip()
out.append(f"""
static ncclResult_t partition(struct ncclComm* comm, struct ncclKernelPlan* plan, struct ncclKernelPlanBudget* budget,
    struct ncclTaskColl* task, struct ncclDevWorkColl* devWork, int nMaxChannels[4], int kind, size_t trafficBytesKind, int nChannelsKind) {{
  {mtp}
  size_t trafficPerChannel = 0; int channelId = 0; size_t currentTraffic = 0;
  size_t trafficBytes[4] = {{0,0,0,0}}; int nChannels[4] = {{0,0,0,0}};
  trafficBytes[kind] = trafficBytesKind; nChannels[kind] = nChannelsKind;
  struct ncclWorkList* workNode = &g_workNode;
  size_t elementSize = ncclTypeSize(task->datatype);
  {tpc}
  {{
{block}
  }}
  return ncclSuccess;
}}
static size_t minTraffic() {{
  {mtp}
  return MinTrafficPerChannel;
}}
""")
print("\n".join(out))
print(f'static const char* EXTRACTED = "{"; ".join(ext)}";')
