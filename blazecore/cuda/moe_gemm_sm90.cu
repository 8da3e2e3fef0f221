// sm_90a (Hopper) M-grouped expert GEMM: the MODE_M contract of moe_gemm (moe_gemm_sm80.cu) on wgmma.mma_async.
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
//                   the thread's copies have landed (the tensor copy engine gathers rows only one box a row on
//                   sm_90, which is slower: docs/sm90_kernels.md).
//   warpgroups 1, 2 consumers: tile rows [64 (w-1), 64 w); wait "full", fence.proxy.async where cp.async writes
//                   the stage (generic-proxy writes, wgmma reads through the async proxy), 4 x wgmma m64nBNk16 per
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
// Interleaved gate/up (ACT_INTERLEAVED or'ed into ACT_ID, gpt-oss's rows [g0, u0, g1, u1, ...]): B is loaded as a plain
// tile of BN consecutive rows (K-major) or columns (N-major) of w13 from row 2 n0, so accumulator columns c, c + 1 (c
// even, one thread's register pair) are the gate and up of h column n0 + c / 2; z and dz keep the interleaved order
// (EPI_ACT writes z's pairs as they are and h one element a pair; EPI_DHCUR reads and writes z's pairs 8 bytes at a
// time). No A_ACT form.
//
// The K-grouped weight-gradient GEMM on the same pipeline is moe_wgrad_sm90.cu; what both share is in
// sm90_common.cuh.
#include "sm90_common.cuh"

