// minimal declarations for NCCL 2.14-2.21's extracted device loops and host rules (own code):
// a Primitives class that records every call instead of moving data
#include <vector>
#include <utility>
#include <cstdio>
#include <cstdint>
#include <cstddef>
#include <algorithm>
#include <sys/types.h>
typedef enum { ncclSuccess = 0 } ncclResult_t;
#define NCCL_STEPS 8
#define WARP_SIZE 32
#define COLL_UNROLL 4
#define NCCL_PROTO_LL 0
#define NCCL_PROTO_LL128 1
#define NCCL_PROTO_SIMPLE 2
#define NCCL_LL128_LINEELEMS 16
#define NCCL_LL128_DATAELEMS 15
#define NCCL_LL128_SHMEM_ELEMS_PER_THREAD 8
// include/enqueue.h@v2.20.5-1 constants
#define NCCL_LL_ALIGNMENT_PER_THREAD sizeof(uint64_t)
#define NCCL_LL128_ALIGNMENT_PER_WARP 480
#define NCCL_SIMPLE_ALIGNMENT (WARP_SIZE * 8LL * 16LL)
#define NCCL_BYTES_ALIGNMENT 16
#define __device__
struct { int x; } threadIdx;
// include/collectives.h@v2.14.3-1 .. v2.21.5-1 (the same values in every tag)
#define ALLGATHER_SLICESTEPS (NCCL_STEPS/4)
#define ALLGATHER_CHUNKSTEPS (NCCL_STEPS/2)
#define BROADCAST_SLICESTEPS 1
#define BROADCAST_CHUNKSTEPS 1
#define __forceinline__ inline
#define DIVUP(x, y) (((x)+(y)-1)/(y))
#define ALIGN_SIZE(size, align) size = DIVUP(size, align) * (align);
template<typename X, typename Y> static inline auto divUp(X x, Y y) -> decltype(x+y) { return (x+y-1)/y; }
template<typename X, typename Y> static inline auto roundUp(X x, Y y) -> decltype(x+y) { return (x+y-1)/y*y; }
template<typename X, typename Y> static inline auto min(X x, Y y) -> decltype(x+y) { return x < y ? x : y; }
typedef enum { ncclInt8 = 0 } ncclDataType_t;
static inline size_t ncclTypeSize(int) { return 1; }
union ncclLLFifoLine { struct { uint32_t data1, flag1, data2, flag2; }; uint64_t v[2]; };
struct ncclRing { int prev, next; int userRanks[64]; };
struct { struct { ncclRing ring; } channel; struct { int nRanks; int buffSizes[3]; } comm; } ncclShmem;
struct ncclWorkElem {
  int nWarps, bid, nChannels, root; size_t count, lastChunkSize, chunkCount, workCount, workOffset;
  void *sendbuff, *recvbuff; uint64_t redOpArg;
};
struct ncclComm { int nRanks; };
struct ncclInfo {
  ncclComm* comm; int coll, protocol, algorithm, nThreads, nChannels, nchunksPerLoop;
  ncclDataType_t datatype; size_t count, nBytes;
};
struct ncclKernelPlan { size_t maxBytesPerChannel; };
struct ncclTasks { int usableChannels; };
template<int N> struct FanSymmetric {};
// every prims call: (sends?, output offset, nelem): the last two arguments of every call
struct Call { bool sends; long long offset; int nelem; };
static std::vector<Call> g_calls;
template<typename T, typename RedOp, typename Fan, int Direct, typename Proto, int P2p>
struct Primitives {
  template<typename... A> Primitives(A...) {}
  template<typename... A> static void rec(bool sends, A... a) {
    long long v[] = {(long long)a...}; g_calls.push_back({sends, v[sizeof...(A) - 2], (int)v[sizeof...(A) - 1]}); }
  template<typename... A> void send(A... a) { rec(true, a...); }
  template<typename... A> void copySend(A... a) { rec(true, a...); }
  template<typename... A> void recvCopySend(A... a) { rec(true, a...); }
  template<typename... A> void recv(A... a) { rec(false, a...); }
  template<typename... A> void directSend(A... a) { rec(true, a...); }
  template<typename... A> void directCopySend(A... a) { rec(true, a...); }
  template<typename... A> void directRecvCopySend(A... a) { rec(true, a...); }
  template<typename... A> void directRecv(A... a) { rec(false, a...); }
};
