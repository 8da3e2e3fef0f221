// sm_90a (Hopper) M-grouped expert GEMM: the MODE_M contract of moe_gemm (moe.cu) on wgmma.mma_async.
//
//   C[s, n] = sum_k A[row(s), k] * B_e[n, k]   for the slots s of expert e, row(s) = slot_token[s] (A_GATHER) or s
//
// A tile is (expert e, m-tile of the slot range [offsets[e], offsets[e+1]), n-tile), found through tile_offsets
// with find_expert as moe_gemm does. The CTAs are persistent: each walks the tile list (its length read on the
// device) with a stride of gridDim.x; the producer runs into the next tile's k-tiles while the consumers finish
// the current tile's epilogue (EPI_ACT and EPI_ROWSCALE stage it outside the ring; EPI_DHCUR stages it in the
// ring, so there the producer waits for the epilogue).
//
// CTA = 3 warpgroups (384 threads):
//   warpgroup 0     producer: 16-byte cp.async copies of the gathered A rows and of the B tile into a
//                   STAGES-deep ring of shared-memory stages; each copy lands at its 128-byte-swizzle
//                   position, and cp.async.mbarrier.arrive.noinc signals the stage's "full" barrier when
//                   the thread's copies have landed (the tensor copy engine cannot gather rows on sm_90).
//   warpgroups 1, 2 consumers: tile rows [64 (w-1), 64 w); wait "full", fence.proxy.async (the copies are
//                   generic-proxy writes, wgmma reads through the async proxy), 4 x wgmma m64nBNk16 per
//                   64-wide k-tile, commit, wait_group 1, then release the previous stage ("empty").
//   setmaxnreg moves registers from the producer to the consumers (BN/2 fp32 accumulators per thread).
// Proxy fence: a generic-proxy write and an async-proxy read of the same bytes are ordered when a
// fence.proxy.async lies on the causality path between them. The cp.async completion arrives on the
// mbarrier (release), the consumer's try_wait acquires it, and the consumer's fence follows, so the
// fence sits on that path. BLZ_SM90_PRODUCER_FENCE=1 selects the conservative alternative instead:
// each producer thread waits for its own copies (cp.async.wait_group, STAGES-2 k-tiles behind the
// newest), fences, then arrives normally; it costs prefetch depth.
//
// Shared-memory tiles (one stage; every tile starts on a 1024-byte boundary):
//   A  [BM = 128 rows][64 k] K-major: row r at r * 128 bytes, 16-byte chunk c of the row at chunk
//      position c ^ (r % 8) (the 128-byte swizzle); 8-row groups are 1024 bytes apart.
//   B  K-major (weights (E, N, Kd)): [BN rows = output cols][64 k], same layout as A.
//   B  N-major (weights (E, Kd, N)): BN / 64 atoms of [64 k rows][64 n] (8 KB each), atom a holding
//      columns [64 a, 64 a + 64); inside an atom k-row r at r * 128 bytes, chunk c at c ^ (r % 8).
// Descriptors (see make_desc): start address >> 4 in bits 0-13, leading byte offset >> 4 in bits 16-29,
// stride byte offset >> 4 in bits 32-45, swizzle mode in bits 62-63 (1 = 128-byte swizzle).
//   K-major : SBO = 1024 (next 8-row group), LBO unused (encoded 1); the k16 step inside the 128-byte
//             row advances the start address by 32 bytes.
//   N-major : LBO = 8192 (next 64-column atom), SBO = 1024 (next 8 k-rows); the k16 step advances the
//             start address by 2048 bytes; the instruction's transpose-B immediate is 1.
// Gated first GEMM (EPI_ACT with SWIGLU/GEGLU): B rows [0, BN/2) are gate rows n0 + [0, BN/2) and
// rows [BN/2, BN) the matching up rows N + n0 + [0, BN/2), so accumulator column c pairs with column
// c + BN/2, which the same thread holds BN/4 registers later (see wg_for_each_gated_pair).
//
// The file also holds moe_wgrad_sm90, the K-grouped weight-gradient GEMM (moe_gemm's MODE_K with
// EPI_WGRAD) on the same pipeline, with both operands stored MN-major; see its section at the end.
#pragma once
#include "moe_common.cuh"
#include "sm90_tma.cuh"

