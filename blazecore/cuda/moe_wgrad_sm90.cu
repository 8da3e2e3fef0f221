#include "sm90_common.cuh"

#if BLZ_PROBE_TIMELINE
// Timing probe (results unchanged): CTA 0 of the last launch of each OUT_T form records the SM clock (clock64) of its
// first BLZ_PROBE_TIMELINE k-tiles: [0] the producer past the stage's empty wait, [1] its copies issued, [2] the
// consumers past the stage's full wait (read back by scripts/probe_wgrad_timeline.py).
extern "C" {
__device__ unsigned long long blz_wgrad_timeline[2][3][BLZ_PROBE_TIMELINE];
}
#endif

namespace blz {

// ---- K-grouped weight gradient (MODE_K, EPI_WGRAD) -------------------------------------------------------
//
//   W_e[m, n] = sum over slots s in [offsets[e], offsets[e+1]), in slot order, of A[rowA(s), m] * B[rowB(s), n]
//   rowA(s) = slot_token[s] (A_GATHER) or s; rowB(s) likewise (B_GATHER); W is (E, M, N) row-major (o_estride).
//
// Tile = (expert e, 128-row m-tile, BN-column n-tile), numbered expert-major: v = e * tiles_m * tiles_n + rt,
// tiles_m = ceil(M / 128), tiles_n = ceil(N / BN); the expert's tiles rt in groups of 16 m-tiles, each group's
// n-tiles one after another (rt = first * tiles_n + tn * gsz + tm - first, first = 16 * (rt / (16 * tiles_n)),
// gsz = min(16, tiles_m - first)). Persistent CTAs: CTA b takes tiles b, b + gridDim.x, ... (the launcher starts at
// most one CTA per SM, or as many 2-CTA clusters as are resident at once; any grid is correct). Stage and phase run
// on over all of a CTA's k-tiles, so the producer fills the next tile's stages while the consumers store a tile.
// One CTA reduces all of a tile's slots in order (no split-K, no atomics: deterministic); an expert with
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
// Epilogue: each consumer warp converts its 16 rows x BN columns to T in four passes of 64 columns through its own
// 4 KB staging area outside the ring. With out's tensor map (tmap_o, see below) a pass goes into one 2 KB half of it
// in the copy engine's 128-byte swizzle and one lane stores it by TMA, and the warp goes on (a half is rewritten once
// the store two passes back has read it; the stores are waited for before exit). Without one the warp stores whole
// 16-byte chunks row by row (transposed, OUT_T: 32 bytes of m a row n), 4-byte stores if out / ldo / o_estride are
// not 16-byte aligned.
// tmap_o: 3-D (N, M, E), box (64, 16, 1), 128-byte swizzle; OUT_T (M, N, E), box (16, 64, 1), no swizzle; strides
// ldo and o_estride. The box clips at M and N, so a launch over a column slice never writes past it. All zeros: no
// map.
// Preconditions (as moe_gemm): M % 8 == 0, N % 8 == 0, lda % 8 == 0, ldb % 8 == 0, A and B 16-byte aligned.
// Arguments: moe_gemm's (MODE_K), KGroupedArgs (moe_args.cuh), then the tensor maps; CARRY_IN instantiates the
// launch whose args.carry_in is set.
// Launch: grid <= E * ceil(M / 128) * ceil(N / BN) (even for clusters; CARRY_IN: equal to it, one CTA a tile),
// block = sm90::THREADS (384),
// dynamic shared memory = sm90::Cfg<BN, 1, STAGES>::SMEM_BYTES (230672 bytes for BN = 256 and 4 stages).

// OUT_T: store the tile transposed, out[e][n][m] (the launcher computes dw13 = dz^T x_g as W^T = x_g^T dz, so
// that the gathered rows take the tile's 128-column side by cp.async and the slot-indexed dz the 256-column side by
// TMA: half the gathered bytes a stage of the other assignment; dw2 = dy_g^T (g hcur) needs no transpose).
// A_TMA: the slot-indexed A tile comes by TMA (tmap_a: 2-D (M, rows of A), box (64, 64), 128-byte swizzle, zero
// fill out of bounds; two boxes a stage, one per 64-column atom) instead of cp.async. A box always holds 64 rows (it
// would bring in the next slots' values), so a reduction tile shorter than 64 slots (an expert's or a token block's
// last) comes by cp.async, which zero-fills the rows past it: every product matches the cp.async path's bit for bit.
// B_TMA: the same for a slot-indexed B (tmap_b: 2-D (N, rows of B), box (64, 64), BN / 64 boxes a stage). One
// expect_tx covers the TMA tiles of a stage (none on a short tile).
// The producer's cp.async copies of one operand's k-tile: this warp's k-rows [rw, rw + ROWS_W), RP k-rows a warp
// instruction (lane sub = lane / chunks-per-row picks its k-row of the RP); dst: the lane's chunk position in the
// tile (XORed with k-row % 8), col_b: its column in row 0 of the source, in bytes from base. The source row of k-row r
// is the gather index (GATHER: held by lane r % 16, see gather_row) or slot t0 + r; rows past the reduction tile
// [t0, tend) and columns out of range (col_ok false) are zero-filled (src-size 0).
template <int RP, int ROWS_W, bool GATHER, typename T>
__device__ __forceinline__ void wgrad_copy_rows(unsigned tile, unsigned dst, int sub, int rw, bool col_ok,
                                                const T* base, unsigned col_b, unsigned long long ld_bytes,
                                                bool off32, int tok, int t0, int tend) {
  // The copies' address arithmetic is most of the producer's instructions, which bound the gathered kernels: where
  // every byte offset into the operand fits 32 bits (off32, warp-uniform) a row's source is one 32-bit multiply-add
  // off the operand's base, else a 32 x 64-bit one; rows past the tile and columns out of range take the src-size
  // form's zero fill (no shared-memory store beside the copies: ptxas then puts no dummy loads around them).
  const char* b0 = reinterpret_cast<const char*>(base);
  const unsigned ld32 = static_cast<unsigned>(ld_bytes);
  auto copies = [&](auto narrow) {
#pragma unroll
    for (int i = 0; i < ROWS_W / RP; ++i) {
#if BLZ_PROBE_A_SKIP
      if (GATHER && i % BLZ_PROBE_A_SKIP == BLZ_PROBE_A_SKIP - 1) continue;  // timing probe: rows left stale
#endif
      const int rl = RP * i + sub;  // k-row within the warp's ROWS_W
      const int r = rw + rl;        // k-row within the k-tile (r % 8 == rl % 8)
      int row;
      if constexpr (GATHER) {
        row = __shfl_sync(0xffffffffu, tok, rl);
#if BLZ_PROBE_A_HOT
        if (row >= 0) row &= 255;
#endif
      } else {
        row = (t0 + r < tend) ? t0 + r : -1;
      }
      const bool ok = col_ok && row >= 0;
      const char* src = decltype(narrow)::value
                            ? b0 + (static_cast<unsigned>(row) * ld32 + col_b)
                            : b0 + col_b + static_cast<unsigned long long>(static_cast<unsigned>(row)) * ld_bytes;
      const unsigned d = tile + r * sm90::ROW_BYTES + (dst ^ static_cast<unsigned>((rl & 7) << 4));
      sm90::cp_async16_s(d, ok ? src : b0, ok ? 16 : 0);  // src-size 0: 16 zero bytes
    }
  };
  if (off32) copies(sm90::BoolC<true>{}); else copies(sm90::BoolC<false>{});
}

// CLUSTER = 2 (moe_wgrad_sm90_x2, B_TMA only): CTAs 2u and 2u + 1 form a cluster and take m-tiles 2j and 2j + 1 of one
// (expert, n-tile) (the launcher uses it where the m-tile count is even, so the grouped order pairs them so), which
// read the same B tiles: each CTA loads half of every stage's B atoms (rank r: atoms [r BN / 128, (r + 1) BN / 128))
// and multicasts them into both CTAs' stage, each full barrier expecting the whole B as before. A stage is refilled
// once the consumers of both CTAs released it: the empty barriers count both CTAs' consumer warps (each warp arrives
// on its own CTA's and, through the cluster, on the other's). The two CTAs reduce the same slots (one expert), so
// their rings run in step; a cluster barrier after the barrier set-up and another before exit keep every remote
// arrival and multicast write inside both CTAs' lifetimes.
template <typename T, bool A_GATHER, bool B_GATHER, int BN, bool OUT_T, bool CARRY_IN, bool A_TMA, bool B_TMA,
          int STAGES, int CLUSTER>
__device__ __forceinline__ void wgrad_body(const KGroupedArgs<T>& p, const sm90::TmaMap& tmap_a,
                                           const sm90::TmaMap& tmap_b, const sm90::TmaMap& tmap_o) {
  const T* __restrict__ A = p.A;
  const T* __restrict__ B = p.B;
  const int* __restrict__ slot_token = p.slot_token;
  const int* __restrict__ offsets = p.offsets;
  const int* __restrict__ kblocks = p.kblocks;
  T* __restrict__ out = p.out;
  float* __restrict__ carry = p.carry;
  const int* __restrict__ carry_seen = p.carry_seen;
  const long long lda = p.lda, ldb = p.ldb, ldo = p.ldo, o_estride = p.o_estride;
  const int num_experts = p.num_experts, M = p.M, N = p.N, num_kblocks = p.num_kblocks;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(sizeof(T) == 2, "wgmma path: 16-bit element types only");
  static_assert(!(A_TMA && A_GATHER), "TMA A: the slot-indexed operand only (the copy engine does not gather rows)");
  static_assert(!(B_TMA && B_GATHER), "TMA B: the slot-indexed operand only (the copy engine does not gather rows)");
  static_assert(CLUSTER == 1 || (CLUSTER == 2 && B_TMA), "2-CTA clusters multicast a TMA B");
  constexpr int MC = CLUSTER;  // CTAs sharing (multicasting) each B tile
  constexpr bool ANY_TMA = A_TMA || B_TMA;
  constexpr int BM = sm90::BM, BK = sm90::BK, ROW_BYTES = sm90::ROW_BYTES;
  // the M-grouped kernels' layout: the consumer warps' 4 KB epilogue staging after the ring (its tile descriptors and
  // epilogue-done barrier stay unused), so the producer fills the next tile's stages during an epilogue
  using C = sm90::Cfg<BN, 1, STAGES>;
  constexpr int EPC = 8;                         // elements per 16-byte chunk
  constexpr int ATOM_BYTES = BK * ROW_BYTES;     // [64 slots][64 columns], 8 KB
  static_assert(BM == 64 * sm90::CONSUMER_WGS, "one A atom per consumer warpgroup");
  extern __shared__ unsigned char sm90_smem[];
  const unsigned sbase = (smem_u32(sm90_smem) + 1023u) & ~1023u;
  const unsigned full0 = sbase + C::BAR_OFFSET, empty0 = full0 + 8 * STAGES;

  const int tid = threadIdx.x;

  // ---- the tiles: v = e * tiles_m * tiles_n + rt, expert-major -----------------------------------------
  const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  const long long per_e = (long long)tiles_m * tiles_n;
  const long long num_tiles = (long long)num_experts * per_e;
  // persistent CTAs: CTA b takes tiles b, b + gridDim.x, ... (any grid is correct; CARRY_IN: at least one CTA a
  // tile). CLUSTER = 2: the grid is even and the tile count too, so the CTAs 2c and 2c + 1 of a cluster take the
  // tile pairs (2u, 2u + 1), u = c, c + gridDim.x / 2, ...: m-tiles 2j and 2j + 1 of one (expert, n-tile)
  const long long tile_step = gridDim.x;
  if (CARRY_IN && tile_step < num_tiles) __trap();  // a CARRY_IN launch runs one tile a CTA (see the consumers)
  struct Tile {
    int e, m0, n0, slot_lo, cnt, num_kt;
  };
  auto tile_of = [&](long long v) {
    Tile w;
    w.e = static_cast<int>(v / per_e);
    // grouped order inside the expert: GROUP_M m-tiles down one n-tile, then the next n-tile, so the ~one CTA per SM
    // that run at a time read about GROUP_M A slices and SMs / GROUP_M B slices (a single row of n-tiles of a wide
    // N, mixtral's dw13, would stream every B slice from DRAM once per m-tile)
    constexpr int GROUP_M = 16;
    const int rt = static_cast<int>(v % per_e);
    const int first = (rt / (GROUP_M * tiles_n)) * GROUP_M, gsz = min(GROUP_M, tiles_m - first);
    const int local = rt - first * tiles_n;
    w.m0 = (first + local % gsz) * BM;
    w.n0 = (local / gsz) * BN;
    w.slot_lo = __ldg(offsets + w.e);
    w.cnt = __ldg(offsets + w.e + 1) - w.slot_lo;  // the expert's slots = the reduction length
    w.num_kt = ktile_count<BK>(kblocks, w.e, num_kblocks, w.slot_lo, w.slot_lo + w.cnt);  // tiles of KTileWalk
    return w;
  };

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      // one per producer thread (producer_signal) + the TMA expect_tx
      sm90::mbar_init(full0 + 8 * s, 128 + (ANY_TMA ? 1 : 0));
      sm90::mbar_init(empty0 + 8 * s, 4 * sm90::CONSUMER_WGS * MC);  // one arrival per consumer warp (cluster)
    }
    if constexpr (CLUSTER > 1) sm90::fence_mbarrier_init_cluster();
  }
  __syncthreads();
  if constexpr (CLUSTER > 1) sm90::cluster_sync();  // the peer's barriers exist before any remote access
  const unsigned rank = CLUSTER > 1 ? sm90::cluster_rank() : 0u;

  if (tid < 128) {
    // ================================ producer warpgroup ================================
    sm90::setmaxnreg_dec<sm90::PRODUCER_REGS>();
    constexpr int CPA = BM / EPC, RPA = 32 / CPA;  // A: 16 chunks per k-row, 2 k-rows per warp instruction
    constexpr int CPB = BN / EPC, RPB = 32 / CPB;  // B: 32 (16) chunks per k-row, 1 (2) k-rows per instruction
    constexpr int ROWS_W = BK / 4;                 // k-rows per producer warp
    static_assert(ROWS_W == 16 && 32 % CPA == 0 && 32 % CPB == 0, "producer warp map");
    const int lane = tid & 31, rw = (tid >> 5) * ROWS_W;
    const int ca = lane % CPA, ra = lane / CPA, cb = lane % CPB, rb = lane / CPB;
    // atom and chunk of this lane's column; the chunk is XORed with (k-row % 8) per copy
    const unsigned a_dst = static_cast<unsigned>((ca >> 3) * ATOM_BYTES + ((ca & 7) << 4));
    const unsigned b_dst = static_cast<unsigned>((cb >> 3) * ATOM_BYTES + ((cb & 7) << 4));
    const unsigned long long lda_b = static_cast<unsigned long long>(lda) * sizeof(T);  // row strides in bytes
    const unsigned long long ldb_b = static_cast<unsigned long long>(ldb) * sizeof(T);
    const bool a_off32 = p.a_off32 != 0, b_off32 = p.b_off32 != 0;
    if (tid == 0) {
      if constexpr (A_TMA) sm90::tma_prefetch_map(&tmap_a);
      if constexpr (B_TMA) sm90::tma_prefetch_map(&tmap_b);
    }

    int stage = 0, it = 0;  // ring position; k-tiles issued over all of the CTA's tiles
    unsigned phase = 0;
    for (long long v = blockIdx.x; v < num_tiles; v += tile_step) {
      const Tile w = tile_of(v);
      const int m0 = w.m0, n0 = w.n0, num_kt = w.num_kt;
      const bool a_cok = m0 + ca * EPC < M, b_cok = n0 + cb * EPC < N;
      // this lane's column in row 0, in bytes from the operand's start
      const unsigned a_colb = static_cast<unsigned>((m0 + ca * EPC) * sizeof(T));
      const unsigned b_colb = static_cast<unsigned>((n0 + cb * EPC) * sizeof(T));
      // the reduction tiles [t0, end()) in order; gather index of k-row rw + lane % 16 of a tile (-1 past it)
      KTileWalk<BK> walk(kblocks, w.e, num_kblocks, w.slot_lo, w.slot_lo + w.cnt);
      auto gather_row = [&](int t0, int tend) -> int {
        const int s = t0 + rw + (lane & 15);
        return s < tend ? __ldg(slot_token + s) : -1;
      };
      int tok_next = ((A_GATHER || B_GATHER) && num_kt > 0) ? gather_row(walk.t0, walk.end()) : -1;
      for (int kt = 0; kt < num_kt; ++kt, ++it) {
        const int tok = tok_next;
        const int t0 = walk.t0, tend = walk.end();
        walk.next();
        if constexpr (A_GATHER || B_GATHER) {
          if (kt + 1 < num_kt) tok_next = gather_row(walk.t0, walk.end());  // prefetch one k-tile ahead
        }
        if (it >= STAGES) sm90::mbar_wait(empty0 + 8 * stage, phase ^ 1u);  // consumers released this stage
        if (tid == 0) BLZ_TIMELINE_MARK(blz_wgrad_timeline[OUT_T][0][it], it);
        const unsigned as = sbase + stage * C::STAGE_BYTES, bs = as + C::A_BYTES;
        // a reduction tile shorter than BK (a token block's or the expert's last) comes by cp.async, whose zero fill
        // stops at the tile's end: a TMA box always holds BK slots and would bring in the next ones, which the
        // consumers would have to zero while the tensor cores wait. Both CTAs of a cluster reduce the same slots, so
        // they take the cp.async path at the same k-tiles and neither multicasts there.
        const bool part = tend - t0 < BK;
        const bool a_tma = A_TMA && !part, b_tma = B_TMA && !part;
        if constexpr (ANY_TMA) {
          // one thread raises the stage's transaction count by the TMA tiles' bytes (none on a short tile: then it
          // only arrives) and issues their boxes (one per 64-column atom)
          if (tid == 0) {
            const unsigned bar = full0 + 8 * stage;
            sm90::mbar_arrive_expect_tx(
                bar, (a_tma ? C::A_BYTES : 0) + (b_tma ? C::B_BYTES / (BLZ_PROBE_HALF_B ? 2 : 1) : 0));
            if (a_tma) {
              sm90::tma_load_2d(as, &tmap_a, bar, m0, t0);
              sm90::tma_load_2d(as + ATOM_BYTES, &tmap_a, bar, m0 + 64, t0);
            }
            const int tb = BLZ_PROBE_B_HOT ? (t0 & 4095) : t0;  // B's first slot
            if (b_tma) {
              if constexpr (MC == 2) {  // this CTA's half of the atoms, into both CTAs' stage
                constexpr int HA = BN / 128;
#pragma unroll
                for (int a = 0; a < HA; ++a) {
                  const int at = static_cast<int>(rank) * HA + a;
                  sm90::tma_load_2d_mc(bs + at * ATOM_BYTES, &tmap_b, bar, n0 + 64 * at, tb, 0x3);
                }
              } else {
#pragma unroll
                for (int a = 0; a < BN / 64 / (BLZ_PROBE_HALF_B ? 2 : 1); ++a)
                  sm90::tma_load_2d(bs + a * ATOM_BYTES, &tmap_b, bar, n0 + 64 * a, tb);
              }
            }
          }
        }
        if (!a_tma)
          wgrad_copy_rows<RPA, ROWS_W, A_GATHER>(as, a_dst, ra, rw, a_cok, A, a_colb, lda_b, a_off32, tok, t0, tend);
        if (!b_tma)
          wgrad_copy_rows<RPB, ROWS_W, B_GATHER>(bs, b_dst, rb, rw, b_cok, B, b_colb, ldb_b, b_off32, tok, t0, tend);
        if (tid == 0) BLZ_TIMELINE_MARK(blz_wgrad_timeline[OUT_T][1][it], it);
        sm90::producer_signal<STAGES>(full0, it, stage);
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1u;
        }
      }
    }
    sm90::producer_drain<STAGES>(full0, it);
  } else {
    // ================================ consumer warpgroups ================================
    sm90::setmaxnreg_inc<sm90::CONSUMER_REGS>();
    const int cw = (tid >> 7) - 1;  // output rows [64 cw, 64 cw + 64) of the tile = A atom cw
    const int t = tid & 127;
    const int ct = tid - 128;  // 0..255 over both consumer warpgroups
    const int lane = t & 31, wq = t >> 5;  // warp wq of the warpgroup owns fragment rows [16 wq, 16 wq + 16)
    const unsigned long long da0 = sm90::make_desc(sbase + cw * ATOM_BYTES, ATOM_BYTES, 1024);
    const unsigned long long db0 = sm90::make_desc(sbase + C::A_BYTES, ATOM_BYTES, 1024);
    constexpr unsigned KSTEP = (16 * ROW_BYTES) >> 4;  // 16 slots = 2048 bytes, encoded
    const bool vec16 = (reinterpret_cast<unsigned long long>(out) & 15ull) == 0 && (ldo & 7) == 0 &&
                       (o_estride & 7) == 0;  // every 8-element chunk of W starts 16-byte aligned
    const bool o_map = sm90::tma_map_given(&tmap_o);  // out by TMA stores
    auto store16 = [&](T* dst, uint4 v) {
      if (vec16) {
        *reinterpret_cast<uint4*>(dst) = v;
      } else {
        unsigned* d4 = reinterpret_cast<unsigned*>(dst);
        d4[0] = v.x; d4[1] = v.y; d4[2] = v.z; d4[3] = v.w;
      }
    };

    int stage = 0;
    unsigned phase = 0;
    int cit = 0;  // k-tiles consumed over all of the CTA's tiles (BLZ_PROBE_TIMELINE)
    float acc[BN / 2];  // no zero-fill before the mainloop (C7515): scale_d = 0 on the first wgmma
    // CARRY_IN (args.carry_in): continue the fp32 partial sums an earlier launch (chunk) left in carry, for experts
    // that had slots there (carry_seen); the first wgmma then accumulates onto them (scale_d = 1). Accumulators
    // loaded under a condition make ptxas serialize every wgmma of the kernel (C7515: a wait after each); loaded
    // unconditionally they do not. A CARRY_IN launch runs one tile a CTA (the launcher's grid covers the tiles,
    // checked at entry) and loads that tile's sums here (a persistent form loading each tile's sums at its start was
    // no faster); only the second and later chunks of a chunked backward run it.
    if constexpr (CARRY_IN) {
      const float* c0 = carry + (long long)blockIdx.x * (BN / 2) * 256 + ct;
  #pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[i] = c0[i * 256];
    }
    for (long long v = blockIdx.x; v < num_tiles; v += tile_step) {
      const Tile w = tile_of(v);
      const int e = w.e, m0 = w.m0, n0 = w.n0;
      float* cslice = carry + v * (BN / 2) * 256 + ct;  // this thread's column of the tile's slice
      const bool carry_in = CARRY_IN && __ldg(carry_seen + e) != 0;

      sm90::consumer_mainloop<STAGES>(acc, full0, empty0, w.num_kt, t, C::STAGE_BYTES, stage, phase,
                                      [&](unsigned long long soff, int kt) {
        if (tid == 128) BLZ_TIMELINE_MARK(blz_wgrad_timeline[OUT_T][2][cit], cit);
        ++cit;
  #pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks)
          sm90::Wgmma<BN, T>::template mma<1, 1>(acc, da0 + soff + ks * KSTEP, db0 + soff + ks * KSTEP,
                                                 carry_in || (kt | ks) != 0);
      }, carry_in, sm90::NoPrep(), MC > 1 ? sm90::map_to_rank(empty0, rank ^ 1u) : 0u);
      // (an expert without slots leaves zero accumulators, or the carried sums)
      if (p.carry_out) {  // partial sums for the next chunk's launch instead of the gradient
  #pragma unroll
        for (int i = 0; i < BN / 2; ++i) cslice[i * 256] = acc[i];
        continue;
      }

      T* oe = out + (long long)e * o_estride;
      const int mrow0 = m0 + cw * 64 + wq * 16;  // the warp's first output row (m)
      // ---- epilogue through the warp's own 4 KB staging outside the ring, in passes of 64 columns, while the
      // producer fills the ring with the next tile's k-tiles
      constexpr int P = 64, PASSES = BN / P;
      const unsigned stg = sbase + C::EPI_OFFSET + static_cast<unsigned>((cw * 4 + wq) * sm90::EPI_WARP_BYTES);
      const int fr = (lane >> 2), fc = 2 * (lane & 3);  // the thread's first fragment row in the warp, first column
      auto pair = [&](int hh, int j) {  // the T pair of row slot hh, columns fc + 8 j, + 1
        const int r0 = sm90::acc_reg(j, hh);
        return sm90::pack2<T>(acc[r0], acc[r0 + 1]);
      };
      if (o_map) {
        // a pass: 16 rows m x 64 columns n of the warp in one 2 KB half of its staging, in the box's layout (16 rows
        // of 128 bytes, the 128-byte swizzle; OUT_T: 64 rows n of 32 bytes of m, no swizzle); one lane stores it by TMA
        constexpr int HALF = 16 * P * 2;
        static_assert(2 * HALF <= sm90::EPI_WARP_BYTES, "two passes fit in the warp's staging");
  #pragma unroll
        for (int pp = 0; pp < PASSES; ++pp) {
          const unsigned buf = stg + (pp & 1) * HALF;
          sm90::tma_pass_begin(lane);
          sm90::staged_put_x4<P, OUT_T>(buf, pp, lane, pair);
          sm90::tma_pass_end(lane, [&] {
            const int nc = n0 + pp * P;
            if (nc < N && mrow0 < M && !BLZ_PROBE_EPI) {
              if constexpr (OUT_T) sm90::tma_store_3d(&tmap_o, buf, mrow0, nc, e);
              else sm90::tma_store_3d(&tmap_o, buf, nc, mrow0, e);
            }
          });
        }
      } else if constexpr (OUT_T) {
        // transposed: pass p stages columns n of [64 p, 64 p + 64) as rows of the warp's 16 m (32 bytes, pitch 48:
        // the fragment's 2-byte writes are free of bank conflicts), then each lane stores 16-byte halves of them
        constexpr int TP = 48;
        static_assert(P * TP <= sm90::EPI_WARP_BYTES, "a transposed pass fits the warp's staging");
  #pragma unroll
        for (int pp = 0; pp < PASSES; ++pp) {
  #pragma unroll
          for (int hh = 0; hh < 2; ++hh)
  #pragma unroll
            for (int jj = 0; jj < P / 8; ++jj) {
              const int j = pp * (P / 8) + jj, nl = 8 * jj + fc, ml = fr + 8 * hh;
              sm90::st_shared_u16(stg + nl * TP + ml * 2, sm90::pack1<T>(acc[sm90::acc_reg(j, hh)]));
              sm90::st_shared_u16(stg + (nl + 1) * TP + ml * 2, sm90::pack1<T>(acc[sm90::acc_reg(j, hh) + 1]));
            }
          __syncwarp();
  #pragma unroll
          for (int i = 0; i < P * 2 / 32; ++i) {
            const int nl = 16 * i + (lane >> 1), half = lane & 1;
            const int n = n0 + pp * P + nl, m = mrow0 + 8 * half;
            const uint4 val = sm90::ld_shared_v4(stg + nl * TP + 16 * half);
            if (n < N && m < M) store16(oe + (long long)n * ldo + m, val);
          }
          __syncwarp();
        }
      } else {
  #pragma unroll
        for (int pp = 0; pp < PASSES; ++pp)
          sm90::staged_pass<P>(pp, fr, fc, lane,
              [&](int hh, int j, int, unsigned off) { sm90::st_shared_u32(stg + off, pair(hh, j)); },
              [&](int rl, unsigned off, int col) {
                const uint4 val = sm90::ld_shared_v4(stg + off);
                const int m = mrow0 + rl, n = n0 + col;
                if (m < M && n < N) store16(oe + (long long)m * ldo + n, val);
              });
      }
    }  // tiles
    if (o_map && lane == 0) sm90::bulk_wait<0>();  // the TMA stores complete before the CTA's shared memory goes
  }
  if constexpr (CLUSTER > 1) sm90::cluster_sync();  // no remote arrival or multicast into a CTA that has exited
