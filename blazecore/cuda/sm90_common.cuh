// What the sm_90a expert GEMMs share (moe_gemm_sm90.cu, moe_wgrad_sm90.cu): tile constants, the shared-memory
// layout (Cfg), the accumulator fragment of wgmma m64nNk16, the producer's and consumers' pipeline steps and the
// staged epilogue helpers. PTX wrappers: sm90_ptx.cuh; TMA: sm90_tma.cuh.
#pragma once
#include "moe_common.cuh"
#include "sm90_ptx.cuh"
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
constexpr int MAX_SMEM_BYTES = 227 * 1024;  // dynamic shared memory a CTA can have on sm_90

// Shared memory (base aligned to 1024): the stage ring, the consumer warps' epilogue staging, then the
// mbarriers (STAGES full, STAGES empty, 1 epilogue-done, INFO_SLOTS tile-info; 16-byte aligned end) and the
// INFO_SLOTS tile descriptors (16 bytes each). The weight-gradient kernels use the same layout (the epilogue-done
// barrier and the tile descriptors stay unused).
// A_TILES = 2 (a gated A_ACT GEMM): each stage holds two A tiles, the gate and the up columns of z, before the B
// tile, and the ring is 3 stages deep.
// STAGES_: the ring's depth, chosen by the launcher (blazecore/_moe_gpu.py's _stages90) and passed as a template
// argument of the kernels; the layout checks that it fits.
template <int BN, int A_TILES, int STAGES_> struct Cfg {
  static_assert(BN == 128 || BN == 256, "BN must be 128 or 256");
  static_assert(A_TILES == 1 || A_TILES == 2, "one or two A tiles a stage");
  static_assert(STAGES_ >= 2, "a ring of at least two stages");
  static constexpr int STAGES = STAGES_;
  static constexpr int A_BYTES = BM * ROW_BYTES;     // 16 KB
  static constexpr int B_BYTES = BN * ROW_BYTES;     // 32 KB (BN = 256) or 16 KB
  static constexpr int B_OFFSET = A_TILES * A_BYTES;  // the B tile's offset in a stage
  static constexpr int STAGE_BYTES = B_OFFSET + B_BYTES;
  static constexpr int EPI_OFFSET = STAGES * STAGE_BYTES;
  static constexpr int BAR_OFFSET = EPI_OFFSET + 4 * CONSUMER_WGS * EPI_WARP_BYTES;
  static constexpr int NINFO = INFO_SLOTS;
  static constexpr int INFO_OFFSET = BAR_OFFSET + ((8 * (2 * STAGES + 1 + NINFO) + 15) & ~15);
  static constexpr int SMEM_BYTES = 1024 + INFO_OFFSET + 16 * NINFO;  // + slack to align the base to 1024
  static_assert(SMEM_BYTES <= MAX_SMEM_BYTES, "the ring and the staging fit a CTA's shared memory");
  static_assert(INFO_SLOTS >= STAGES + 1, "a tile descriptor outlives the STAGES k-tiles the producer runs ahead");
};

// dh' with its epilogue on the producer warpgroup (moe_dhcur_sm90.cu): 128 x 256 tiles, k-tiles of 64 (A and B as
// moe_gemm_sm90's N-major layout), a ring of STAGES_ stages beside the tile's dh' (T, 512-byte rows) and the producer
// warps' z rows (ZD rows in flight a warp, the gate and up halves 512 bytes each, each row on an mbarrier of its own);
// then the mbarriers (STAGES full, STAGES empty, dh-full, dh-empty, 4 x ZD z-row, INFO_SLOTS tile-info) and the tile
// descriptors.
template <int STAGES_> struct DhCfg {
  static constexpr int STAGES = STAGES_;
  static constexpr int BK = 64, BN = 256, ZD = 4;
  static constexpr int A_BYTES = BM * ROW_BYTES;       // 16 KB
  static constexpr int B_ATOM = BK * ROW_BYTES;        // 8 KB: [64 k][64 n]
  static constexpr int B_BYTES = (BN / 64) * B_ATOM;   // 32 KB
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int DH_ROW = BN * 2;                // 512 bytes
  static constexpr int DH_OFFSET = STAGES * STAGE_BYTES;
  static constexpr int Z_SLOT = 2 * DH_ROW;            // a row's gate and up halves
  static constexpr int Z_OFFSET = DH_OFFSET + BM * DH_ROW;
  static constexpr int BAR_OFFSET = Z_OFFSET + 4 * ZD * Z_SLOT;
  static constexpr int NINFO = INFO_SLOTS;
  static constexpr int INFO_OFFSET = BAR_OFFSET + ((8 * (2 * STAGES + 2 + 4 * ZD + NINFO) + 15) & ~15);
  static constexpr int SMEM_BYTES = 1024 + INFO_OFFSET + 16 * NINFO;
  static_assert(STAGES_ >= 2, "a ring of at least two stages");
  static_assert(SMEM_BYTES <= MAX_SMEM_BYTES, "the ring, dh' and the z rows fit a CTA's shared memory");
  static_assert(INFO_SLOTS >= STAGES + 1, "a tile descriptor outlives the STAGES k-tiles the producer runs ahead");
};