namespace blz {


#ifndef BLZ_SM90_PRODUCER_FENCE
#define BLZ_SM90_PRODUCER_FENCE 0
#endif

namespace sm90 {

constexpr int BM = 128;            // two consumer warpgroups x 64 rows
constexpr int BK = 64;             // 16-bit elements: one 128-byte swizzled row per k-tile
constexpr int ROW_BYTES = 128;
constexpr int CONSUMER_WGS = 2;
constexpr int THREADS = 128 * (1 + CONSUMER_WGS);
constexpr int PRODUCER_REGS = 72;  // setmaxnreg: 128 x 72 + 256 x 216 = 64512 = 384 x 168
constexpr int CONSUMER_REGS = 216;

constexpr int EPI_WARP_BYTES = 4096;  // per consumer warp: epilogue staging outside the stage ring
constexpr int INFO_SLOTS = 8;          // tile descriptors in flight from the producer to the consumers

// Shared memory (base aligned to 1024): the stage ring, the consumer warps' epilogue staging, then the
// mbarriers (STAGES full, STAGES empty, 1 epilogue-done, INFO_SLOTS tile-info; 16-byte aligned end) and the
// INFO_SLOTS tile descriptors (16 bytes each). STAGING = false (the weight-gradient kernel): no epilogue staging, no tile descriptors.
// A_TILES = 2 (a gated A_ACT GEMM): each stage holds two A tiles, the gate and the up columns of z, before the B
// tile, and the ring is 3 stages deep.
template <int BN, bool STAGING = true, int A_TILES = 1> struct Cfg {
  static_assert(BN == 128 || BN == 256, "BN must be 128 or 256");
  static_assert(A_TILES == 1 || A_TILES == 2, "one or two A tiles a stage");
  static constexpr int STAGES = A_TILES == 2 ? 3 : (BN == 256) ? 4 : 6;
  static constexpr int A_BYTES = BM * ROW_BYTES;     // 16 KB
  static constexpr int B_BYTES = BN * ROW_BYTES;     // 32 KB (BN = 256) or 16 KB
  static constexpr int B_OFFSET = A_TILES * A_BYTES;  // the B tile's offset in a stage
  static constexpr int STAGE_BYTES = B_OFFSET + B_BYTES;
  static constexpr int EPI_OFFSET = STAGES * STAGE_BYTES;
  static constexpr int BAR_OFFSET = EPI_OFFSET + (STAGING ? 4 * CONSUMER_WGS * EPI_WARP_BYTES : 0);
  static constexpr int NINFO = STAGING ? INFO_SLOTS : 0;
  static constexpr int INFO_OFFSET = BAR_OFFSET + ((8 * (2 * STAGES + (STAGING ? 1 : 0) + NINFO) + 15) & ~15);
  static constexpr int SMEM_BYTES = 1024 + INFO_OFFSET + 16 * NINFO;  // + slack to align the base to 1024
  static_assert(INFO_SLOTS >= STAGES + 1, "a tile descriptor outlives the STAGES k-tiles the producer runs ahead");
};

// ---- PTX wrappers ------------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async16_s(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// Arrive on the mbarrier once every cp.async this thread issued so far has landed (count not raised).
__device__ __forceinline__ void cp_async_arrive_noinc(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(unsigned bar, unsigned parity) {
  unsigned done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// Wait until the phase with parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keep the compiler from moving accumulator reads/writes across the asynchronous wgmma window.
template <int R> __device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int R> __device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R> __device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}

// Shared-memory matrix descriptor, 128-byte swizzle; addresses and offsets in bytes.
__device__ __forceinline__ unsigned long long make_desc(unsigned smem_addr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((smem_addr & 0x3FFFFu) >> 4) | ((unsigned long long)((lbo & 0x3FFFFu) >> 4) << 16) |
         ((unsigned long long)((sbo & 0x3FFFFu) >> 4) << 32) | (1ull << 62);
}

// ---- wgmma.mma_async m64nNk16, fp32 accumulators, A and B from shared memory ----------------------------
// d[N/2] = A(64 x 16) * B(16 x N) + (scale_d ? d : 0). TRANS_B = 1: B stored N-major; TRANS_A = 1: A stored
// M-major (the weight-gradient kernel, whose reduction dim is the row index of both operands).
template <int N, typename T> struct Wgmma;

#define BLZ_WG_DSTR_128 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define BLZ_WG_DOPS_128 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define BLZ_WG_DSTR_256 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define BLZ_WG_DOPS_256 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
// One specialization per (N, element type); REGS = N / 2 accumulator operands come first, then the two
// descriptors (%REGS, %REGS+1), scale_d (%REGS+2), the transpose-B (%REGS+3) and transpose-A (%REGS+4)
// immediates.
#define BLZ_WGMMA_SPEC(N, CT, PT, IDA, IDB, ISD, ITB, ITA)                                                  \
  template <> struct Wgmma<N, CT> {                                                                         \
    template <int TRANS_B, int TRANS_A = 0>                                                                 \
    static __device__ __forceinline__ void mma(float (&d)[N / 2], unsigned long long da, unsigned long long db, \
                                               int scale_d) {                                               \
      asm volatile("{\n.reg .pred sd;\nsetp.ne.b32 sd, %" ISD ", 0;\n"                                      \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PT "." PT " {" BLZ_WG_DSTR_##N "}, %" IDA \
                   ", %" IDB ", sd, 1, 1, %" ITA ", %" ITB ";\n}\n"                                         \
                   : BLZ_WG_DOPS_##N                                                                        \
                   : "l"(da), "l"(db), "r"(scale_d), "n"(TRANS_B), "n"(TRANS_A));                            \
    }                                                                                                       \
  };
// A from registers (WgmmaRs): the warp's 16 rows x 16 k of the 64 x 16 A tile in a[4], in the layout of
// mma.m16n8k16's A fragment (ldmatrix.x4 of the four 8 x 8 blocks: rows 0-7 / 8-15, k 0-7 / 8-15); operands:
// REGS accumulators, a[0..3] (%REGS..%REGS+3), B's descriptor (%REGS+4), scale_d (%REGS+5), transpose-B (%REGS+6).
template <int N, typename T> struct WgmmaRs;
#define BLZ_WGMMA_RS_SPEC(N, CT, PT, IA0, IA1, IA2, IA3, IDB, ISD, ITB)                                        \
  template <> struct WgmmaRs<N, CT> {                                                                       \
    template <int TRANS_B>                                                                                  \
    static __device__ __forceinline__ void mma(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long db, \
                                               int scale_d) {                                               \
      asm volatile("{\n.reg .pred sd;\nsetp.ne.b32 sd, %" ISD ", 0;\n"                                      \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PT "." PT " {" BLZ_WG_DSTR_##N "}, {%" IA0 \
                   ", %" IA1 ", %" IA2 ", %" IA3 "}, %" IDB ", sd, 1, 1, %" ITB ";\n}\n"                       \
                   : BLZ_WG_DOPS_##N                                                                        \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TRANS_B));       \
    }                                                                                                       \
  };
BLZ_WGMMA_RS_SPEC(128, __nv_bfloat16, "bf16", "64", "65", "66", "67", "68", "69", "70")
BLZ_WGMMA_RS_SPEC(128, __half, "f16", "64", "65", "66", "67", "68", "69", "70")
BLZ_WGMMA_RS_SPEC(256, __nv_bfloat16, "bf16", "128", "129", "130", "131", "132", "133", "134")
BLZ_WGMMA_RS_SPEC(256, __half, "f16", "128", "129", "130", "131", "132", "133", "134")
#undef BLZ_WGMMA_RS_SPEC
BLZ_WGMMA_SPEC(128, __nv_bfloat16, "bf16", "64", "65", "66", "67", "68")
BLZ_WGMMA_SPEC(128, __half, "f16", "64", "65", "66", "67", "68")
BLZ_WGMMA_SPEC(256, __nv_bfloat16, "bf16", "128", "129", "130", "131", "132")
BLZ_WGMMA_SPEC(256, __half, "f16", "128", "129", "130", "131", "132")
#undef BLZ_WGMMA_SPEC
#undef BLZ_WG_DSTR_128
#undef BLZ_WG_DOPS_128
#undef BLZ_WG_DSTR_256
#undef BLZ_WG_DOPS_256

// ---- accumulator fragment of wgmma m64nNk16 (fp32) ----------------------------------------------------
// Thread t (0..127) of the warpgroup holds N/2 floats. Register i sits at
//   row = 16 (t / 32) + (t % 32) / 4 + 8 ((i / 2) % 2)          (within the warpgroup's 64 rows)
//   col = 8 (i / 4) + 2 (t % 4) + (i % 2)                       (within N)
// so registers 4j + 2h + {0, 1} are the adjacent columns 8j + 2(t % 4) + {0, 1} of row slot h.
__device__ __forceinline__ int acc_row(int i, int t) {
  return ((t >> 5) << 4) + ((t & 31) >> 2) + (((i >> 1) & 1) << 3);
}
__device__ __forceinline__ int acc_col(int i, int t) { return ((i >> 2) << 3) + ((t & 3) << 1) + (i & 1); }
__host__ __device__ constexpr int acc_reg(int j, int h) { return 4 * j + 2 * h; }

// f(h, row, col, v0, v1) for every pair of adjacent columns the thread holds; h in {0, 1} is the row
// slot (row = acc_row(0, t) + 8 h) and is a compile-time constant after unrolling, so per-row state
// kept in 2-element arrays indexed by h stays in registers. Rows are visited in order, each row's
// columns left to right.
template <int N, class F>
__device__ __forceinline__ void wg_for_each_pair(const float (&acc)[N / 2], int t, F&& f) {
  const int r = acc_row(0, t), c = acc_col(0, t);
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < N / 8; ++j) f(h, r + 8 * h, c + 8 * j, acc[acc_reg(j, h)], acc[acc_reg(j, h) + 1]);
}
// Gated tiles: f(h, row, col, a0, a1, b0, b1) for col < N/2, with (a0, a1) the gate columns col, col+1
// and (b0, b1) the up columns col + N/2, col + N/2 + 1 (registers N/4 further on).
template <int N, class F>
__device__ __forceinline__ void wg_for_each_gated_pair(const float (&acc)[N / 2], int t, F&& f) {
  const int r = acc_row(0, t), c = acc_col(0, t);
  constexpr int UP = N / 16;  // column groups between a gate column and its up column
  static_assert(acc_reg(UP, 0) == N / 4, "gate/up register distance");
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < N / 16; ++j)
      f(h, r + 8 * h, c + 8 * j, acc[acc_reg(j, h)], acc[acc_reg(j, h) + 1], acc[acc_reg(j + UP, h)],
        acc[acc_reg(j + UP, h) + 1]);
}

// Producer, after issuing the copies of k-tile kt into `stage`: make them visible to the consumers.
// Default: the stage's full barrier completes when every producer thread's copies have landed
// (cp.async.mbarrier.arrive.noinc); the consumers fence into the async proxy after their wait.
// BLZ_SM90_PRODUCER_FENCE: the producer waits for tile kt - LAG itself, fences, then arrives.
template <int STAGES> __device__ __forceinline__ void producer_signal(unsigned full0, int kt, int stage) {
#if BLZ_SM90_PRODUCER_FENCE
  constexpr int LAG = STAGES - 2;
  cp_async_commit();
  if (kt >= LAG) {
    cp_async_wait<LAG>();
    fence_proxy_async_smem();
    mbar_arrive(full0 + 8 * ((stage + STAGES - LAG) % STAGES));
  }
#else
  cp_async_arrive_noinc(full0 + 8 * stage);
#endif
}

// Producer, after its last k-tile: let every copy land (and signal the tiles still owed).
template <int STAGES> __device__ __forceinline__ void producer_drain(unsigned full0, int num_kt) {
#if BLZ_SM90_PRODUCER_FENCE
  cp_async_wait<0>();
  fence_proxy_async_smem();
  for (int kt = num_kt - (num_kt < STAGES - 2 ? num_kt : STAGES - 2); kt < num_kt; ++kt)
    mbar_arrive(full0 + 8 * (kt % STAGES));
#else
  cp_async_wait_all();
#endif
}

template <typename T> __device__ __forceinline__ unsigned pack2(float a, float b);
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&v);
}
template <> __device__ __forceinline__ unsigned pack2<__half>(float a, float b) {
  const __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&v);
}
template <typename T> __device__ __forceinline__ unsigned short pack1(float a) {
  const T v = from_f<T>(a);
  return *reinterpret_cast<const unsigned short*>(&v);
}
__device__ __forceinline__ void st_shared_u16(unsigned addr, unsigned short v) {
  asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"(v) : "memory");
}
__device__ __forceinline__ void st_shared_u32(unsigned addr, unsigned v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_s(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ uint4 ld_shared_v4(unsigned addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
// Named barrier 1 over the two consumer warpgroups (the producer warpgroup does not take part).
__device__ __forceinline__ void consumer_bar_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(128 * CONSUMER_WGS) : "memory");
}
template <typename T> __device__ __forceinline__ float2 unpack2(unsigned v);
template <> __device__ __forceinline__ float2 unpack2<__nv_bfloat16>(unsigned v) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}
template <> __device__ __forceinline__ float2 unpack2<__half>(unsigned v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}
// No "memory" clobber: volatile asm statements keep their order, which is all the staged epilogue needs
// within a thread (__syncwarp orders it across lanes).
__device__ __forceinline__ unsigned ld_shared_u32(unsigned addr) {
  unsigned v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void st_shared_v4(unsigned addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
// Byte offset of 16-byte chunk ch of row rl in a staging array of CPR chunks per row. The chunk index is XORed
// with a row hash so that the fragment's 4-byte accesses (8 rows x 4 lanes, one chunk column) are free of bank
// conflicts: rows of >= 128 bytes use row % 8; 64-byte rows (two per 128 bytes) use (row / 2) % 4.
template <int CPR> __device__ __forceinline__ unsigned stage_off(int rl, int ch) {
  static_assert(CPR == 4 || CPR == 8 || CPR == 16 || CPR == 32, "staging rows of 64 to 512 bytes");
  constexpr int SW = CPR < 8 ? CPR : 8, RP = 8 / SW;
  return static_cast<unsigned>(rl * CPR * 16 + ((ch ^ ((rl / RP) % SW)) << 4));
}
// One pass of a staged epilogue over the output columns [p P, p P + P) of the warp's 16 fragment rows (fr, fc:
// the thread's first fragment row within the warp and column). put(h, j, c, off) for every pair of columns the
// thread holds there, in wg_for_each_pair order (j: column group, c: column in the tile, off: the pair's byte
// offset in a staging array of P columns); then, once the warp's writes are visible, copy(rl, off, col) for this
// lane's 16-byte chunks (row rl of the warp, chunk offset off, first column col in the tile). The closing
// __syncwarp lets the next pass (or tile) rewrite the staging.
template <int P, class Put, class Copy>
__device__ __forceinline__ void staged_pass(int p, int fr, int fc, int lane, Put&& put, Copy&& copy) {
  constexpr int PCPR = P / 8, RPI = 32 / PCPR;  // 16-byte chunks per staged row; rows per warp instruction
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int jj = 0; jj < P / 8; ++jj) {
      const int j = p * (P / 8) + jj, c = fc + 8 * j;
      put(h, j, c, stage_off<PCPR>(fr + 8 * h, jj) + (c & 7) * 2);
    }
  __syncwarp();
  const int co = lane % PCPR, ro = lane / PCPR;
#pragma unroll
  for (int i = 0; i < 16 / RPI; ++i) copy(RPI * i + ro, stage_off<PCPR>(RPI * i + ro, co), p * P + co * 8);
  __syncwarp();
}
// v0, v1 += the bias columns col, col + 1 (be: the expert's bias row; none, or col >= n: unchanged)
template <typename T>
__device__ __forceinline__ void add_bias2(const T* be, int col, int n, float& v0, float& v1) {
  if (be && col < n) {
    float x0, x1;
    load2<T>(be + col, x0, x1);
    v0 += x0;
    v1 += x1;
  }
}
// Consumer mainloop shared by both kernels: for each k-tile, wait for its stage, order the cp.async writes
// before the async-proxy reads, issue the tile's wgmmas (issue(stage byte offset >> 4, kt)), keep one wgmma
// group in flight and release the previous stage to the producer. Ends with every group complete; an empty
// reduction (num_kt == 0) leaves zero accumulators, unless keep_acc (the caller loaded partial sums).
// stage / phase: the ring position of the first k-tile, advanced past the last; every stage read is released,
// so a persistent CTA continues with the next tile's k-tiles.
// prep(stage byte offset >> 4, kt), when given, runs after the stage's wait and before the wgmma fence: shared-memory
// fix-ups of the stage (it orders them before the wgmmas itself).
struct NoPrep {
  __device__ __forceinline__ void operator()(unsigned long long, int) const {}
};
template <int STAGES, int R, class F, int INFLIGHT = 1, class P = NoPrep>
__device__ __forceinline__ void consumer_mainloop(float (&acc)[R], unsigned full0, unsigned empty0, int num_kt,
                                                  int t, int stage_bytes, int& stage, unsigned& phase, F&& issue,
                                                  bool keep_acc = false, P&& prep = P()) {
  int prev = 0;
  for (int kt = 0; kt < num_kt; ++kt) {
    mbar_wait(full0 + 8 * stage, phase);
#if !BLZ_SM90_PRODUCER_FENCE
    fence_proxy_async_smem();  // generic-proxy cp.async writes -> async-proxy wgmma reads
#endif
    prep(static_cast<unsigned long long>(static_cast<unsigned>(stage * stage_bytes) >> 4), kt);
    fence_regs(acc);
    wgmma_fence();
    issue(static_cast<unsigned long long>(static_cast<unsigned>(stage * stage_bytes) >> 4), kt);
    wgmma_commit();
    wgmma_wait<INFLIGHT>();  // the k-tile before this one is done (INFLIGHT 1): its stage can be refilled
    fence_regs(acc);
    if constexpr (INFLIGHT == 0) {
      // every consumer thread read the stage itself (ldmatrix), so each releases it: the empty barrier counts
      // 128 * CONSUMER_WGS arrivals for these kernels
      mbar_arrive(empty0 + 8 * stage);
    } else {
      if (kt > 0 && (t & 31) == 0) mbar_arrive(empty0 + 8 * prev);
    }
    prev = stage;
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1u;
    }
  }
  wgmma_wait<0>();
  fence_regs(acc);
  if (INFLIGHT != 0 && num_kt > 0 && (t & 31) == 0) mbar_arrive(empty0 + 8 * prev);
  if (num_kt == 0 && !keep_acc) {
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.f;
  }
}

}  // namespace sm90

