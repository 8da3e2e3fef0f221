// PTX wrappers of the sm_90a kernels (moe_gemm_sm90.cu, moe_wgrad_sm90.cu): cp.async, mbarriers, proxy fences,
// wgmma (shared-memory and register A), setmaxnreg, shared-memory descriptors, ldmatrix and shared-memory
// loads and stores. The TMA wrappers are in sm90_tma.cuh.
#pragma once
#include "moe_common.cuh"

namespace blz {
namespace sm90 {

// 16-byte global->shared copy that bypasses L1; src_bytes = 0 zero-fills the destination (src still a valid address).
__device__ __forceinline__ void cp_async16_s(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// Timing probes only (wrong results): 1 leaves out the M-grouped epilogues' global stores, 2 the whole epilogues.
#ifndef BLZ_PROBE_EPI
#define BLZ_PROBE_EPI 0
#endif
// Timing probe only (wrong results): 1 loads half of each stage's TMA B tile (the bytes a 2-CTA multicast would save).
// Run it with BLAZECORE_SM90_CLUSTER=1: the weight gradients' clusters multicast all of B, which the halved
// transaction count does not expect (the full barrier never completes).
#ifndef BLZ_PROBE_HALF_B
#define BLZ_PROBE_HALF_B 0
#endif
// Timing probes only (wrong results), the weight gradients: every gathered A row one of the first 256 rows
// (BLZ_PROBE_A_HOT), every B box from the first 4096 slots (BLZ_PROBE_B_HOT), so that the copies hit L2.
#ifndef BLZ_PROBE_A_HOT
#define BLZ_PROBE_A_HOT 0
#endif
#ifndef BLZ_PROBE_B_HOT
#define BLZ_PROBE_B_HOT 0
#endif
// Timing probe only (wrong results), the weight gradients: every BLZ_PROBE_A_SKIP-th copy instruction of the gathered
// rows left out (their rows stale), so the gathered bytes and copies fall by 1 / BLZ_PROBE_A_SKIP.
#ifndef BLZ_PROBE_A_SKIP
#define BLZ_PROBE_A_SKIP 0
#endif
// Timing probe (results unchanged), the weight gradients and dh': how many k-tiles (and tiles) CTA 0 records in its
// kernel's timeline array (moe_wgrad_sm90.cu, moe_dhcur_sm90.cu); 0: none. BLZ_TIMELINE_MARK(cell, k) writes the SM
// clock into the array's cell for entry k; without the probe it is nothing (the array does not exist).
#ifndef BLZ_PROBE_TIMELINE
#define BLZ_PROBE_TIMELINE 0
#endif
#if BLZ_PROBE_TIMELINE
#define BLZ_TIMELINE_MARK(cell, k)                                           \
  do {                                                                       \
    if (blockIdx.x == 0 && (k) < BLZ_PROBE_TIMELINE) (cell) = clock64();     \
  } while (0)
#else
#define BLZ_TIMELINE_MARK(cell, k) \
  do {                             \
  } while (0)
#endif
// moe_dhcur_sm90 only: the epilogue warps' rows a step (1, 2 or 4).
#ifndef BLZ_DH_ROWS
#define BLZ_DH_ROWS 2
#endif
#ifndef BLZ_SM90_PLAIN_A
#define BLZ_SM90_PLAIN_A 1
#endif
// 16-byte global->shared copy of src, bypassing L1 (the plain form: no src-size operand).
__device__ __forceinline__ void cp_async16_plain(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
// An L2 policy that evicts the lines it touches first (rows read or written once, kept from displacing the reused
// operands), and the copies / stores that take it.
__device__ __forceinline__ unsigned long long l2_evict_first_policy() {
  unsigned long long pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ void cp_async16_hint(unsigned dst, const void* src, unsigned long long pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "l"(pol) : "memory");
}
__device__ __forceinline__ void st_global_v4_hint(void* p, uint4 v, unsigned long long pol) {
  asm volatile("st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w), "l"(pol)
               : "memory");
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

// ---- shared-memory loads and stores, ldmatrix ------------------------------------------------------------
__device__ __forceinline__ void st_shared_u16(unsigned addr, unsigned short v) {
  asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"(v) : "memory");
}
__device__ __forceinline__ void st_shared_u32(unsigned addr, unsigned v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
// Four 8 x 8 matrices of 16-bit elements to shared memory: register k holds matrix k's fragment (thread t: row t / 4,
// columns 2 (t % 4) + {0, 1}, the accumulator pairs' layout); lane l gives the address of stored row l % 8 of matrix
// l / 8 (16 bytes). TRANS: each matrix is stored transposed (stored row i = column i of the fragment's matrix).
template <bool TRANS>
__device__ __forceinline__ void stmatrix_x4(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
  if constexpr (TRANS) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared::cta.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
  } else {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared::cta.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
                 "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
  }
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
// No "memory" clobber: volatile asm statements keep their order, which is all the staged epilogue needs
// within a thread (__syncwarp orders it across lanes).
__device__ __forceinline__ unsigned ld_shared_u32(unsigned addr) {
  unsigned v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
// 8-byte forms (interleaved gate/up pairs: a pair of h columns' gate and up values, [a0, b0, a1, b1])
__device__ __forceinline__ uint2 ld_shared_v2(unsigned addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ void st_shared_v2(unsigned addr, uint2 v) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(addr), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ void st_shared_v4(unsigned addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

}  // namespace sm90
}  // namespace blz