// A compile-time int as a value (a lambda's argument that picks its unrolled form).
template <int V> struct IntC {
  static constexpr int value = V;
};

// ---- the M-grouped tile schedule (moe_gemm_sm90, moe_dhcur_sm90) ---------------------------------------------
// Tile number v of the grouped order: GROUP_M m-tiles down one n-tile, then the next n-tile, so the CTAs working at a
// time share a few weight slices and a few row blocks in L2. Returns the expert, its first slot of the m-tile, the
// expert's end slot and the n-tile (the binary search over tile_offsets stays on the producer's side).
constexpr int GROUP_M = 16;
struct MTile {
  int e, m0, m_end, tn;
};
__device__ __forceinline__ MTile m_tile(int v, int tiles_n, int mt_total, const int* tile_offsets, const int* offsets,
                                        int num_experts) {
  const int grp = v / (GROUP_M * tiles_n), first = grp * GROUP_M;
  const int gsz = min(GROUP_M, mt_total - first), local = v - first * tiles_n;
  const int tmg = first + local % gsz;
  MTile t;
  t.tn = local / gsz;
  t.e = find_expert(tile_offsets, num_experts, tmg);
  t.m0 = __ldg(offsets + t.e) + (tmg - __ldg(tile_offsets + t.e)) * BM;
  t.m_end = __ldg(offsets + t.e + 1);
  return t;
}

// The producer's gathered A rows s0 + step i (i < N) of a tile as pointers to the thread's chunk `col` of k-column 0,
// so that a k-tile's copy addresses are one add each. Row s is slot_token[s] when `gather`, else s; rows at or past
// m_end, and every row when !load, point at row 0 with their bit of the returned mask clear (zero-filled copies).
template <int N, typename T>
__device__ __forceinline__ unsigned row_sources(const char* (&src)[N], const T* A, long long lda, const int* slot_token,
                                                bool gather, bool load, int s0, int step, int m_end, int col) {
  unsigned ok = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int s = s0 + step * i;
    const int row = (load && s < m_end) ? (gather ? __ldg(slot_token + s) : s) : -1;
    ok |= (row >= 0 ? 1u : 0u) << i;
    src[i] = reinterpret_cast<const char*>(A + (long long)(row >= 0 ? row : 0) * lda + col);
  }
  return ok;
}