// ---- the kernel ----------------------------------------------------------------------------------------
// Same parameter list as moe_gemm (MODE_M); M is unused here, and so is o_estride but for EPI_DHCUR, where a
// nonzero o_estride is the column offset of z's and dz's up half (a launch over a column slice of h passes h;
// 0 means N), and for a gated EPI_ACT, where it is the offset of B's up-half rows (N-major: columns) and of the
// bias' up half (a launch over a column slice of h passes h; 0 means N; z's up half stays at column N).
// T is __nv_bfloat16 or __half.
// Launch: any grid (persistent: the CTAs share out the tile_offsets[E] * tiles_n tiles, tiles_n = ceil(N / (GATED ?
// BN/2 : BN))); one CTA per SM is what the launcher uses. block = sm90::THREADS (384), dynamic shared memory =
// sm90::Cfg<BN>::SMEM_BYTES. Precondition: Kd > 0.
// B_TMA: the B tile comes by TMA (tmap_b, see below) instead of cp.async; the gathered A rows stay on cp.async.
// tmap_b (ignored unless B_TMA), encoded by blazecore/_tma.py with 128-byte swizzle, zero fill out of bounds:
//   K-major B (E, [2,] N, Kd): 4-D (Kd, N, halves, E), box (64, BN/2, 1, 1): two boxes per stage, the gate and up
//     rows of a gated tile (halves = 2) or rows n0 and n0 + BN/2 (halves = 1); each box lands as BN/2 swizzled
//     128-byte rows, which is the layout the cp.async path writes.
//   N-major B (E, Kd, N): 3-D (N, Kd, E), box (64, 64, 1): BN/64 boxes per stage, one per 64-column atom.
template <typename T, bool B_KMAJOR, int EPI, int ACT, bool A_GATHER, int BN = 256, bool B_TMA = false,
          bool A_ACT = false>
__global__ void __launch_bounds__(sm90::THREADS, 1) moe_gemm_sm90(
    const T* __restrict__ A, long long lda,
    const T* __restrict__ B, long long ldb, long long b_estride,
    const int* __restrict__ slot_token,
    const int* __restrict__ slot_k,
    const int* __restrict__ offsets,
    const int* __restrict__ tile_offsets,
    int num_experts, int M, int N, int Kd,
    T* out, long long ldo, long long o_estride,  // out and aux may alias (EPI_DHCUR writes dz over z)
    T* __restrict__ out2, long long ldo2,
    const T* aux, long long ldaux,
    const T* __restrict__ bias, long long bias_estride,
    const float* __restrict__ gates, int topk,
    float* __restrict__ part, int part_ld,
    int flags,
    const int* __restrict__ kblocks, int num_kblocks,  // K-grouped: token-block starts (KTileWalk)
    float* __restrict__ carry, const int* __restrict__ carry_seen,  // K-grouped: fp32 partial sums
    const __grid_constant__ sm90::TmaMap tmap_b) {                   // B_TMA: the B operand's tensor map
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(sizeof(T) == 2, "wgmma path: 16-bit element types only");
  static_assert(EPI == EPI_ACT || EPI == EPI_ROWSCALE || EPI == EPI_DHCUR, "MODE_M epilogues only");
  // local names (moe.cu has its own BM, BK, STAGES at namespace scope)
  constexpr int BM = sm90::BM, BK = sm90::BK, ROW_BYTES = sm90::ROW_BYTES;
  // A_ACT: A holds pre-activations z in slot order (gated: the gate columns [0, Kd), the up columns [Kd, 2 Kd));
  // the consumers read A's fragments into registers and apply the activation there (hcur is never stored)
  static_assert(!A_ACT || (EPI == EPI_ROWSCALE && !A_GATHER), "A_ACT: the second GEMM's slot-ordered A only");
  constexpr bool A2 = A_ACT && act_gated(ACT);  // two A tiles a stage: gate and up
  using C = sm90::Cfg<BN, true, A2 ? 2 : 1>;
  constexpr int STAGES = C::STAGES;
  constexpr int EPC = 8;  // elements per 16-byte chunk
  constexpr bool GATED = (EPI == EPI_ACT) && act_gated(ACT);
  static_assert(!(B_TMA && GATED && !B_KMAJOR), "TMA B: gated tiles need K-major weights");
  extern __shared__ unsigned char sm90_smem[];
  const unsigned sbase = (smem_u32(sm90_smem) + 1023u) & ~1023u;
  const unsigned full0 = sbase + C::BAR_OFFSET, empty0 = full0 + 8 * STAGES;
  const unsigned epi_done = empty0 + 8 * STAGES;  // EPI_DHCUR: the consumer warps are done with the ring
  const unsigned info_full0 = epi_done + 8;       // tile descriptor li % INFO_SLOTS is written
  const unsigned info0 = sbase + C::INFO_OFFSET;  // descriptors {e, m0, m_end, tn}, 16 bytes each

  const int tid = threadIdx.x;

  // ---- tile schedule -----------------------------------------------------------------------------------
  // Persistent CTAs: CTA b takes the tiles b, b + gridDim.x, b + 2 gridDim.x, ... of the list of the
  // tile_offsets[E] * tiles_n tiles that exist (the count is read on the device). Grouped rasterization: tile
  // number v walks GROUP_M m-tiles down one n-tile, then the next n-tile, so the CTAs working at a time share
  // a few B (weight) slices and a few A row blocks in L2; with tmg-major order an expert whose weights exceed
  // L2 (e.g. h = 14336) would stream them from DRAM once per m-tile. The producer decodes each tile and hands
  // it to the consumers through a shared-memory descriptor, so the decode (a binary search over
  // tile_offsets) stays off the consumers' path; it runs ahead into the next tile's k-tiles while the
  // consumers finish the current one.
  constexpr int GROUP_M = 16;
  const int tiles_n = GATED ? (N + BN / 2 - 1) / (BN / 2) : (N + BN - 1) / BN;
  const int mt_total = __ldg(tile_offsets + num_experts);
  const int total = mt_total * tiles_n;
  const int num_kt = (Kd + BK - 1) / BK;  // >= 1 (Kd > 0 for every M-grouped GEMM)
  const long long zup = (EPI == EPI_DHCUR && o_estride) ? o_estride : N;  // EPI_DHCUR: z / dz up-half offset
  const long long bup = (GATED && o_estride) ? o_estride : N;  // gated EPI_ACT: B's and the bias' up-half offset

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      // one arrival per producer thread (cp.async), + the B_TMA issuing thread's expect_tx arrival
      sm90::mbar_init(full0 + 8 * s, 128 + (B_TMA ? 1 : 0));
      // one arrival per consumer warp; A_ACT: per consumer thread (each reads the stage with ldmatrix)
      sm90::mbar_init(empty0 + 8 * s, (A_ACT ? 128 : 4) * sm90::CONSUMER_WGS);
    }
    sm90::mbar_init(epi_done, 4 * sm90::CONSUMER_WGS);
