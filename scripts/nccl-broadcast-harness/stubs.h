// minimal declarations for NCCL's extracted host partition/chunking code (own code)
#include <vector>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <algorithm>
#include <sys/types.h>
typedef enum { ncclSuccess = 0, ncclInternalError = 3, ncclInvalidUsage = 5 } ncclResult_t;
#define NCCL_STEPS 8
#define WARP_SIZE 32
#define NCCL_NUM_ALGORITHMS 8
#define NCCL_NUM_PROTOCOLS 3
#define NCCL_ALGO_UNDEF -1
#define NCCL_ALGO_TREE 0
#define NCCL_ALGO_RING 1
#define NCCL_ALGO_COLLNET_DIRECT 2
#define NCCL_ALGO_COLLNET_CHAIN 3
#define NCCL_ALGO_NVLS 4
#define NCCL_ALGO_NVLS_TREE 5
#define NCCL_ALGO_PAT 6
#define NCCL_PROTO_UNDEF -1
#define NCCL_PROTO_LL 0
#define NCCL_PROTO_LL128 1
#define NCCL_PROTO_SIMPLE 2
#define NCCL_LL128_LINEELEMS 16
#define NCCL_LL128_DATAELEMS 15
#define NCCL_LL128_SHMEM_ELEMS_PER_THREAD 8
#define NCCL_DIRECT_WRITE 0x01
#define NCCL_DIRECT_READ 0x02
#define NCCL_NVLS_REG_BUFFER 0x02
#define NCCL_NET_REG_BUFFER 0x01
#define NCCL_IPC_REG_BUFFER 0x04
#define NCCL_REGULAR_BUFFER 0x00
#define NCCL_P2P_READ 0x01
#define NCCL_P2P_WRITE 0x02
#define NCCL_MAX_NET_SIZE (1L << 30)
#define NCCL_MAX_TREE_ARITY 3
#define NCCL_COLLNET_REG_BUFFER 0x08
#define NCCL_MAX_COLLNET_SIZE (1L << 29)
#define __host__
#define __device__
#define WARN(...) do {} while (0)
#define INFO(...) do {} while (0)
#define TRACE(...) do {} while (0)
#define NCCLCHECK(x) do { ncclResult_t r_ = (x); if (r_ != ncclSuccess) return r_; } while (0)
#define DIVUP(x, y) (((x)+(y)-1)/(y))
template<typename X, typename Y> static inline auto divUp(X x, Y y) -> decltype(x+y) { return (x+y-1)/y; }
static inline int log2i(long n) { int l = 0; while (n >>= 1) l++; return l; }
typedef enum { ncclFuncBroadcast=0, ncclFuncReduce=1, ncclFuncAllGather=2, ncclFuncReduceScatter=3, ncclFuncAllReduce=4,
  ncclFuncSendRecv=5, ncclFuncSend=6, ncclFuncRecv=7, ncclFuncAllGatherV=8, ncclFuncAlltoAll=9, ncclFuncScatter=10, ncclFuncGather=11, ncclNumFuncs=12 } ncclFunc_t;
typedef enum { ncclPatternRing, ncclPatternRingTwice, ncclPatternPipelineFrom, ncclPatternPipelineTo, ncclPatternTreeUp,
  ncclPatternTreeDown, ncclPatternTreeUpDown, ncclPatternCollnetChain, ncclPatternCollnetDirect, ncclPatternNvls,
  ncclPatternNvlsTree, ncclPatternPatUp, ncclPatternPatDown, ncclPatternSend, ncclPatternRecv, ncclPatternProfiler } ncclPattern_t;
typedef enum { ncclInt8 = 0, ncclFloat32 = 7 } ncclDataType_t;
typedef enum { ncclSum = 0 } ncclRedOp_t;
enum { ncclDevSum, ncclDevProd, ncclDevMinMax, ncclDevPreMulSum, ncclDevSumPostDiv };
static inline size_t ncclTypeSize(int t) { return t == ncclInt8 ? 1 : 4; }
static inline size_t ncclFuncMaxSendRecvCount(ncclFunc_t func, int nRanks, size_t count) {
  return func == ncclFuncAllGather || func == ncclFuncReduceScatter ? nRanks*count : count; }
static int64_t ncclParamNvlsTreeMaxChunkSize() { return -2; }
struct ncclChannelStub { struct { int nHeads, depth, headRank; } collnetDirect; struct { int depth; } collnetChain; struct { int nHeads, headRank; } nvls; };
struct ncclComm {
  int rank, nRanks, nNodes, node, nChannels, nvlsChannels, nvlsChunkSize, nvlsTreeMaxChunkSize, isOneRPN;
  int buffSizes[NCCL_NUM_PROTOCOLS];
  float bandwidths[ncclNumFuncs][NCCL_NUM_ALGORITHMS][NCCL_NUM_PROTOCOLS];
  ncclChannelStub channels[1];
  struct ncclTunerStub { ncclResult_t (*getChunkSize)(void*, int, size_t, int, int, int, size_t*); ncclResult_t (*getCollInfo)(...); }* tuner; void* tunerContext;
};
struct ncclOpDev { int op; };
struct ncclTaskColl {
  ncclFunc_t func; void *sendbuff, *recvbuff; size_t count; int root; ncclDataType_t datatype;
  ncclOpDev opDev; ncclRedOp_t opHost; int algorithm, protocol, chunkSteps, sliceSteps, nMaxChannels, nWarps;
  size_t trafficBytes, nBytes; int nChannels, nThreads; int regBufType; void *sendMhandle, *recvMhandle;
  int isCollnet, isNvls; int devFuncId; int eActivationMask;
};
struct ncclProxyOpSpecifics { struct { int nNodes, node; size_t sizePerRank; } collnetDirect; };
struct ncclProxyOp {
  int channelId; uint64_t opCount; int nsteps, sliceSteps, chunkSteps, chunkSize, sliceSize, protocol, dtype, redOp, pattern, coll, collAPI, root;
  int reg, algorithm, isOneRPN, nPeers, rank; size_t nbytes, loopOffset, loopSize, channelSize; void *sendbuff, *recvbuff, *sendMhandle, *recvMhandle;
  ncclProxyOpSpecifics specifics;
};
struct ncclDevWorkColl {
  uint32_t channelLo, channelHi; uint8_t direct;
  struct { size_t countLo, countMid, countHi; uint64_t chunkGrainsLo:21, chunkGrainsMid:21, chunkGrainsHi:21; } cbd;
};
struct ncclKernelPlan { int nWorkBatches; size_t workBytes; };
struct ncclKernelPlanBudget { int x; };
struct ncclWorkList { size_t size; int workType; };
static ncclWorkList g_workNode = {0, 0};
static bool ncclTestBudget(ncclKernelPlanBudget*, int, size_t) { return true; }
static bool testBudget(ncclKernelPlanBudget*, int, size_t) { return true; }