namespace blz {

// ---- the kernel ----------------------------------------------------------------------------------------
// Arguments: moe_gemm's (MODE_M), MGroupedArgs (moe_args.cuh), then the tensor maps. args.up: EPI_DHCUR's column
// offset of z's and dz's up half, a gated EPI_ACT's offset of B's up-half rows (N-major: columns) and of the bias'
// up half (a launch over a column slice of h passes h; 0 means N; z's up half stays at column N).
// T is __nv_bfloat16 or __half.
// Launch: any grid (persistent: the CTAs share out the tile_offsets[E] * tiles_n tiles, tiles_n = ceil(N / (GATED ?
// BN/2 : BN))); one CTA per SM is what the launcher uses. block = sm90::THREADS (384), dynamic shared memory =
// sm90::Cfg<BN, A tiles, STAGES>::SMEM_BYTES (STAGES: the ring's depth, the launcher's choice). Precondition:
// Kd > 0.
// B_TMA: the B tile comes by TMA (tmap_b, see below) instead of cp.async; the gathered A rows stay on cp.async.
// A_TMA (with B_TMA, for a slot-ordered A: the second GEMM's hcur, dx's dz): the A tile comes by TMA too (tmap_a: 2-D
// (Kd, rows of A), box (64, 128), 128-byte swizzle): rows m0 .. m0 + 127 whatever the expert's end, since the
// epilogue stores rows below m_end only (and the rows beyond A's end read as zeros).
// tmap_b (ignored unless B_TMA), encoded by blazecore/_tma.py with 128-byte swizzle, zero fill out of bounds:
//   K-major B (E, [2,] N, Kd): 4-D (Kd, N, halves, E), box (64, BN/2, 1, 1): two boxes per stage, the gate and up
//     rows of a gated tile (halves = 2) or rows n0 and n0 + BN/2 (halves = 1); each box lands as BN/2 swizzled
//     128-byte rows, which is the layout the cp.async path writes.
//   N-major B (E, Kd, N): 3-D (N, Kd, E), box (64, 64, 1): BN/64 boxes per stage, one per 64-column atom; a gated
//     tile's ("in_out" w13 (E, d, 2h)) 4-D (N, halves, Kd, E), the halves args.up columns apart, box (64, 1, 64, 1):
//     the first BN/128 atoms the gate columns, the others the matching up columns.
template <typename T, bool B_KMAJOR, int EPI, int ACT_ID, bool A_GATHER, int BN, bool B_TMA, bool A_ACT, bool A_TMA,
          int STAGES>
__global__ void __launch_bounds__(sm90::THREADS, 1) moe_gemm_sm90(
    const MGroupedArgs<T> p,
    const __grid_constant__ sm90::TmaMap tmap_b,   // B_TMA: the B operand's tensor map
    const __grid_constant__ sm90::TmaMap tmap_a,    // A_TMA: the A operand's tensor map
    const __grid_constant__ sm90::TmaMap tmap_o) {  // EPI_ROWSCALE: out's tensor map, or all zeros (see there)
  const T* __restrict__ A = p.A;
  const T* __restrict__ B = p.B;
  const int* __restrict__ slot_token = p.slot_token;
  const int* __restrict__ slot_k = p.slot_k;
  const int* __restrict__ offsets = p.offsets;
  const int* __restrict__ tile_offsets = p.tile_offsets;
  T* out = p.out;  // out and aux may alias (EPI_DHCUR writes dz over z)
  T* __restrict__ out2 = p.out2;
  const T* aux = p.aux;
  const T* __restrict__ bias = p.bias;
  const float* __restrict__ gates = p.gates;
  float* __restrict__ part = p.part;
  const long long lda = p.lda, ldb = p.ldb, b_estride = p.b_estride, ldo = p.ldo, ldo2 = p.ldo2, ldaux = p.ldaux;
  const long long bias_estride = p.bias_estride;
  const int num_experts = p.num_experts, N = p.N, Kd = p.Kd, topk = p.topk, part_ld = p.part_ld;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(sizeof(T) == 2, "wgmma path: 16-bit element types only");
  static_assert(EPI == EPI_ACT || EPI == EPI_ROWSCALE || EPI == EPI_DHCUR, "MODE_M epilogues only");
  constexpr int ACT = act_base(ACT_ID);
  constexpr bool IL = act_interleaved(ACT_ID);  // interleaved gate/up pairs (see the header)
  static_assert(!IL || (act_gated(ACT) && EPI != EPI_ROWSCALE), "interleaved: a gated first GEMM or dh' only");
  // local names (moe_gemm_sm80.cu has its own BM, BK, STAGES at namespace scope)
  constexpr int BM = sm90::BM, BK = sm90::BK, ROW_BYTES = sm90::ROW_BYTES;
  // A_ACT: A holds pre-activations z in slot order (gated: the gate columns [0, Kd), the up columns [Kd, 2 Kd));
  // the consumers read A's fragments into registers and apply the activation there (hcur is never stored)
  static_assert(!A_ACT || (EPI == EPI_ROWSCALE && !A_GATHER), "A_ACT: the second GEMM's slot-ordered A only");
  static_assert(!A_TMA || (B_TMA && !A_GATHER && !A_ACT), "A_TMA: a slot-ordered A beside a TMA B");
  constexpr bool A2 = A_ACT && act_gated(ACT);  // two A tiles a stage: gate and up
  using C = sm90::Cfg<BN, A2 ? 2 : 1, STAGES>;
  constexpr int EPC = 8;  // elements per 16-byte chunk
  constexpr bool GATED = (EPI == EPI_ACT) && act_gated(ACT);
  constexpr bool HALVES = GATED && !IL;  // B's tile in a gate half and an up half
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
  const int tiles_n = GATED ? (N + BN / 2 - 1) / (BN / 2) : (N + BN - 1) / BN;
  const int mt_total = __ldg(tile_offsets + num_experts);
  const int total = mt_total * tiles_n;
  const int num_kt = (Kd + BK - 1) / BK;  // >= 1 (Kd > 0 for every M-grouped GEMM)
  const long long zup = (EPI == EPI_DHCUR && p.up) ? p.up : N;  // EPI_DHCUR: z / dz up-half offset
  const long long bup = (GATED && p.up) ? p.up : N;  // gated EPI_ACT: B's and the bias' up-half offset
  const int NB = IL && EPI == EPI_ACT ? 2 * N : N;  // B's extent in output columns (interleaved: z's columns)

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
    if constexpr (A_TMA) {
      if (tid == 0) sm90::tma_prefetch_map(&tmap_a);
    }
    int stage = 0, it = 0;  // ring position and k-tile count over all of this CTA's tiles
    unsigned phase = 0;
    int li = 0;
    for (int v = static_cast<int>(blockIdx.x); v < total; v += static_cast<int>(gridDim.x), ++li) {
      const sm90::MTile mt = sm90::m_tile(v, tiles_n, mt_total, tile_offsets, offsets, num_experts);
      const int e = mt.e, m0 = mt.m0, m_end = mt.m_end, tn = mt.tn;
      const int n0 = GATED ? tn * (BN / 2) : tn * BN;  // first output column of the tile
      const int bn0 = IL && EPI == EPI_ACT ? 2 * n0 : n0;  // B's first output column (interleaved: z's)
      if (tid == 0) {
        // slot li % INFO_SLOTS was last read by the consumers before they released the k-tiles of tile
        // li - INFO_SLOTS, which this thread has waited for (INFO_SLOTS >= STAGES + 1)
        sm90::post_tile(info0, info_full0, li, make_uint4(static_cast<unsigned>(e), static_cast<unsigned>(m0),
                                                          static_cast<unsigned>(m_end), static_cast<unsigned>(tn)));
      }
      // Source rows as pointers (sm90::row_sources): the per-copy 64-bit row arithmetic was most of the producer's
      // instructions, which bound the gathered GEMMs
      const char* a_src[BM / 16];
      const unsigned a_ok = sm90::row_sources(a_src, A, lda, slot_token, A_GATHER, !A_TMA, m0 + r0, 16, m_end, cc * EPC);
      // B K-major: rows r0 + 16 i of the [BN][64] tile (gated: first half gate rows n0 + .., second half
      // the up rows bup + n0 + ..); b_ok bit i: that row's output column is in range; b_off0 / b_off1: element
      // offsets (within expert e) of this thread's first gate (or plain) row and first up row.
      // B N-major: b_off0: element offset of (k-row rb, this chunk's global column); b_ok: column in range.
      unsigned b_ok = 0;
      long long b_off0 = 0, b_off1 = 0;
      if constexpr (B_TMA) {
        // the tensor map holds the addressing and the bounds
      } else if constexpr (B_KMAJOR) {
        constexpr int ROWS = HALVES ? BN / 32 : BN / 16;  // rows per half (gated) or per tile
#pragma unroll
        for (int i = 0; i < ROWS; ++i) b_ok |= (bn0 + r0 + 16 * i < NB ? 1u : 0u) << i;
        b_off0 = (long long)(bn0 + r0) * ldb + cc * EPC;
        b_off1 = (bup + n0 + r0) * ldb + cc * EPC;
      } else {
        int n, col;
        if constexpr (HALVES) {
          n = n0 + (cn % (CPR / 2)) * EPC;
          col = (cn < CPR / 2) ? n : static_cast<int>(bup) + n;
        } else {
          n = bn0 + cn * EPC;
          col = n;
        }
        b_ok = n < NB ? 1u : 0u;
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
            // (interleaved: the 2 BN columns of z from 2 n0, the lines of h's columns [n0 + 64 c, + 64) side by side)
            const T* zr = aux + (long long)(m0 + tid) * ldaux + (IL ? 2 * n0 : n0);
#pragma unroll
            for (int c = 0; c < BN / 64; ++c) {
              if (n0 + 64 * c < N) {
                sm90::prefetch_l2(zr + (IL ? 128 : 64) * c);
                if constexpr (act_gated(ACT)) sm90::prefetch_l2(IL ? zr + 128 * c + 64 : zr + zup + 64 * c);
              }
            }
          }
        }
        if (it >= STAGES) sm90::mbar_wait(empty0 + 8 * stage, phase ^ 1u);  // consumers released this stage
        const unsigned as = sbase + stage * C::STAGE_BYTES, bs = as + C::B_OFFSET;
        const int k0 = kt * BK;
        const int kc = k0 + cc * EPC;
        const bool kok = kc < Kd;
        const unsigned kb = static_cast<unsigned>(k0) * sizeof(T);  // the k-tile's byte offset in a row
        if constexpr (!A_TMA) {
          // a k-tile of a whole m-tile (every row a slot of the expert, every column inside Kd: the same for every
          // thread of the CTA) reads with the plain form; the others zero-fill with the src-size form
          if (BLZ_SM90_PLAIN_A && m0 + BM <= m_end && k0 + BK <= Kd) {
#pragma unroll
            for (int i = 0; i < BM / 16; ++i) {
              const T* src = reinterpret_cast<const T*>(a_src[i] + kb);
              sm90::cp_async16_plain(as + (r0 + 16 * i) * ROW_BYTES + a_sw, src);
              if constexpr (A2) sm90::cp_async16_plain(as + C::A_BYTES + (r0 + 16 * i) * ROW_BYTES + a_sw, src + Kd);
            }
          } else {
#pragma unroll
            for (int i = 0; i < BM / 16; ++i) {
              const bool ok = kok && ((a_ok >> i) & 1u);
              const T* src = ok ? reinterpret_cast<const T*>(a_src[i] + kb) : A;
              sm90::cp_async16_s(as + (r0 + 16 * i) * ROW_BYTES + a_sw, src, ok ? 16 : 0);
              if constexpr (A2) sm90::cp_async16_s(as + C::A_BYTES + (r0 + 16 * i) * ROW_BYTES + a_sw,
                                                   ok ? src + Kd : A, ok ? 16 : 0);
            }
          }
        }
        if constexpr (B_TMA) {
          // one thread issues the stage's boxes after raising the full barrier's transaction count by their bytes
          if (tid == 0) {
            const unsigned bar = full0 + 8 * stage;
            sm90::mbar_arrive_expect_tx(bar, C::B_BYTES / (BLZ_PROBE_HALF_B ? 2 : 1) + (A_TMA ? C::A_BYTES : 0));
            // A_TMA: rows m0.. of A, one box of 128 rows x 64 k; rows past the expert's slots hold the next
            // expert's rows (or zeros past A's end): their output rows are never stored
            if constexpr (A_TMA) sm90::tma_load_2d(as, &tmap_a, bar, k0, m0);
            if constexpr (B_KMAJOR) {
              constexpr int HALF = BN / 2;  // rows per box
              sm90::tma_load_4d(bs, &tmap_b, bar, k0, bn0, 0, e);
              if (!BLZ_PROBE_HALF_B)
                sm90::tma_load_4d(bs + HALF * ROW_BYTES, &tmap_b, bar, k0, HALVES ? n0 : bn0 + HALF, HALVES ? 1 : 0, e);
            } else if constexpr (HALVES) {
              // atoms [0, BN/128) the gate columns n0 + 64 a, the rest the up columns (the map's second dimension)
              constexpr int AH = BN / 128;  // atoms a half
#pragma unroll
              for (int a = 0; a < BN / 64 / (BLZ_PROBE_HALF_B ? 2 : 1); ++a)
                sm90::tma_load_4d(bs + a * (BK * ROW_BYTES), &tmap_b, bar, n0 + 64 * (a % AH), a / AH, k0, e);
            } else {
#pragma unroll
              for (int a = 0; a < BN / 64 / (BLZ_PROBE_HALF_B ? 2 : 1); ++a)
                sm90::tma_load_3d(bs + a * (BK * ROW_BYTES), &tmap_b, bar, bn0 + 64 * a, k0, e);
            }
          }
        } else if constexpr (B_KMAJOR) {
          constexpr int ROWS = HALVES ? BN / 32 : BN / 16;
          const long long step = 16 * ldb;
#pragma unroll
          for (int half = 0; half < (HALVES ? 2 : 1); ++half) {
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
      sm90::post_tile(info0, info_full0, li, make_uint4(~0u, 0u, 0u, 0u));
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
    const bool o_map = EPI == EPI_ROWSCALE && sm90::tma_map_given(&tmap_o);  // out by TMA stores
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
      // keep_acc: the reduction is never empty here (num_kt >= 1), so the accumulators need no zero-fill path (it
      // would cost a select per accumulator a tile)
      sm90::consumer_mainloop<STAGES, BN / 2, decltype(issue)&, A_ACT ? 0 : 1, sm90::NoPrep, !(A_TMA && B_TMA)>(
          acc, full0, empty0, num_kt, t, C::STAGE_BYTES, stage, phase, issue, /*keep_acc=*/true);

      // ---- epilogues (same math as moe_gemm; fragment walk from the wgmma layout) --------------------
#if BLZ_PROBE_EPI == 2
      if constexpr (EPI == EPI_DHCUR) {
        __syncwarp();
        if (lane == 0) sm90::mbar_arrive(epi_done);
      }
      continue;
#endif
      const int srow0 = m0 + cw * 64;     // slot of warpgroup row 0
      const int wrow0 = srow0 + 16 * wq;  // slot of the warp's first row
      const int fr = sm90::acc_row(0, t) - 16 * wq, fc = sm90::acc_col(0, t);  // fragment row (in the warp), column
      if constexpr (EPI == EPI_ACT && IL) {
        // Interleaved: the tile's BN columns of z from 2 n0 hold the (gate, up) pairs of h's columns [n0, n0 + BN / 2),
        // each pair in one thread's register pair. In passes of P = 64 columns of z (32 of h) through the warp's
        // staging: z's pairs (+ b13, interleaved alike) as the plain epilogue stages z (16 rows of 128 bytes), hcur
        // one element a pair into 16 rows of 64 bytes; both go out as 16-byte row copies.
        constexpr int P = 64, HP = P / 2, ZARR = 16 * P * 2;
        static_assert(ZARR + 16 * HP * 2 <= sm90::EPI_WARP_BYTES, "act staging fits in the warp's area");
        const T* be = bias ? bias + (long long)e * bias_estride : nullptr;
        T* hout = p.store_h ? out : nullptr;
        T* zout = p.store_z ? out2 : nullptr;
        const unsigned za = ep, hs = ep + ZARR;
        const int zn0 = 2 * n0;
        auto passes = [&](auto has_bias) {  // with and without a bias (sm90::BoolC)
#pragma unroll
          for (int p = 0; p < BN / P; ++p) {
            sm90::staged_pass<P>(p, fr, fc, lane, [&](int h, int j, int c, unsigned off) {
              float a = acc[sm90::acc_reg(j, h)], b = acc[sm90::acc_reg(j, h) + 1];
              sm90::add_bias2(be, zn0 + c, 2 * N, a, b, has_bias);
              // hcur from z as stored (rounded to T), as the backward recomputes it
              const unsigned zv = sm90::pack2<T>(a, b);
              const float2 zr = sm90::unpack2<T>(zv);
              sm90::st_shared_u32(za + off, zv);
              const int hc = (c >> 1) - p * HP;  // the pair's column of h in the pass
              sm90::st_shared_u16(hs + sm90::stage_off<HP / 8>(fr + 8 * h, hc >> 3) + (hc & 7) * 2,
                                  sm90::pack1<T>(gated_f<ACT>(zr.x, zr.y)));
            }, [&](int rl, unsigned off, int col) {
              const int s = wrow0 + rl, ch = (col >> 3) - p * (P / 8);  // chunk ch of the pass's z row
              if (s < m_end && !BLZ_PROBE_EPI) {
                if (zout && zn0 + col < 2 * N)
                  *reinterpret_cast<uint4*>(zout + (long long)s * ldo2 + zn0 + col) = sm90::ld_shared_v4(za + off);
                // lanes of chunks 0..3 copy the same chunk of the row's 32 h columns
                const int hc = n0 + p * HP + 8 * ch;
                if (hout && ch < HP / 8 && hc < N)
                  *reinterpret_cast<uint4*>(hout + (long long)s * ldo + hc) =
                      sm90::ld_shared_v4(hs + sm90::stage_off<HP / 8>(rl, ch));
              }
            });
          }
        };
        if (be) passes(sm90::BoolC<true>{}); else passes(sm90::BoolC<false>{});
      } else if constexpr (EPI == EPI_ACT) {
        // In passes of P output columns through the warp's staging: the activation h and the pre-activations z
        // (gated: gate and up parts) go out as 16-byte row copies. A tile covers NC output columns (gated: BN / 2
        // of h, with the matching gate and up columns of z).
        constexpr int NC = GATED ? BN / 2 : BN;
        constexpr int P = GATED ? 32 : 64, NARR = GATED ? 3 : 2, ARR = 16 * P * 2;
        static_assert(NARR * ARR <= sm90::EPI_WARP_BYTES, "act staging fits in the warp's area");
        const T* be = bias ? bias + (long long)e * bias_estride : nullptr;
        T* hout = p.store_h ? out : nullptr;
        T* zout = p.store_z ? out2 : nullptr;
        const unsigned hs = ep, za = ep + ARR, zb = ep + 2 * ARR;  // zb: gated only
        auto passes = [&](auto has_bias) {  // with and without a bias (sm90::BoolC)
#pragma unroll
          for (int p = 0; p < NC / P; ++p) {
            sm90::staged_pass<P>(p, fr, fc, lane, [&](int h, int j, int c, unsigned off) {
              if constexpr (GATED) {
                constexpr int UP = BN / 16;  // column groups between a gate column and its up column
                float a0 = acc[sm90::acc_reg(j, h)], a1 = acc[sm90::acc_reg(j, h) + 1];
                float b0 = acc[sm90::acc_reg(j + UP, h)], b1 = acc[sm90::acc_reg(j + UP, h) + 1];
                sm90::add_bias2(be, n0 + c, N, a0, a1, has_bias);
                sm90::add_bias2(be ? be + bup : be, n0 + c, N, b0, b1, has_bias);
                // hcur from z as stored (rounded to T), as the A_ACT second GEMM and the backward recompute it
                const unsigned zav = sm90::pack2<T>(a0, a1), zbv = sm90::pack2<T>(b0, b1);
                const float2 ar = sm90::unpack2<T>(zav), br = sm90::unpack2<T>(zbv);
                sm90::st_shared_u32(hs + off, sm90::pack2<T>(gated_f<ACT>(ar.x, br.x), gated_f<ACT>(ar.y, br.y)));
                sm90::st_shared_u32(za + off, zav);
                sm90::st_shared_u32(zb + off, zbv);
              } else {
                float z0 = acc[sm90::acc_reg(j, h)], z1 = acc[sm90::acc_reg(j, h) + 1];
                sm90::add_bias2(be, n0 + c, N, z0, z1, has_bias);
                const unsigned zv = sm90::pack2<T>(z0, z1);
                const float2 zr = sm90::unpack2<T>(zv);
                sm90::st_shared_u32(hs + off, sm90::pack2<T>(act_f<ACT>(zr.x), act_f<ACT>(zr.y)));
                sm90::st_shared_u32(za + off, zv);
              }
            }, [&](int rl, unsigned off, int col) {
              const int s = wrow0 + rl, nc = n0 + col;
              if (s < m_end && nc < N && !BLZ_PROBE_EPI) {
                if (hout) *reinterpret_cast<uint4*>(hout + (long long)s * ldo + nc) = sm90::ld_shared_v4(hs + off);
                if (zout) {
                  T* zr = zout + (long long)s * ldo2 + nc;
                  *reinterpret_cast<uint4*>(zr) = sm90::ld_shared_v4(za + off);
                  if constexpr (GATED) *reinterpret_cast<uint4*>(zr + N) = sm90::ld_shared_v4(zb + off);
                }
              }
            });
          }
        };
        if (be) passes(sm90::BoolC<true>{}); else passes(sm90::BoolC<false>{});
      } else if constexpr (EPI == EPI_ROWSCALE) {
        // (acc + bias) * gate, in passes of P = 64 columns through the two 2 KB halves of the warp's staging in turn
        // (16 rows of 128 bytes, the 128-byte swizzle). With out's tensor map (tmap_o: 2-D (N, rows of out), box
        // (64, 16)) and all 16 of the warp's rows inside the expert, one lane stores each pass's box by TMA and the
        // warp goes on (a half is rewritten once the store two passes back has read it); otherwise the warp stores
        // its rows with 16-byte copies. The stores of the last tiles are waited for before the CTA exits.
        constexpr int P = 64, HALF = 16 * P * 2;
        static_assert(2 * HALF <= sm90::EPI_WARP_BYTES, "rowscale staging fits in the warp's area");
        const T* be = bias ? bias + (long long)e * bias_estride : nullptr;
        float gs[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int s = srow0 + sm90::acc_row(2 * h, t);
          gs[h] = (gates && s < m_end) ? slot_gate(gates, slot_token, slot_k, topk, s) : 1.f;
        }
        const bool tma_rows = o_map && wrow0 + 16 <= m_end;  // warp-uniform
        auto passes = [&](auto has_bias) {  // with and without a bias (sm90::BoolC)
#pragma unroll
          for (int p = 0; p < BN / P; ++p) {
            const unsigned buf = ep + (p & 1) * HALF;
            if (o_map) sm90::tma_pass_begin(lane);
            auto pair = [&](int h, int j) {  // the T pair of row slot h, columns fc + 8 j, + 1
              float o0 = acc[sm90::acc_reg(j, h)], o1 = acc[sm90::acc_reg(j, h) + 1];
              sm90::add_bias2(be, n0 + fc + 8 * j, N, o0, o1, has_bias);
              return sm90::pack2<T>(o0 * gs[h], o1 * gs[h]);
            };
            auto put = [&](int h, int j, int, unsigned off) { sm90::st_shared_u32(buf + off, pair(h, j)); };
            if (tma_rows) {
              sm90::staged_put_x4<P, false>(buf, p, lane, pair);
              sm90::tma_pass_end(lane, [&] {
                if (n0 + p * P < N && !BLZ_PROBE_EPI) sm90::tma_store_2d(&tmap_o, buf, n0 + p * P, wrow0);
              });
            } else {
              sm90::staged_pass<P>(p, fr, fc, lane, put, [&](int rl, unsigned off, int col) {
                const int s = wrow0 + rl, nc = n0 + col;
                if (s < m_end && nc < N && !BLZ_PROBE_EPI)
                  *reinterpret_cast<uint4*>(out + (long long)s * ldo + nc) = sm90::ld_shared_v4(buf + off);
              });
            }
          }
        };
        if (be) passes(sm90::BoolC<true>{}); else passes(sm90::BoolC<false>{});
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
        // the lane's chunk of z / dz in the za and zb arrays: [gate; up] the columns nc of each half; interleaved
        // the pairs of h's columns [n0, n0 + BN/2) (za) and [n0 + BN/2, n0 + BN) (zb), 2 n0 + 8 co and BN further
        // (computed where used: kept live across the arithmetic they cost the interleaved forms spills)
        auto zcol = [&](int half) -> long long { return IL ? 2LL * n0 + co * EPC + half * BN : half ? zup + nc : nc; };
        auto zok = [&](int half) { return IL ? n0 + half * (BN / 2) + co * (EPC / 2) < N : nc < N; };
        sm90::consumer_bar_sync();  // both warpgroups' wgmma are done with the ring before it is overwritten
        // every z chunk of the warp's rows in flight at once (cp.async straight into the staging; zero-filled
        // past the expert's rows or the last column), then one wait
#pragma unroll
        for (int i = 0; i < 16 / RPI; ++i) {
          const int rl = RPI * i + ro, s = wrow0 + rl;
          const T* zr = aux + (long long)s * ldaux;
          const bool ra = s < m_end && zok(0), rb = s < m_end && zok(1);
          sm90::cp_async16_s(za + chunk_off(rl, co), ra ? zr + zcol(0) : aux, ra ? 16 : 0);
          if constexpr (G2) sm90::cp_async16_s(zb + chunk_off(rl, co), rb ? zr + zcol(1) : aux, rb ? 16 : 0);
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
          constexpr int JB = IL ? 2 : 8;  // (interleaved: 8-byte z loads; batches of 4 spilled in the geglu form)
          const int r0 = sm90::acc_row(0, t) - 16 * wq, c0 = sm90::acc_col(0, t);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int rl = r0 + 8 * h;
            if constexpr (IL) {
#pragma unroll
              for (int jb = 0; jb < BN / 8; jb += JB) {
                // interleaved: columns c, c + 1 of h are z's [a0, b0, a1, b1] at 2 c (za below 2 c = BN, else zb),
                // read and rewritten (dz) 8 bytes at a time; g * hcur as the [gate; up] form stages it
                uint2 zv[JB];
#pragma unroll
                for (int u = 0; u < JB; ++u) {
                  const int lc = (2 * (c0 + 8 * (jb + u))) & (BN - 1);
                  zv[u] = sm90::ld_shared_v2((jb + u < BN / 16 ? za : zb) + chunk_off(rl, lc >> 3) + (lc & 7) * 2);
                }
#pragma unroll
                for (int u = 0; u < JB; ++u) {
                  const int c = c0 + 8 * (jb + u), lc = (2 * c) & (BN - 1);
                  const int i = sm90::acc_reg(jb + u, h);
                  const float2 q0 = sm90::unpack2<T>(zv[u].x), q1 = sm90::unpack2<T>(zv[u].y);
                  const DhcurPair q = dhcur_math<ACT>(q0.x, q1.x, q0.y, q1.y, acc[i], acc[i + 1], gs[h]);
                  sm90::st_shared_v2((jb + u < BN / 16 ? za : zb) + chunk_off(rl, lc >> 3) + (lc & 7) * 2,
                                     make_uint2(sm90::pack2<T>(q.da0, q.db0), sm90::pack2<T>(q.da1, q.db1)));
                  sm90::st_shared_u32(hs + chunk_off(rl, c >> 3) + (c & 7) * 2, sm90::pack2<T>(q.hg0, q.hg1));
                  psum[h] += q.p;
                }
              }
            } else {
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
        }
        __syncwarp();
#pragma unroll 1
        for (int i = 0; i < 16 / RPI; ++i) {
          const int rl = RPI * i + ro, s = wrow0 + rl;
          if (s < m_end && !BLZ_PROBE_EPI) {
            T* dzr = out + (long long)s * ldo;
            if (zok(0)) *reinterpret_cast<uint4*>(dzr + zcol(0)) = sm90::ld_shared_v4(za + chunk_off(rl, co));
            if constexpr (G2) {
              if (zok(1)) *reinterpret_cast<uint4*>(dzr + zcol(1)) = sm90::ld_shared_v4(zb + chunk_off(rl, co));
            }
            if (nc < N)
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
    if (o_map && lane == 0) sm90::bulk_wait<0>();  // the TMA stores complete before the CTA's shared memory goes
  }
#else
  // Built for another target: this kernel needs sm_90a (wgmma, setmaxnreg); launch moe_gemm instead.
  __trap();
#endif
}

}  // namespace blz