#pragma unroll
    for (int i = 0; i < sm90::INFO_SLOTS; ++i) sm90::mbar_init(info_full0 + 8 * i, 1);
  }
  __syncthreads();

  if (tid < 128) {
    // ================================ producer warpgroup ================================
    sm90::setmaxnreg_dec<sm90::PRODUCER_REGS>();
    // A: 8 threads per 128-byte row, rows r0 + 16 i; the swizzled chunk position is the same for all i.
    const int cc = tid & 7, r0 = tid >> 3;
    const unsigned a_sw = static_cast<unsigned>((cc ^ (r0 & 7)) << 4);
    // B N-major: CPR 16-byte chunks per k-row, RPP k-rows per pass; chunk column cn.
    constexpr int CPR = BN / EPC, RPP = 128 / CPR;
    const int cn = tid % CPR, rb = tid / CPR;
    const unsigned b_atom = static_cast<unsigned>((cn >> 3) * (BK * ROW_BYTES)), b_j = cn & 7;
    if constexpr (B_TMA) {
      if (tid == 0) sm90::tma_prefetch_map(&tmap_b);
    }
    int stage = 0, it = 0;  // ring position and k-tile count over all of this CTA's tiles
    unsigned phase = 0;
    int li = 0;
    for (int v = static_cast<int>(blockIdx.x); v < total; v += static_cast<int>(gridDim.x), ++li) {
      const int grp = v / (GROUP_M * tiles_n), first = grp * GROUP_M;
      const int gsz = min(GROUP_M, mt_total - first), local = v - first * tiles_n;
      const int tmg = first + local % gsz, tn = local / gsz;
      const int e = find_expert(tile_offsets, num_experts, tmg);
      const int m0 = __ldg(offsets + e) + (tmg - __ldg(tile_offsets + e)) * BM;
      const int m_end = __ldg(offsets + e + 1);
      const int n0 = GATED ? tn * (BN / 2) : tn * BN;  // first output column of the tile
      if (tid == 0) {
        // slot li % INFO_SLOTS was last read by the consumers before they released the k-tiles of tile
        // li - INFO_SLOTS, which this thread has waited for (INFO_SLOTS >= STAGES + 1)
        const uint4 desc = make_uint4(static_cast<unsigned>(e), static_cast<unsigned>(m0), static_cast<unsigned>(m_end),
                                      static_cast<unsigned>(tn));
        sm90::st_shared_v4(info0 + 16 * (li % sm90::INFO_SLOTS), desc);
        sm90::mbar_arrive(info_full0 + 8 * (li % sm90::INFO_SLOTS));
      }
      // Source rows are kept as 32-bit row indices (-1: past the expert's slots, zero-filled).
      int a_row[BM / 16];
#pragma unroll
      for (int i = 0; i < BM / 16; ++i) {
        const int s = m0 + r0 + 16 * i;
        a_row[i] = (s < m_end) ? (A_GATHER ? __ldg(slot_token + s) : s) : -1;
      }
      // B K-major: rows r0 + 16 i of the [BN][64] tile (gated: first half gate rows n0 + .., second half
      // the up rows bup + n0 + ..); b_ok bit i: that row's output column is in range; b_off0 / b_off1: element
      // offsets (within expert e) of this thread's first gate (or plain) row and first up row.
      // B N-major: b_off0: element offset of (k-row rb, this chunk's global column); b_ok: column in range.
      unsigned b_ok = 0;
      long long b_off0 = 0, b_off1 = 0;
      if constexpr (B_TMA) {
        // the tensor map holds the addressing and the bounds
      } else if constexpr (B_KMAJOR) {
        constexpr int ROWS = GATED ? BN / 32 : BN / 16;  // rows per half (gated) or per tile
#pragma unroll
        for (int i = 0; i < ROWS; ++i) b_ok |= (n0 + r0 + 16 * i < N ? 1u : 0u) << i;
        b_off0 = (long long)(n0 + r0) * ldb + cc * EPC;
        b_off1 = (bup + n0 + r0) * ldb + cc * EPC;
      } else {
        int n, col;
        if constexpr (GATED) {
          n = n0 + (cn % (CPR / 2)) * EPC;
          col = (cn < CPR / 2) ? n : static_cast<int>(bup) + n;
        } else {
          n = n0 + cn * EPC;
          col = n;
        }
        b_ok = n < N ? 1u : 0u;
        b_off0 = (long long)rb * ldb + col;
      }
      const T* Be = B + (long long)e * b_estride;
      // EPI_DHCUR stages its epilogue in the ring: the previous tile's must be done before the ring refills
      if constexpr (EPI == EPI_DHCUR) {
        if (li > 0) sm90::mbar_wait(epi_done, static_cast<unsigned>(li - 1) & 1u);
      }

      // EPI_DHCUR reads the tile's z rows after the mainloop: pull them into L2 2 * STAGES k-tiles before its
      // end (thread p: row m0 + p; 128-byte lines of the gate columns [n0, n0 + BN) and, gated, the up columns).
      const int pf_kt = EPI == EPI_DHCUR ? max(0, num_kt - 2 * STAGES) : -1;
      for (int kt = 0; kt < num_kt; ++kt, ++it) {
        if constexpr (EPI == EPI_DHCUR) {
          if (kt == pf_kt && m0 + tid < m_end) {
            const T* zr = aux + (long long)(m0 + tid) * ldaux + n0;
#pragma unroll
            for (int c = 0; c < BN / 64; ++c) {
              if (n0 + 64 * c < N) {
                sm90::prefetch_l2(zr + 64 * c);
                if constexpr (act_gated(ACT)) sm90::prefetch_l2(zr + zup + 64 * c);
              }
            }
          }
        }
        if (it >= STAGES) sm90::mbar_wait(empty0 + 8 * stage, phase ^ 1u);  // consumers released this stage
        const unsigned as = sbase + stage * C::STAGE_BYTES, bs = as + C::B_OFFSET;
        const int k0 = kt * BK;
        const int kc = k0 + cc * EPC;
        const bool kok = kc < Kd;
#pragma unroll
        for (int i = 0; i < BM / 16; ++i) {
          const bool ok = kok && a_row[i] >= 0;
          const T* src = ok ? A + (long long)a_row[i] * lda + kc : A;
          sm90::cp_async16_s(as + (r0 + 16 * i) * ROW_BYTES + a_sw, src, ok ? 16 : 0);
          if constexpr (A2) sm90::cp_async16_s(as + C::A_BYTES + (r0 + 16 * i) * ROW_BYTES + a_sw, ok ? src + Kd : A,
                                               ok ? 16 : 0);
        }
        if constexpr (B_TMA) {
          // one thread issues the stage's boxes after raising the full barrier's transaction count by B_BYTES
          if (tid == 0) {
            const unsigned bar = full0 + 8 * stage;
            sm90::mbar_arrive_expect_tx(bar, C::B_BYTES);
            if constexpr (B_KMAJOR) {
              constexpr int HALF = BN / 2;  // rows per box
              sm90::tma_load_4d(bs, &tmap_b, bar, k0, n0, 0, e);
              sm90::tma_load_4d(bs + HALF * ROW_BYTES, &tmap_b, bar, k0, GATED ? n0 : n0 + HALF, GATED ? 1 : 0, e);
            } else {
#pragma unroll
              for (int a = 0; a < BN / 64; ++a)
                sm90::tma_load_3d(bs + a * (BK * ROW_BYTES), &tmap_b, bar, n0 + 64 * a, k0, e);
            }
          }
        } else if constexpr (B_KMAJOR) {
          constexpr int ROWS = GATED ? BN / 32 : BN / 16;
          const long long step = 16 * ldb;
#pragma unroll
          for (int half = 0; half < (GATED ? 2 : 1); ++half) {
            const T* src = Be + (half ? b_off1 : b_off0) + k0;
#pragma unroll
            for (int i = 0; i < ROWS; ++i, src += step) {
              const bool ok = kok && ((b_ok >> i) & 1u);
              sm90::cp_async16_s(bs + (r0 + 16 * (half * ROWS + i)) * ROW_BYTES + a_sw, ok ? src : B, ok ? 16 : 0);
            }
          }
        } else {
          // k-rows rb + RPP i of BN/64 atoms [64 k][64 n]
          const long long step = RPP * ldb;
          const T* src = Be + b_off0 + (long long)k0 * ldb;
#pragma unroll
          for (int i = 0; i < BK / RPP; ++i, src += step) {
            const int r = rb + RPP * i;
            const bool ok = b_ok && k0 + r < Kd;
            sm90::cp_async16_s(bs + b_atom + r * ROW_BYTES + ((b_j ^ static_cast<unsigned>(r & 7)) << 4),
                               ok ? src : B, ok ? 16 : 0);
          }
        }
        sm90::producer_signal<STAGES>(full0, it, stage);
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1u;
        }
      }
    }
    if (tid == 0) {
      // end of the CTA's tiles: a descriptor with e = ~0 (the slot is free, as for a tile li)
      sm90::st_shared_v4(info0 + 16 * (li % sm90::INFO_SLOTS), make_uint4(~0u, 0u, 0u, 0u));
      sm90::mbar_arrive(info_full0 + 8 * (li % sm90::INFO_SLOTS));
    }
    sm90::producer_drain<STAGES>(full0, it);
  } else {
    // ================================ consumer warpgroups ================================
    sm90::setmaxnreg_inc<sm90::CONSUMER_REGS>();
    const int cw = (tid >> 7) - 1;  // rows [64 cw, 64 cw + 64) of the tile
    const int t = tid & 127;
    const int lane = t & 31, wq = t >> 5;  // warp wq of the warpgroup: rows [16 wq, 16 wq + 16)
    // this warp's epilogue staging (EPI_ACT, EPI_ROWSCALE), outside the ring the producer is refilling
    const unsigned ep = sbase + C::EPI_OFFSET + static_cast<unsigned>((cw * 4 + wq) * sm90::EPI_WARP_BYTES);
    // No zero-fill before the mainloop (a non-wgmma write of the accumulators would make ptxas
    // serialize the wgmma pipeline, C7515): the first wgmma runs with scale_d = 0 instead.
    float acc[BN / 2];

    const unsigned long long da0 = sm90::make_desc(sbase + cw * 64 * ROW_BYTES, 16, 1024);
    const unsigned long long db0 = B_KMAJOR ? sm90::make_desc(sbase + C::B_OFFSET, 16, 1024)
                                            : sm90::make_desc(sbase + C::B_OFFSET, BK * ROW_BYTES, 1024);
    // A_ACT: this lane's ldmatrix.x4 row (block q = lane / 8: rows + 8 (q % 2), k chunk + q / 2) in the A tile
    const int a_q = lane >> 3, a_r = lane & 7;
    const unsigned a_row_off = static_cast<unsigned>((cw * 64 + wq * 16 + (a_q & 1) * 8 + a_r) * ROW_BYTES);
    constexpr unsigned B_KSTEP = B_KMAJOR ? (16 * 2) >> 4 : (16 * ROW_BYTES) >> 4;  // k16 step, encoded

    int stage = 0;
    unsigned phase = 0;
    for (int li = 0;; ++li) {  // the producer's tiles, in its order, until its end descriptor
      sm90::mbar_wait(info_full0 + 8 * (li % sm90::INFO_SLOTS), static_cast<unsigned>(li / sm90::INFO_SLOTS) & 1u);
      const uint4 ti = sm90::ld_shared_v4(info0 + 16 * (li % sm90::INFO_SLOTS));
      if (ti.x == ~0u) break;
      const int e = static_cast<int>(ti.x), m0 = static_cast<int>(ti.y), m_end = static_cast<int>(ti.z);
      const int tn = static_cast<int>(ti.w);
      const int n0 = GATED ? tn * (BN / 2) : tn * BN;  // first output column of the tile

      auto issue = [&](unsigned long long soff, int kt) {
        if constexpr (A_ACT) {
          // the k-tile's A fragments from shared memory (z, 128-byte swizzled rows), activated in fp32, rounded
          const unsigned st = sbase + (static_cast<unsigned>(soff) << 4) + a_row_off;
          unsigned af[BK / 16][4];
#pragma unroll
          for (int ks = 0; ks < BK / 16; ++ks) {
            const unsigned off = static_cast<unsigned>(((2 * ks + (a_q >> 1)) ^ a_r) << 4);
            unsigned g[4];
            sm90::ldmatrix_x4_s(g, st + off);
            if constexpr (A2) {
              unsigned u[4];
              sm90::ldmatrix_x4_s(u, st + C::A_BYTES + off);
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const float2 a = sm90::unpack2<T>(g[i]), b = sm90::unpack2<T>(u[i]);
                af[ks][i] = sm90::pack2<T>(gated_f<ACT>(a.x, b.x), gated_f<ACT>(a.y, b.y));
              }
            } else {
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const float2 a = sm90::unpack2<T>(g[i]);
                af[ks][i] = sm90::pack2<T>(act_f<ACT>(a.x), act_f<ACT>(a.y));
              }
            }
          }
          sm90::wgmma_fence();  // the A registers were written by other instructions
#pragma unroll
          for (int ks = 0; ks < BK / 16; ++ks)
            sm90::WgmmaRs<BN, T>::template mma<B_KMAJOR ? 0 : 1>(acc, af[ks], db0 + soff + ks * B_KSTEP, (kt | ks) != 0);
        } else {
#pragma unroll
          for (int ks = 0; ks < BK / 16; ++ks)
            sm90::Wgmma<BN, T>::template mma<B_KMAJOR ? 0 : 1>(acc, da0 + soff + ks * 2, db0 + soff + ks * B_KSTEP,
                                                               (kt | ks) != 0);
        }
      };
      // A_ACT: the A registers are rewritten every k-tile, so each k-tile's wgmmas finish before the next is read
      // (the other consumer warpgroup's wgmmas overlap this one's activation math)
      sm90::consumer_mainloop<STAGES, BN / 2, decltype(issue)&, A_ACT ? 0 : 1>(
          acc, full0, empty0, num_kt, t, C::STAGE_BYTES, stage, phase, issue);

      // ---- epilogues (same math as moe_gemm; fragment walk from the wgmma layout) --------------------
      const int srow0 = m0 + cw * 64;     // slot of warpgroup row 0
      const int wrow0 = srow0 + 16 * wq;  // slot of the warp's first row
      const int fr = sm90::acc_row(0, t) - 16 * wq, fc = sm90::acc_col(0, t);  // fragment row (in the warp), column
      if constexpr (EPI == EPI_ACT) {
        // In passes of P output columns through the warp's staging: the activation h and the pre-activations z
        // (gated: gate and up parts) go out as 16-byte row copies. A tile covers NC output columns (gated: BN / 2
        // of h, with the matching gate and up columns of z).
        constexpr int NC = GATED ? BN / 2 : BN;
        constexpr int P = GATED ? 32 : 64, NARR = GATED ? 3 : 2, ARR = 16 * P * 2;
        static_assert(NARR * ARR <= sm90::EPI_WARP_BYTES, "act staging fits in the warp's area");
        const T* be = bias ? bias + (long long)e * bias_estride : nullptr;
        T* hout = (flags & 1) ? out : nullptr;
        T* zout = (flags & 2) ? out2 : nullptr;
        const unsigned hs = ep, za = ep + ARR, zb = ep + 2 * ARR;  // zb: gated only
#pragma unroll
        for (int p = 0; p < NC / P; ++p) {
          sm90::staged_pass<P>(p, fr, fc, lane, [&](int h, int j, int c, unsigned off) {
            if constexpr (GATED) {
              constexpr int UP = BN / 16;  // column groups between a gate column and its up column
              float a0 = acc[sm90::acc_reg(j, h)], a1 = acc[sm90::acc_reg(j, h) + 1];
              float b0 = acc[sm90::acc_reg(j + UP, h)], b1 = acc[sm90::acc_reg(j + UP, h) + 1];
              sm90::add_bias2(be, n0 + c, N, a0, a1);
              sm90::add_bias2(be ? be + bup : be, n0 + c, N, b0, b1);
              // hcur from z as stored (rounded to T), as the A_ACT second GEMM and the backward recompute it
              const unsigned zav = sm90::pack2<T>(a0, a1), zbv = sm90::pack2<T>(b0, b1);
              const float2 ar = sm90::unpack2<T>(zav), br = sm90::unpack2<T>(zbv);
              sm90::st_shared_u32(hs + off, sm90::pack2<T>(gated_f<ACT>(ar.x, br.x), gated_f<ACT>(ar.y, br.y)));
              sm90::st_shared_u32(za + off, zav);
              sm90::st_shared_u32(zb + off, zbv);
            } else {
              float z0 = acc[sm90::acc_reg(j, h)], z1 = acc[sm90::acc_reg(j, h) + 1];
              sm90::add_bias2(be, n0 + c, N, z0, z1);
              const unsigned zv = sm90::pack2<T>(z0, z1);
              const float2 zr = sm90::unpack2<T>(zv);
              sm90::st_shared_u32(hs + off, sm90::pack2<T>(act_f<ACT>(zr.x), act_f<ACT>(zr.y)));
              sm90::st_shared_u32(za + off, zv);
            }
          }, [&](int rl, unsigned off, int col) {
            const int s = wrow0 + rl, nc = n0 + col;
            if (s < m_end && nc < N) {
              if (hout) *reinterpret_cast<uint4*>(hout + (long long)s * ldo + nc) = sm90::ld_shared_v4(hs + off);
              if (zout) {
                T* zr = zout + (long long)s * ldo2 + nc;
                *reinterpret_cast<uint4*>(zr) = sm90::ld_shared_v4(za + off);
                if constexpr (GATED) *reinterpret_cast<uint4*>(zr + N) = sm90::ld_shared_v4(zb + off);
              }
            }
          });
        }
      } else if constexpr (EPI == EPI_ROWSCALE) {
        // (acc + bias) * gate, in passes of P columns through the warp's staging for 16-byte row stores
        constexpr int P = 128;
        static_assert(16 * P * 2 <= sm90::EPI_WARP_BYTES, "rowscale staging fits in the warp's area");
        const T* be = bias ? bias + (long long)e * bias_estride : nullptr;
        float gs[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int s = srow0 + sm90::acc_row(2 * h, t);
          gs[h] = (gates && s < m_end) ? slot_gate(gates, slot_token, slot_k, topk, s) : 1.f;
        }
#pragma unroll
        for (int p = 0; p < BN / P; ++p) {
          sm90::staged_pass<P>(p, fr, fc, lane, [&](int h, int j, int c, unsigned off) {
            float o0 = acc[sm90::acc_reg(j, h)], o1 = acc[sm90::acc_reg(j, h) + 1];
            sm90::add_bias2(be, n0 + c, N, o0, o1);
            sm90::st_shared_u32(ep + off, sm90::pack2<T>(o0 * gs[h], o1 * gs[h]));
          }, [&](int rl, unsigned off, int col) {
            const int s = wrow0 + rl, nc = n0 + col;
            if (s < m_end && nc < N)
              *reinterpret_cast<uint4*>(out + (long long)s * ldo + nc) = sm90::ld_shared_v4(ep + off);
          });
        }
      } else {  // EPI_DHCUR: acc = dh' = dy_t w2_e (columns of h); out = dz (may alias aux = z), out2 = g * hcur
        // The z rows are read and dz / g*hcur written through the (idle) stage ring with 16-byte row
        // copies: each warp stages its 16 rows x BN columns of z-gate, z-up and hg (3 x 8 KB at BN 256; 8 warps
        // = 192 KB of the 196 KB ring). 16-byte chunks are XOR-swizzled by row (chunk ^ (row & 7)), which keeps
        // both the row copies and the fragment-pattern 4-byte accesses free of bank conflicts.
        constexpr bool G2 = act_gated(ACT);
        constexpr int RB = BN * 2;                         // bytes per staged row
        constexpr int ARR = 16 * RB;                       // bytes per staged 16-row array
        constexpr int NARR = G2 ? 3 : 2;
        constexpr int CPR = BN / EPC, RPI = 32 / CPR;      // chunks per row; rows per warp instruction
        static_assert(8 * NARR * ARR <= STAGES * C::STAGE_BYTES, "dhcur staging fits in the stage ring");
        const unsigned za = sbase + static_cast<unsigned>((cw * 4 + wq) * NARR * ARR);
        const unsigned zb = za + ARR, hs = za + (NARR - 1) * ARR;
        auto chunk_off = [](int rl, int ch) { return static_cast<unsigned>(rl * RB + ((ch ^ (rl & 7)) << 4)); };
        const int co = lane % CPR, ro = lane / CPR, nc = n0 + co * EPC;
        sm90::consumer_bar_sync();  // both warpgroups' wgmma are done with the ring before it is overwritten
        // every z chunk of the warp's rows in flight at once (cp.async straight into the staging; zero-filled
        // past the expert's rows or the last column), then one wait
#pragma unroll
        for (int i = 0; i < 16 / RPI; ++i) {
          const int rl = RPI * i + ro, s = wrow0 + rl;
          const bool ok = s < m_end && nc < N;
          const T* zr = aux + (long long)s * ldaux + nc;
          sm90::cp_async16_s(za + chunk_off(rl, co), ok ? zr : aux, ok ? 16 : 0);
          if constexpr (G2) sm90::cp_async16_s(zb + chunk_off(rl, co), ok ? zr + zup : aux, ok ? 16 : 0);
        }
        sm90::cp_async_wait_all();
        __syncwarp();
        float gs[2], psum[2] = {0.f, 0.f};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int s = srow0 + sm90::acc_row(2 * h, t);
          gs[h] = (s < m_end) ? slot_gate(gates, slot_token, slot_k, topk, s) : 0.f;
        }
        // The fragment's pairs in batches of JB column groups: the batch's z loads are issued together, so a
        // warp waits for shared memory once per batch instead of once per pair (the volatile shared-memory
        // accesses keep program order). Same visiting order as wg_for_each_pair: psum adds in a fixed order.
        {
          constexpr int JB = 8;
          const int r0 = sm90::acc_row(0, t) - 16 * wq, c0 = sm90::acc_col(0, t);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int rl = r0 + 8 * h;
#pragma unroll
            for (int jb = 0; jb < BN / 8; jb += JB) {
              unsigned av[JB], bv[JB];
#pragma unroll
              for (int u = 0; u < JB; ++u) {
                const int c = c0 + 8 * (jb + u);
                const unsigned off = chunk_off(rl, c >> 3) + (c & 7) * 2;
                av[u] = sm90::ld_shared_u32(za + off);
                bv[u] = G2 ? sm90::ld_shared_u32(zb + off) : 0u;
              }
#pragma unroll
              for (int u = 0; u < JB; ++u) {
                const int c = c0 + 8 * (jb + u);
                const unsigned off = chunk_off(rl, c >> 3) + (c & 7) * 2;
                const int i = sm90::acc_reg(jb + u, h);
                const float2 a = sm90::unpack2<T>(av[u]);
                const float2 b = G2 ? sm90::unpack2<T>(bv[u]) : make_float2(0.f, 0.f);
                const DhcurPair q = dhcur_math<ACT>(a.x, a.y, b.x, b.y, acc[i], acc[i + 1], gs[h]);
                sm90::st_shared_u32(za + off, sm90::pack2<T>(q.da0, q.da1));
                if constexpr (G2) sm90::st_shared_u32(zb + off, sm90::pack2<T>(q.db0, q.db1));
                sm90::st_shared_u32(hs + off, sm90::pack2<T>(q.hg0, q.hg1));
                psum[h] += q.p;  // rows / columns outside the problem hold z = 0 and dh' = 0: they add 0
              }
            }
          }
        }
        __syncwarp();