// The producer's tile descriptor li ({e, m0, m_end, tn}; e = ~0: the CTA's tiles are done) into slot li % INFO_SLOTS,
// then its barrier (one arrival; the readers wait for phase li / INFO_SLOTS).
__device__ __forceinline__ void post_tile(unsigned info0, unsigned info_full0, int li, uint4 desc) {
  st_shared_v4(info0 + 16 * (li % INFO_SLOTS), desc);
  mbar_arrive(info_full0 + 8 * (li % INFO_SLOTS));
}

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
// One arrival per producer thread and k-tile either way.
template <int STAGES>
__device__ __forceinline__ void producer_signal(unsigned full0, int kt, int stage) {
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
// Named barrier 1 over the two consumer warpgroups (the producer warpgroup does not take part).
__device__ __forceinline__ void consumer_bar_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(128 * CONSUMER_WGS) : "memory");
}
template <typename T> __device__ __forceinline__ float2 unpack2(unsigned v);
template <> __device__ __forceinline__ float2 unpack2<__nv_bfloat16>(unsigned v) {
  // a bf16 is the top half of its fp32: one shift or mask each (the intrinsic spends two permutes more a pair)
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
template <> __device__ __forceinline__ float2 unpack2<__half>(unsigned v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
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
// staged_put: the put half of a pass alone, 4-byte stores (staged_put_x4 writes the same layout by stmatrix).
template <int P, class Put>
__device__ __forceinline__ void staged_put(int p, int fr, int fc, Put&& put) {
  constexpr int PCPR = P / 8;  // 16-byte chunks per staged row
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int jj = 0; jj < P / 8; ++jj) {
      const int j = p * (P / 8) + jj, c = fc + 8 * j;
      put(h, j, c, stage_off<PCPR>(fr + 8 * h, jj) + (c & 7) * 2);
    }
}
// The put half of a pass whose staging a TMA store drains (EPI_ROWSCALE, the weight gradients): staged_put's layout
// (TRANS = false: 16 rows of P = 64 columns, stage_off<8>) written by stmatrix, four x4 stores a pass instead of 16
// 4-byte stores; or (TRANS = true) the pass transposed, as 64 rows n of 32 bytes (16 rows m, element (m, n) at
// n * 32 + m * 2, no swizzle), four x4.trans stores instead of 32 2-byte stores. pair(h, j) is the thread's T pair
// of row slot h and column group j (columns 8 j + fc, + 1), j = p * 8 + jj. An x4 takes the matrices (jj, h = 0),
// (jj, 1), (jj + 1, 0), (jj + 1, 1); lane l addresses stored row l % 8 of matrix l / 8. Both layouts take an x4 in
// 4 wavefronts (no bank conflicts).
template <int P, bool TRANS, class Pair>
__device__ __forceinline__ void staged_put_x4(unsigned buf, int p, int lane, Pair&& pair) {
  static_assert(P == 64, "a pass of 64 columns: 16-byte chunks 0..7 of a 128-byte row");
  const int r = lane & 7, hq = (lane >> 3) & 1, jq = lane >> 4;
#pragma unroll
  for (int jj = 0; jj < P / 8; jj += 2) {
    const int j = p * (P / 8) + jj;
    const unsigned addr = TRANS ? buf + static_cast<unsigned>((8 * (jj + jq) + r) * 32 + 16 * hq)
                                : buf + stage_off<P / 8>(8 * hq + r, jj + jq);
    stmatrix_x4<TRANS>(addr, pair(0, j), pair(1, j), pair(0, j + 1), pair(1, j + 1));
  }
}
// A staged pass stored by TMA from one of two halves of the warp's staging (the epilogues of moe_gemm_sm90's
// EPI_ROWSCALE and moe_wgrad_sm90): tma_pass_begin before the warp writes a half (the store two passes back, which
// last read it, is done reading), tma_pass_end after (the generic writes fenced for the copy engine, then lane 0 runs
// store(), which issues the pass's TMA store or none, and commits the bulk group). The warp waits for its last stores
// (bulk_wait<0>) before the CTA exits.
__device__ __forceinline__ void tma_pass_begin(int lane) {
  if (lane == 0) bulk_wait_read<1>();
  __syncwarp();
}
template <class Store> __device__ __forceinline__ void tma_pass_end(int lane, Store&& store) {
  fence_proxy_async_smem();
  __syncwarp();
  if (lane == 0) {
    store();
    bulk_commit();
  }
}
template <int P, class Put, class Copy>
__device__ __forceinline__ void staged_pass(int p, int fr, int fc, int lane, Put&& put, Copy&& copy) {
  constexpr int PCPR = P / 8, RPI = 32 / PCPR;  // 16-byte chunks per staged row; rows per warp instruction
  staged_put<P>(p, fr, fc, put);
  __syncwarp();
  const int co = lane % PCPR, ro = lane / PCPR;
#pragma unroll
  for (int i = 0; i < 16 / RPI; ++i) copy(RPI * i + ro, stage_off<PCPR>(RPI * i + ro, co), p * P + co * 8);
  __syncwarp();
}
// A compile-time bool as a value: an epilogue written once as a generic lambda runs as two instantiations, e.g.
// with and without a bias, so the one without carries no per-element test or load.
template <bool V> struct BoolC {
  static constexpr bool value = V;
};
// v0, v1 += the bias columns col, col + 1 (be: the expert's bias row; none, or col >= n: unchanged); HAS = false:
// the caller knows there is none
template <typename T, bool HAS = true>
__device__ __forceinline__ void add_bias2(const T* be, int col, int n, float& v0, float& v1, BoolC<HAS> = {}) {
  if (HAS && be && col < n) {
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
// so a persistent CTA continues with the next tile's k-tiles. peer_empty0 (a shared::cluster address; 0: none): the
// empty barriers of the other CTA of a 2-CTA cluster, released too (its producer multicasts into this CTA's stages).
// prep(stage byte offset >> 4, kt), when given, runs after the stage's wait and before the wgmma fence: shared-memory
// fix-ups of the stage (it orders them before the wgmmas itself).
// GENERIC_WRITES = false: only the tensor copy engine writes the stages (A and B by TMA), an async-proxy write
// the wgmmas read with no proxy fence.
struct NoPrep {
  __device__ __forceinline__ void operator()(unsigned long long, int) const {}
};
template <int STAGES, int R, class F, int INFLIGHT = 1, class P = NoPrep, bool GENERIC_WRITES = true>
__device__ __forceinline__ void consumer_mainloop(float (&acc)[R], unsigned full0, unsigned empty0, int num_kt,
                                                  int t, int stage_bytes, int& stage, unsigned& phase, F&& issue,
                                                  bool keep_acc = false, P&& prep = P(), unsigned peer_empty0 = 0) {
  int prev = 0;
  for (int kt = 0; kt < num_kt; ++kt) {
    mbar_wait(full0 + 8 * stage, phase);
#if !BLZ_SM90_PRODUCER_FENCE
    if constexpr (GENERIC_WRITES) fence_proxy_async_smem();  // generic-proxy cp.async writes -> async-proxy wgmma reads
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
      if (kt > 0 && (t & 31) == 0) {
        mbar_arrive(empty0 + 8 * prev);
        if (peer_empty0) mbar_arrive_cluster(peer_empty0 + 8 * prev);
      }
    }
    prev = stage;
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1u;
    }
  }
  wgmma_wait<0>();
  fence_regs(acc);
  if (INFLIGHT != 0 && num_kt > 0 && (t & 31) == 0) {
    mbar_arrive(empty0 + 8 * prev);
    if (peer_empty0) mbar_arrive_cluster(peer_empty0 + 8 * prev);
  }
  if (num_kt == 0 && !keep_acc) {
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.f;
  }
}

}  // namespace sm90
}  // namespace blz