#else
  (void)p;
  (void)tmap_a;
  (void)tmap_b;
  (void)tmap_o;
  // Built for another target: this kernel needs sm_90a (wgmma, setmaxnreg); launch moe_gemm instead.
  __trap();
#endif
}

template <typename T, bool A_GATHER, bool B_GATHER, int BN, bool OUT_T, bool CARRY_IN, bool A_TMA, bool B_TMA,
          int STAGES>
__global__ void __launch_bounds__(sm90::THREADS, 1) moe_wgrad_sm90(
    const KGroupedArgs<T> p,
    const __grid_constant__ sm90::TmaMap tmap_a,    // A_TMA: the A operand's tensor map
    const __grid_constant__ sm90::TmaMap tmap_b,    // B_TMA: the B operand's tensor map
    const __grid_constant__ sm90::TmaMap tmap_o) {  // out's tensor map, or all zeros (see wgrad_body)
  wgrad_body<T, A_GATHER, B_GATHER, BN, OUT_T, CARRY_IN, A_TMA, B_TMA, STAGES, 1>(p, tmap_a, tmap_b, tmap_o);
}

// The 2-CTA cluster form (CLUSTER = 2 above): grid a multiple of 2, every expert's m-tile count even. (Built for an
// architecture without clusters, the CPU compile check's sm_80, it is the trapping stub without the cluster shape.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define BLZ_CLUSTER_DIMS_2
#else
#define BLZ_CLUSTER_DIMS_2 __cluster_dims__(2, 1, 1)
#endif
template <typename T, bool A_GATHER, bool B_GATHER, int BN, bool OUT_T, bool CARRY_IN, bool A_TMA, bool B_TMA,
          int STAGES>
__global__ void BLZ_CLUSTER_DIMS_2 __launch_bounds__(sm90::THREADS, 1) moe_wgrad_sm90_x2(
    const KGroupedArgs<T> p,
    const __grid_constant__ sm90::TmaMap tmap_a,
    const __grid_constant__ sm90::TmaMap tmap_b,
    const __grid_constant__ sm90::TmaMap tmap_o) {
  wgrad_body<T, A_GATHER, B_GATHER, BN, OUT_T, CARRY_IN, A_TMA, B_TMA, STAGES, 2>(p, tmap_a, tmap_b, tmap_o);
}

}  // namespace blz