#pragma unroll 1
        for (int i = 0; i < 16 / RPI; ++i) {
          const int rl = RPI * i + ro, s = wrow0 + rl;
          if (s < m_end && nc < N) {
            T* dzr = out + (long long)s * ldo + nc;
            *reinterpret_cast<uint4*>(dzr) = sm90::ld_shared_v4(za + chunk_off(rl, co));
            if constexpr (G2) *reinterpret_cast<uint4*>(dzr + zup) = sm90::ld_shared_v4(zb + chunk_off(rl, co));
            *reinterpret_cast<uint4*>(out2 + (long long)s * ldo2 + nc) = sm90::ld_shared_v4(hs + chunk_off(rl, co));
          }
        }
        // A row lives in the 4 lanes of one quad (all BN columns): fixed-order butterfly, one store.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float v = psum[h];
          v += __shfl_xor_sync(0xffffffffu, v, 1);
          v += __shfl_xor_sync(0xffffffffu, v, 2);
          const int s = srow0 + sm90::acc_row(2 * h, t);
          if ((t & 3) == 0 && s < m_end) part[(long long)s * part_ld + tn] = v;
        }
        // B_TMA: the producer refills the ring through the async proxy; order this thread's generic accesses of
        // the staging (cp.async, st.shared, ld.shared) before those writes
        if constexpr (B_TMA) sm90::fence_proxy_async_smem();
        __syncwarp();
        if (lane == 0) sm90::mbar_arrive(epi_done);  // this warp is done with the ring: the producer may refill it
      }
    }
  }
#else
  // Built for another target: this kernel needs sm_90a (wgmma, setmaxnreg); launch moe_gemm instead.
  __trap();
#endif
}


// ---- K-grouped weight gradient (MODE_K, EPI_WGRAD) -------------------------------------------------------
//
//   W_e[m, n] = sum over slots s in [offsets[e], offsets[e+1]), in slot order, of A[rowA(s), m] * B[rowB(s), n]
//   rowA(s) = slot_token[s] (A_GATHER) or s; rowB(s) likewise (B_GATHER); W is (E, M, N) row-major (o_estride).
//
// CTA = (expert e, 128-row m-tile, BN-column n-tile), 1-D grid, expert-major:
//   bid = (e * tiles_m + tm) * tiles_n + tn,  tiles_m = ceil(M / 128), tiles_n = ceil(N / BN).
// One CTA reduces all of the expert's slots in order (no split-K, no atomics: deterministic); an expert with
// no slots writes zeros. Same warpgroup roles, stage ring, barriers and register split as moe_gemm_sm90.
// The reduction dim is the row index of both operands, so both tiles are stored MN-major:
//   A stage: 2 atoms [64 slots][64 m] (8 KB each); atom a = columns m0 + [64 a, 64 a + 64) = the rows of
//            consumer warpgroup a; k-row r at r * 128, 16-byte chunk j (columns 8j..8j+7) at j ^ (r % 8).
//   B stage: BN / 64 atoms [64 slots][64 n], the same as moe_gemm_sm90's N-major B.
//   Descriptors: LBO = 8192 (next 64-column atom; never used for A, whose 64 rows are one atom), SBO = 1024
//   (next 8 slots), k16 step = 2048 bytes; wgmma runs with transpose-A = transpose-B = 1.
// Producer: warp w copies k-rows [16 w, 16 w + 16) of each k-tile. Lanes 0..15 (and their twins 16..31)
// hold the gather index slot_token[s] of row 16 w + (lane % 16), loaded one k-tile ahead; the gathered
// operand's row index reaches the copying lane by __shfl_sync. A row is 128 columns = 16 chunks (2 rows
// per warp instruction), a B row BN / 8 chunks (BN = 256: 1 row, 512 contiguous bytes per instruction).
// Slots past the expert's end and columns >= M / N are zero-filled (src-size 0).
// Epilogue: after a consumer-only named barrier (every wgmma of both warpgroups has finished reading the
// ring), each consumer warp converts its 16 rows x BN columns to T into a private staging area in the
// ring (row pitch BN * 2 + 16 bytes: the fragment writes are bank-conflict free), then stores whole
// 16-byte chunks row by row (coalesced); 4-byte stores if out / ldo / o_estride are not 16-byte aligned.
// Preconditions (as moe_gemm): M % 8 == 0, N % 8 == 0, lda % 8 == 0, ldb % 8 == 0, A and B 16-byte aligned.
// Parameter list = moe_gemm's; used: A, lda, B, ldb, slot_token, offsets, num_experts, M, N, out, ldo,
// o_estride. Kd, b_estride, tile_offsets and the epilogue extras are ignored.
// Launch: grid = E * ceil(M / 128) * ceil(N / BN), block = sm90::THREADS (384),
// dynamic shared memory = sm90::Cfg<BN, false>::SMEM_BYTES (197696 bytes for BN = 256, 197728 for BN = 128).

// OUT_T: store the tile transposed, out[e][n][m] (computes W^T's tiles: lets the gathered operand take the
// wide BN side, whose rows give 512 contiguous bytes per k-row instead of 256).
// A_TMA: the slot-indexed A tile comes by TMA (tmap_a: 2-D (M, rows of A), box (64, 64), 128-byte swizzle, zero
// fill out of bounds; two boxes a stage, one per 64-column atom) instead of cp.async. A box always holds 64 rows, so
// in a reduction tile shorter than 64 slots (an expert's or a token block's last) the rows past it hold the next
// slots' values: each consumer warpgroup zeroes those rows of its own A atom before its wgmmas read the stage, so
// every product matches the cp.async path's (which zero-fills them) bit for bit, NaN and Inf included.
template <typename T, bool A_GATHER, bool B_GATHER, int BN = 256, bool OUT_T = false, bool CARRY_IN = false,
          bool A_TMA = false>
__global__ void __launch_bounds__(sm90::THREADS, 1) moe_wgrad_sm90(
    const T* __restrict__ A, long long lda,
    const T* __restrict__ B, long long ldb, long long b_estride,
    const int* __restrict__ slot_token,
    const int* __restrict__ slot_k,
    const int* __restrict__ offsets,
    const int* __restrict__ tile_offsets,
    int num_experts, int M, int N, int Kd,
    T* __restrict__ out, long long ldo, long long o_estride,
    T* __restrict__ out2, long long ldo2,
    const T* __restrict__ aux, long long ldaux,
    const T* __restrict__ bias, long long bias_estride,
    const float* __restrict__ gates, int topk,
    float* __restrict__ part, int part_ld,
    int flags,
    const int* __restrict__ kblocks, int num_kblocks,  // K-grouped: token-block starts (KTileWalk)
    float* __restrict__ carry, const int* __restrict__ carry_seen,  // K-grouped: fp32 partial sums
    const __grid_constant__ sm90::TmaMap tmap_a) {                 // A_TMA: the A operand's tensor map
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(sizeof(T) == 2, "wgmma path: 16-bit element types only");
  static_assert(!(A_TMA && A_GATHER), "TMA A: the slot-indexed operand only (the copy engine does not gather rows)");
  constexpr int BM = sm90::BM, BK = sm90::BK, ROW_BYTES = sm90::ROW_BYTES;
  using C = sm90::Cfg<BN, false>;  // no epilogue staging area, no tile descriptors
  constexpr int STAGES = C::STAGES;
  constexpr int EPC = 8;                         // elements per 16-byte chunk
  constexpr int ATOM_BYTES = BK * ROW_BYTES;     // [64 slots][64 columns], 8 KB
  static_assert(BM == 64 * sm90::CONSUMER_WGS, "one A atom per consumer warpgroup");
  extern __shared__ unsigned char sm90_smem[];
  const unsigned sbase = (smem_u32(sm90_smem) + 1023u) & ~1023u;
  const unsigned full0 = sbase + C::BAR_OFFSET, empty0 = full0 + 8 * STAGES;

  const int tid = threadIdx.x;

  // ---- which tile (as moe_gemm MODE_K) -----------------------------------------------------------------
  const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  const long long per_e = (long long)tiles_m * tiles_n;
  const long long bid = blockIdx.x;
  const int e = static_cast<int>(bid / per_e);
  if (e >= num_experts) return;
  const int rt = static_cast<int>(bid % per_e);
  const int m0 = (rt / tiles_n) * BM, n0 = (rt % tiles_n) * BN;
  const int slot_lo = __ldg(offsets + e);
  const int cnt = __ldg(offsets + e + 1) - slot_lo;  // the expert's slots = the reduction length
  const int num_kt = ktile_count<BK>(kblocks, e, num_kblocks, slot_lo, slot_lo + cnt);  // tiles of KTileWalk

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      sm90::mbar_init(full0 + 8 * s, 128 + (A_TMA ? 1 : 0));    // one per producer thread (+ A_TMA's expect_tx)
      sm90::mbar_init(empty0 + 8 * s, 4 * sm90::CONSUMER_WGS);  // one arrival per consumer warp
    }
  }
  __syncthreads();

  if (tid < 128) {
    // ================================ producer warpgroup ================================
    sm90::setmaxnreg_dec<sm90::PRODUCER_REGS>();
    constexpr int CPA = BM / EPC, RPA = 32 / CPA;  // A: 16 chunks per k-row, 2 k-rows per warp instruction
    constexpr int CPB = BN / EPC, RPB = 32 / CPB;  // B: 32 (16) chunks per k-row, 1 (2) k-rows per instruction
    constexpr int ROWS_W = BK / 4;                 // k-rows per producer warp
    static_assert(ROWS_W == 16 && 32 % CPA == 0 && 32 % CPB == 0, "producer warp map");
    const int lane = tid & 31, rw = (tid >> 5) * ROWS_W;
    const int ca = lane % CPA, ra = lane / CPA, cb = lane % CPB, rb = lane / CPB;
    const bool a_cok = m0 + ca * EPC < M, b_cok = n0 + cb * EPC < N;
    const T* Ac = A + m0 + ca * EPC;  // this lane's column in row 0
    const T* Bc = B + n0 + cb * EPC;
    // atom and chunk of this lane's column; the chunk is XORed with (k-row % 8) per copy
    const unsigned a_dst = static_cast<unsigned>((ca >> 3) * ATOM_BYTES + ((ca & 7) << 4));
    const unsigned b_dst = static_cast<unsigned>((cb >> 3) * ATOM_BYTES + ((cb & 7) << 4));
    // the reduction tiles [t0, end()) in order; gather index of k-row rw + lane % 16 of a tile (-1 past it)
    KTileWalk<BK> walk(kblocks, e, num_kblocks, slot_lo, slot_lo + cnt);
    auto gather_row = [&](int t0, int tend) -> int {
      const int s = t0 + rw + (lane & 15);
      return s < tend ? __ldg(slot_token + s) : -1;
    };
    int tok_next = ((A_GATHER || B_GATHER) && num_kt > 0) ? gather_row(walk.t0, walk.end()) : -1;
    if constexpr (A_TMA) {
      if (tid == 0) sm90::tma_prefetch_map(&tmap_a);
    }

    int stage = 0;
    unsigned phase = 0;
    for (int kt = 0; kt < num_kt; ++kt) {
      const int tok = tok_next;
      const int t0 = walk.t0, tend = walk.end();
      walk.next();
      if constexpr (A_GATHER || B_GATHER) {
        if (kt + 1 < num_kt) tok_next = gather_row(walk.t0, walk.end());  // prefetch one k-tile ahead
      }
      if (kt >= STAGES) sm90::mbar_wait(empty0 + 8 * stage, phase ^ 1u);  // consumers released this stage
      const unsigned as = sbase + stage * C::STAGE_BYTES, bs = as + C::A_BYTES;
      if constexpr (A_TMA) {
        // one thread raises the stage's transaction count by the A tile's bytes and issues its two boxes
        if (tid == 0) {
          const unsigned bar = full0 + 8 * stage;
          sm90::mbar_arrive_expect_tx(bar, C::A_BYTES);
          sm90::tma_load_2d(as, &tmap_a, bar, m0, t0);
          sm90::tma_load_2d(as + ATOM_BYTES, &tmap_a, bar, m0 + 64, t0);
        }
      } else {
#pragma unroll
      for (int i = 0; i < ROWS_W / RPA; ++i) {
        const int rl = RPA * i + ra;  // k-row within the warp's 16
        const int r = rw + rl;        // k-row within the k-tile (r % 8 == rl % 8)
        int row;
        if constexpr (A_GATHER) {
          row = __shfl_sync(0xffffffffu, tok, rl);
        } else {
          row = (t0 + r < tend) ? t0 + r : -1;
        }
        const bool ok = a_cok && row >= 0;
        sm90::cp_async16_s(as + r * ROW_BYTES + (a_dst ^ static_cast<unsigned>((rl & 7) << 4)),
                           ok ? Ac + (long long)row * lda : A, ok ? 16 : 0);
      }
      }
#pragma unroll
      for (int i = 0; i < ROWS_W / RPB; ++i) {
        const int rl = RPB * i + rb;
        const int r = rw + rl;
        int row;
        if constexpr (B_GATHER) {
          row = __shfl_sync(0xffffffffu, tok, rl);
        } else {
          row = (t0 + r < tend) ? t0 + r : -1;
        }
        const bool ok = b_cok && row >= 0;
        sm90::cp_async16_s(bs + r * ROW_BYTES + (b_dst ^ static_cast<unsigned>((rl & 7) << 4)),
                           ok ? Bc + (long long)row * ldb : B, ok ? 16 : 0);
      }
      sm90::producer_signal<STAGES>(full0, kt, stage);
      if (++stage == STAGES) {
        stage = 0;
        phase ^= 1u;
      }
    }
    sm90::producer_drain<STAGES>(full0, num_kt);
  } else {
    // ================================ consumer warpgroups ================================
    sm90::setmaxnreg_inc<sm90::CONSUMER_REGS>();
    const int cw = (tid >> 7) - 1;  // output rows [64 cw, 64 cw + 64) of the tile = A atom cw
    const int t = tid & 127;
    float acc[BN / 2];  // no zero-fill before the mainloop (C7515): scale_d = 0 on the first wgmma
    // CARRY_IN (flags & 1): continue the fp32 partial sums an earlier launch (chunk) left in carry, for experts
    // that had slots there (carry_seen); the first wgmma then accumulates onto them (scale_d = 1). Loading the
    // accumulators with ordinary instructions makes ptxas serialize the wgmma pipeline (C7515), so only the
    // CARRY_IN instantiation, used by the second and later chunks of a chunked backward, has that code.
    const int ct = tid - 128;
    float* cslice = carry + (long long)bid * (BN / 2) * 256 + ct;  // this thread's column of the CTA's slice
    const bool carry_in = CARRY_IN && __ldg(carry_seen + e) != 0;
    if (carry_in) {
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[i] = cslice[i * 256];
    }

    const unsigned long long da0 = sm90::make_desc(sbase + cw * ATOM_BYTES, ATOM_BYTES, 1024);
    const unsigned long long db0 = sm90::make_desc(sbase + C::A_BYTES, ATOM_BYTES, 1024);
    constexpr unsigned KSTEP = (16 * ROW_BYTES) >> 4;  // 16 slots = 2048 bytes, encoded

    int stage = 0;
    unsigned phase = 0;
    // A_TMA: the consumers walk the reduction tiles too, for each tile's length
    KTileWalk<BK> cwalk(kblocks, e, num_kblocks, slot_lo, slot_lo + (A_TMA ? cnt : 0));
    auto zero_tail = [&](unsigned long long soff, int) {
      if constexpr (A_TMA) {
        const int valid = cwalk.end() - cwalk.t0;
        cwalk.next();
        if (valid < BK) {  // rows [valid, 64) of this warpgroup's A atom hold the next slots: zero them
          const unsigned base = sbase + static_cast<unsigned>(soff << 4) + cw * ATOM_BYTES + valid * ROW_BYTES;
          for (int i = t; i < (BK - valid) * (ROW_BYTES / 16); i += 128)
            sm90::st_shared_v4(base + 16 * i, make_uint4(0u, 0u, 0u, 0u));
          sm90::fence_proxy_async_smem();  // generic stores -> the wgmmas' async-proxy reads (and the next TMA fill)
          // the warpgroup's stores all done before any of its wgmmas (one named barrier per warpgroup)
          if (cw == 0) {
            asm volatile("bar.sync 2, 128;\n" ::: "memory");
          } else {
            asm volatile("bar.sync 3, 128;\n" ::: "memory");
          }
        }
      }
    };
    sm90::consumer_mainloop<STAGES>(acc, full0, empty0, num_kt, t, C::STAGE_BYTES, stage, phase,
                                    [&](unsigned long long soff, int kt) {
#pragma unroll
      for (int ks = 0; ks < BK / 16; ++ks)
        sm90::Wgmma<BN, T>::template mma<1, 1>(acc, da0 + soff + ks * KSTEP, db0 + soff + ks * KSTEP,
                                               carry_in || (kt | ks) != 0);
    }, carry_in, zero_tail);  // an expert without slots leaves zero accumulators (or the carried sums)
    if (flags & 2) {  // partial sums for the next chunk's launch instead of the gradient
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) cslice[i * 256] = acc[i];
      return;
    }

    T* oe = out + (long long)e * o_estride;
    const bool vec16 = (reinterpret_cast<unsigned long long>(out) & 15ull) == 0 && (ldo & 7) == 0 &&
                       (o_estride & 7) == 0;  // every 8-element chunk of W starts 16-byte aligned
    auto store16 = [&](T* dst, uint4 v) {
      if (vec16) {
        *reinterpret_cast<uint4*>(dst) = v;
      } else {
        unsigned* d4 = reinterpret_cast<unsigned*>(dst);
        d4[0] = v.x; d4[1] = v.y; d4[2] = v.z; d4[3] = v.w;
      }
    };
    const int lane = t & 31;
    if constexpr (OUT_T) {
      // ---- epilogue: the whole 128 x BN tile staged transposed ([BN rows n][128 m], 256 bytes a row, 16-byte
      // chunks XOR-swizzled by n), then 16-byte stores along m of each output row n.
      constexpr int TRB = BM * 2, TCPR = BM / EPC, TRPI = 32 / TCPR;  // 256 B rows, 16 chunks, 2 rows / instr
      static_assert(BN * TRB <= STAGES * C::STAGE_BYTES, "transposed staging fits in the stage ring");
      auto toff = [](int n, int m) {
        return static_cast<unsigned>(n * TRB + ((((m >> 3) ^ (n & 15)) << 4)) + (m & 7) * 2);
      };
      sm90::consumer_bar_sync();  // both warpgroups' wgmma are done with the ring before it is overwritten
      sm90::wg_for_each_pair<BN>(acc, t, [&](int, int r, int c, float v0, float v1) {
        const int m = cw * 64 + r;
        sm90::st_shared_u16(sbase + toff(c, m), sm90::pack1<T>(v0));
        sm90::st_shared_u16(sbase + toff(c + 1, m), sm90::pack1<T>(v1));
      });
      sm90::consumer_bar_sync();
      // ct: 0..255 over both consumer warpgroups
      const int co = ct % TCPR, ro = ct / TCPR;  // chunk of m; first staged row n
#pragma unroll 1
      for (int nr = ro; nr < BN; nr += 256 / TCPR) {
        const int n = n0 + nr, m = m0 + co * EPC;
        if (n < N && m < M) store16(oe + (long long)n * ldo + m, sm90::ld_shared_v4(sbase + toff(nr, co * EPC)));
      }
      (void)TRPI;
    } else {
      // ---- epilogue: stage each warp's 16 x BN rows as T, then 16-byte row-wise stores ----------------
      constexpr int PITCH = BN * 2 + 16;  // bytes per staged row; 16-byte pad: conflict-free fragment writes
      constexpr int CPO = BN / EPC, RPO = 32 / CPO;  // output chunks per row, rows per warp instruction
      static_assert(8 * 16 * PITCH <= STAGES * C::STAGE_BYTES, "staging fits in the stage ring");
      const int wq = t >> 5;  // warp wq of the warpgroup owns rows [16 wq, 16 wq + 16)
      const unsigned stg = sbase + static_cast<unsigned>((cw * 4 + wq) * 16 * PITCH);
      sm90::consumer_bar_sync();  // both warpgroups' wgmma are done with the ring before it is overwritten
      sm90::wg_for_each_pair<BN>(acc, t, [&](int, int r, int c, float v0, float v1) {
        sm90::st_shared_u32(stg + (r - 16 * wq) * PITCH + c * 2, sm90::pack2<T>(v0, v1));
      });
      __syncwarp();
      const int co = lane % CPO, ro = lane / CPO;
      const int n = n0 + co * EPC;
      const int mrow0 = m0 + cw * 64 + wq * 16;
#pragma unroll
      for (int i = 0; i < 16 / RPO; ++i) {
        const int rr = RPO * i + ro;
        const uint4 v = sm90::ld_shared_v4(stg + rr * PITCH + co * 16);
        const int m = mrow0 + rr;
        if (m < M && n < N) store16(oe + (long long)m * ldo + n, v);
      }
    }
  }
#else
  // Built for another target: this kernel needs sm_90a (wgmma, setmaxnreg); launch moe_gemm instead.
  __trap();
#endif
}

}  // namespace blz
