// sm_90a dh' (the EPI_DHCUR contract of moe_gemm_sm90.cu) with its epilogue under the next tile's mainloop.
//
//   dh'[s, n] = sum_k dy[slot_token[s], k] * w2_e[k, n]          (w2 "out_in": (E, d, h), B N-major; "in_out":
//                                                                 (E, h, d), B K-major, B_KMAJOR)
//   then, per element: dz = act backward (g folded in), g * hcur, and the dgates partial sum of dh' * hcur a row
//
// The epilogue reads z (2h a slot row) and writes dz and g * hcur (3h): run by the consumers after their
// mainloop, it kept the tensor cores idle for as long as the mainloop ran. Here the consumers only round the tile's
// dh' to T and write it to shared memory, then start the next tile at once; the producer warpgroup, between its
// k-tiles' copies, brings the tile's z rows in by cp.async (ZD rows in flight a warp), computes dz, g * hcur and the
// partial sums from dh' and z, and stores them with 16-byte row stores (z read and dz, g * hcur stored with an L2
// evict-first policy: each is touched once here). So the epilogue's arithmetic and its DRAM traffic run under the
// next tile's wgmmas.
//
// CTA of the EW = 3 form ("overlap"; the default EW = 6 form, "wide", is described below) = 3 warpgroups (384
// threads), one CTA per SM (persistent, the tile order of moe_gemm_sm90):
//   warpgroup 0     warp 0 the copies: the gathered dy rows by cp.async (8 threads a 128-byte row, rows r0 + 4 i)
//                   and B's four [64 k][64 n] atoms by TMA (box (64, 64), one issuing thread) into a STAGES-deep ring
//                   of 48 KB stages, laid out as moe_gemm_sm90's N-major form (B_KMAJOR: two boxes (64, 128) of
//                   rows, its K-major form). Warps 1-3 the previous tile's epilogue
//                   while the consumers run this one's mainloop: warp w takes rows (w - 1) + 3 j, lane l the columns
//                   [8 l, 8 l + 8).
//                   Each z row comes ZD rows ahead into a slot with an mbarrier of its own: every lane copies its
//                   own two 16-byte chunks (gate and up halves) by cp.async and arrives on the slot's barrier when
//                   they land (cp.async.mbarrier.arrive; the copy warp's are other threads' copies, which the ring's
//                   full barriers do not wait for). One lane issuing two 1-D bulk copies a row cost the epilogue
//                   more: the copies take uniform operands and a proxy fence (docs/sm90_kernels.md). A warp
//                   takes BLZ_DH_ROWS (2) rows a step, side by side: the epilogue is a chain of about 300 dependent
//                   instructions a row on one warp a scheduler, and two chains at a time overlap their latencies.
//   warpgroups 1, 2 consumers: rows [64 (w-1), 64 w) of the tile, 4 x wgmma m64n256k16 a k-tile; after the
//                   mainloop each waits until the producer has read the previous tile's dh' ("dh-empty"), writes its
//                   fragment as T pairs (row R at R * 512 bytes, 16-byte chunk c at c ^ (R % 8): conflict-free for the
//                   fragment's 4-byte writes and the producer's 16-byte row reads) and arrives on "dh-full".
// Interleaved gate/up (ACT_INTERLEAVED or'ed into ACT_ID): z's and dz's columns 2 n, 2 n + 1 are the gate and up of h
// column n, so a lane's 8 columns of h are 32 contiguous bytes of z (its two chunks) and of dz.
// dh' is rounded to T before the activation backward (as an unfused dh' GEMM would store it); z, dz and g * hcur are
// T. Every element is computed by one thread in a fixed order, so the results are the same run to run.
//
// Shared memory: sm90::DhCfg<STAGES> (sm90_common.cuh); the ring is shorter than moe_gemm_sm90's (dh' takes 64 KB).
//
// EW = 6 (the "wide" form): a fourth warpgroup (512 threads), so that two warps copy (each 64 of a k-tile's 128 A
// rows) and six do the epilogue (warp w of 0..5: rows w + 6 j, one row a step with the next one's z in flight: the 16
// z slots shared out as 6 x 2). In a 512-thread CTA ptxas does not compile wgmma m64n256k16 (it checks the
// instruction's ~154 registers against the 128 a thread has at entry), so the consumers issue each k16 step as two
// m64n128k16 on the B tile's two column halves with A from registers: each warp reads its 16 rows x 16 k by
// ldmatrix.x4 (A is read from shared memory once, as by the m64n256 form). One register set of A: a k-tile's wgmmas
// finish before the next k-tile is read (the other consumer warpgroup's keep the tensor cores busy meanwhile), and
// every consumer thread releases the stage it read (the empty barriers count 256 arrivals). setmaxnreg, at the head
// of each role's branch: the consumers 176 registers, the others 80 (256 x 176 + 256 x 80 = 65536); ptxas allocates
// each role's code under its own count. The two accumulator halves keep the m64n256 fragment's layout, so dh' and
// every epilogue result have the same bits as the EW = 3 form.
#include "sm90_common.cuh"

#if BLZ_PROBE_TIMELINE
// Timing probe (results unchanged): CTA 0 of the last launch records the SM clock (clock64). By k-tile (its first
// BLZ_PROBE_TIMELINE): [0] the copy warps' thread 0 past the stage's empty wait, [1] its copies and B's TMA issued,
// [2] the consumers past the stage's full wait; by tile: [3] the consumers done with the mainloop, [4] past their wait
// for the epilogue warps to have read the previous tile's dh', [5] epilogue warp 0 past its dh' wait, [6] done with the
// tile's rows (read back by scripts/probe_wgrad_timeline.py --kernel dh).
extern "C" {
__device__ unsigned long long blz_dh_timeline[7][BLZ_PROBE_TIMELINE];
}
#endif

namespace blz {

// Arguments: MGroupedArgs (moe_args.cuh) as moe_gemm_sm90's EPI_DHCUR takes them (A = dy gathered through slot_token,
// B = w2_e N-major, out = dz (may alias aux = z), out2 = g * hcur, part: one fp32 column a 256-column n-tile), then
// B's tensor map: 3-D (N, Kd, E), box (64, 64, 1), 128-byte swizzle, zero fill out of bounds; B_KMAJOR (w2_e
// K-major, "in_out"): 4-D (Kd, N, 1, E), box (64, 128, 1, 1), moe_gemm_sm90's K-major map.
// Launch: any grid (persistent); block = sm90::THREADS (EW = 6: sm90::THREADS + 128), dynamic shared memory =
// sm90::DhCfg<STAGES>::SMEM_BYTES.
// Preconditions: Kd > 0; lda, ldaux, ldo, ldo2 and N multiples of 8 (16-byte rows), as for moe_gemm_sm90.
template <typename T, int ACT_ID, int STAGES, bool B_KMAJOR = false, int EW = 3>
__global__ void __launch_bounds__(EW == 3 ? sm90::THREADS : sm90::THREADS + 128, 1)
    moe_dhcur_sm90(const MGroupedArgs<T> p,
                                                                    const __grid_constant__ sm90::TmaMap tmap_b) {
  const T* __restrict__ A = p.A;
  const int* __restrict__ slot_token = p.slot_token;
  const int* __restrict__ slot_k = p.slot_k;
  const int* __restrict__ offsets = p.offsets;
  const int* __restrict__ tile_offsets = p.tile_offsets;
  T* out = p.out;  // dz, may alias aux (z): each element is read by the thread that writes it, before it does
  T* __restrict__ out2 = p.out2;
  const T* aux = p.aux;
  const float* __restrict__ gates = p.gates;
  float* __restrict__ part = p.part;
  const long long lda = p.lda, ldo = p.ldo, ldo2 = p.ldo2, ldaux = p.ldaux;
  const int num_experts = p.num_experts, N = p.N, Kd = p.Kd, topk = p.topk, part_ld = p.part_ld;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(sizeof(T) == 2, "wgmma path: 16-bit element types only");
  constexpr int ACT = act_base(ACT_ID);
  constexpr bool IL = act_interleaved(ACT_ID);  // interleaved gate/up pairs (see the header)
  static_assert(!IL || act_gated(ACT), "interleaved: a gated activation");
  static_assert(EW == 3 || EW == 6, "three epilogue warps (384 threads) or six (512)");
  using C = sm90::DhCfg<STAGES>;
  constexpr bool WIDE = EW == 6;
  constexpr int NCW = WIDE ? 2 : 1;        // copy warps
  constexpr int NZ = 4 * C::ZD;            // z row slots (and their barriers) in all
  constexpr int ZD = WIDE ? 2 : C::ZD;     // z rows in flight a warp: 4 (EW 3), 2 (EW 6)
  static_assert(EW * ZD <= NZ, "the warps' z rows fit the slots");
  constexpr int BM = sm90::BM, BK = C::BK, BN = C::BN, EPC = 8;
  constexpr bool G2 = act_gated(ACT);
  extern __shared__ unsigned char sm90_smem[];
  const unsigned sbase = (smem_u32(sm90_smem) + 1023u) & ~1023u;
  const unsigned full0 = sbase + C::BAR_OFFSET, empty0 = full0 + 8 * C::STAGES;
  const unsigned dh_full = empty0 + 8 * C::STAGES, dh_empty = dh_full + 8;
  const unsigned zbar0 = dh_empty + 8;                // z row slots: warp w's slot q at zbar0 + 8 (w ZD + q)
  const unsigned info_full0 = zbar0 + 8 * NZ;
  const unsigned info0 = sbase + C::INFO_OFFSET;
  const unsigned dhb = sbase + C::DH_OFFSET;
  const int tid = threadIdx.x;

  const int tiles_n = (N + BN - 1) / BN;
  const int mt_total = __ldg(tile_offsets + num_experts);
  const int total = mt_total * tiles_n;
  const int num_kt = (Kd + BK - 1) / BK;
  const long long zup = p.up ? p.up : N;  // z's and dz's up half

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < C::STAGES; ++s) {
      sm90::mbar_init(full0 + 8 * s, 32 * NCW + 1);       // the copy warps' lanes + the TMA expect_tx
      // one arrival a consumer warp; WIDE: a consumer thread (each reads its A rows by ldmatrix)
      sm90::mbar_init(empty0 + 8 * s, (WIDE ? 128 : 4) * sm90::CONSUMER_WGS);
    }
    // every thread arrives for itself (not one lane a warp after __syncwarp), so each one's own shared-memory
    // accesses are ordered by its release-arrive and the other side's acquire-wait
    sm90::mbar_init(dh_full, 128 * sm90::CONSUMER_WGS);  // each consumer thread wrote its part of dh'
    sm90::mbar_init(dh_empty, 32 * EW);                   // each epilogue thread read its part
#pragma unroll
    for (int i = 0; i < NZ; ++i) sm90::mbar_init(zbar0 + 8 * i, 32);  // each lane's copies (cp.async arrive)
#pragma unroll
    for (int i = 0; i < sm90::INFO_SLOTS; ++i) sm90::mbar_init(info_full0 + 8 * i, 1);
  }
  __syncthreads();
  const bool consumer = tid >= 128 && tid < 384;

  // setmaxnreg by each warpgroup as one, at the head of its role's branch (so that ptxas allocates the role's code
  // under it): the consumers' accumulators and A registers, the others' copies and epilogue rows
  if (!consumer) {
  if constexpr (WIDE) sm90::setmaxnreg_dec<80>();
  if (tid < 32 * NCW) {
    // ================================ copy warps ================================
    // A: lane l of copy warp c copies 16-byte chunk l % 8 of rows l / 8 + 4 i (i in [RW c, RW (c + 1)), RW = 32 /
    // NCW), whose swizzled chunk position alternates between two values with i (row % 8 = l / 8 + 4 (i % 2)). B:
    // thread 0, by TMA.
    constexpr int RW = BM / 4 / NCW;
    const int cc = tid & 7, r0 = ((tid & 31) >> 3) + 4 * RW * (tid >> 5);
    const unsigned a_sw[2] = {static_cast<unsigned>((cc ^ (r0 & 7)) << 4), static_cast<unsigned>((cc ^ ((r0 + 4) & 7)) << 4)};
    if (tid == 0) sm90::tma_prefetch_map(&tmap_b);
    int stage = 0, it = 0;
    unsigned phase = 0;
    int li = 0;
    for (int v = static_cast<int>(blockIdx.x); v < total; v += static_cast<int>(gridDim.x), ++li) {
      const sm90::MTile mt = sm90::m_tile(v, tiles_n, mt_total, tile_offsets, offsets, num_experts);
      const int e = mt.e, m0 = mt.m0, m_end = mt.m_end, tn = mt.tn;
      const int n0 = tn * BN;
      if (tid == 0) {
        // slot li % INFO_SLOTS was last read (by the consumers and the epilogue warps) for tile li - INFO_SLOTS: the
        // consumers have released that tile's k-tiles and written the dh' of the tile after it, which the epilogue
        // warps waited for before they read the next slot
        sm90::post_tile(info0, info_full0, li, make_uint4(static_cast<unsigned>(e), static_cast<unsigned>(m0),
                                                          static_cast<unsigned>(m_end), static_cast<unsigned>(tn)));
      }
      const char* a_src[RW];
      const unsigned a_ok = sm90::row_sources(a_src, A, lda, slot_token, true, true, m0 + r0, 4, m_end, cc * EPC);
      for (int kt = 0; kt < num_kt; ++kt, ++it) {
        if (it >= C::STAGES) sm90::mbar_wait(empty0 + 8 * stage, phase ^ 1u);
        if (tid == 0) BLZ_TIMELINE_MARK(blz_dh_timeline[0][it], it);
        const unsigned as = sbase + stage * C::STAGE_BYTES, bs = as + C::A_BYTES;
        const int k0 = kt * BK;
        const unsigned kb = static_cast<unsigned>(k0) * sizeof(T);
        if (m0 + BM <= m_end && k0 + BK <= Kd) {
#pragma unroll
          for (int i = 0; i < RW; ++i)
            sm90::cp_async16_plain(as + (r0 + 4 * i) * sm90::ROW_BYTES + a_sw[i & 1], a_src[i] + kb);
        } else {
          const bool kok = k0 + cc * EPC < Kd;
#pragma unroll
          for (int i = 0; i < RW; ++i) {
            const bool ok = kok && ((a_ok >> i) & 1u);
            sm90::cp_async16_s(as + (r0 + 4 * i) * sm90::ROW_BYTES + a_sw[i & 1],
                               ok ? a_src[i] + kb : reinterpret_cast<const char*>(A), ok ? 16 : 0);
          }
        }
        if (tid == 0) {
          const unsigned bar = full0 + 8 * stage;
          sm90::mbar_arrive_expect_tx(bar, C::B_BYTES / (BLZ_PROBE_HALF_B ? 2 : 1));
          if constexpr (B_KMAJOR) {
            constexpr int HALF = BN / 2;  // rows a box
            sm90::tma_load_4d(bs, &tmap_b, bar, k0, n0, 0, e);
            if (!BLZ_PROBE_HALF_B) sm90::tma_load_4d(bs + HALF * sm90::ROW_BYTES, &tmap_b, bar, k0, n0 + HALF, 0, e);
          } else {
#pragma unroll
            for (int a = 0; a < BN / 64 / (BLZ_PROBE_HALF_B ? 2 : 1); ++a)
              sm90::tma_load_3d(bs + a * C::B_ATOM, &tmap_b, bar, n0 + 64 * a, k0, e);
          }
        }
        sm90::cp_async_arrive_noinc(full0 + 8 * stage);
        if (tid == 0) BLZ_TIMELINE_MARK(blz_dh_timeline[1][it], it);
        if (++stage == C::STAGES) {
          stage = 0;
          phase ^= 1u;
        }
      }
    }
    if (tid == 0) {
      sm90::post_tile(info0, info_full0, li, make_uint4(~0u, 0u, 0u, 0u));
    }
    sm90::cp_async_wait_all();
  } else {
    // ================================ epilogue warps ================================
    // Warp w (0..EW-1: warps 1..3 of the first warpgroup, WIDE also the fourth warpgroup's) takes the tile rows
    // r = w + EW j (j < EJ), lane l the columns [8 l, 8 l + 8); z rows come ZD ahead, each lane's two 16-byte chunks
    // by cp.async, on the warp's slot barriers; fq / cq count the rows the warp fetched / consumed over all its
    // tiles, which picks the slot and its barrier's phase.
    constexpr int EJ = (BM + EW - 1) / EW;              // rows a warp (at most)
    constexpr int RS = WIDE ? 1 : BLZ_DH_ROWS;          // rows a step (WIDE: one, the next row's z in flight)
    static_assert(RS >= 1 && RS <= ZD && EJ <= 64, "a step's rows are in flight together; the gates in two lanes");
    const int w = tid < 128 ? (tid >> 5) - NCW : (tid >> 5) - 12 + 4 - NCW, lane = tid & 31;
    const unsigned zw = sbase + C::Z_OFFSET + static_cast<unsigned>(w * ZD * C::Z_SLOT);
    unsigned fq = 0, cq = 0;
    for (int li = 0;; ++li) {
      sm90::mbar_wait(info_full0 + 8 * (li % sm90::INFO_SLOTS), static_cast<unsigned>(li / sm90::INFO_SLOTS) & 1u);
      const uint4 ti = sm90::ld_shared_v4(info0 + 16 * (li % sm90::INFO_SLOTS));
      if (ti.x == ~0u) break;
      const int m0 = static_cast<int>(ti.y), m_end = static_cast<int>(ti.z), tn = static_cast<int>(ti.w);
      const int n0 = tn * BN;
      const int nj = min(EJ, max(0, (min(BM, m_end - m0) - w + EW - 1) / EW));  // this warp's rows in the expert
      const int nc = n0 + EPC * lane;
      const bool cok = nc < N;  // the slot holds no z past N (dh' is 0 there)
      // the lane's chunk of the next z row to fetch (the rows come in order, EW apart); interleaved: its two chunks
      // from 2 nc
      const long long zc = IL ? 2LL * nc : nc;
      const T* zf = aux + (long long)(m0 + w) * ldaux + zc;
      const long long zf_step = (long long)EW * ldaux;
      // z is read once and dz, g * hcur written once here: their lines go first from L2, before the reused w2 tiles
      // and the gathered dy rows (dh' 0.5-3% faster on olmoe, qwen3, fine and mixtral, docs/sm90_kernels.md)
      const unsigned long long zpol = sm90::l2_evict_first_policy();
      auto fetch = [&]() {
        // each lane copies its own two chunks, which only it reads: its last reads of them are in registers already
        const unsigned slot = fq % ZD;
        const unsigned dst = zw + slot * C::Z_SLOT + lane * 16;
        if (cok) {
          sm90::cp_async16_hint(dst, zf, zpol);
          if constexpr (G2) sm90::cp_async16_hint(dst + C::DH_ROW, IL ? zf + EPC : zf + zup, zpol);
        }
        sm90::cp_async_arrive_noinc(zbar0 + 8 * (w * ZD + slot));
        zf += zf_step;
        ++fq;
      };
      if (BLZ_PROBE_EPI != 2) {
        for (int j = 0; j < min(ZD, nj); ++j) fetch();
      }
      // the rows' gates: lane l holds those of rows j = l and j = 32 + l
      float g0 = 0.f, g1 = 0.f;
      if (lane < nj) g0 = slot_gate(gates, slot_token, slot_k, topk, m0 + w + EW * lane);
      if (32 + lane < nj) g1 = slot_gate(gates, slot_token, slot_k, topk, m0 + w + EW * (32 + lane));
      // R rows a step (R = RS, or 1 for the last nj % RS): their z waits first, then their loads, arithmetic, stores
      // and dgates butterflies side by side, so the rows' dependent chains overlap. dz_row / hg_row: the lane's
      // columns of the step's first row in dz and g * hcur, advanced by EW rows a row.
      const long long dz_step = (long long)EW * ldo, hg_step = (long long)EW * ldo2;
      T* dz_row = out + (long long)(m0 + w) * ldo + zc;
      T* hg_row = out2 + (long long)(m0 + w) * ldo2 + nc;
      auto step = [&](int j, auto rows) {
        constexpr int R = decltype(rows)::value;
        unsigned zs[R];
#pragma unroll
        for (int q = 0; q < R; ++q) {
          const unsigned slot = cq % ZD;
          sm90::mbar_wait(zbar0 + 8 * (w * ZD + slot), (cq / ZD) & 1u);
          ++cq;
          zs[q] = zw + slot * C::Z_SLOT + lane * 16;
        }
        unsigned da[R][4], db[R][4], hg[R][4];
        float ps[R];
#pragma unroll
        for (int q = 0; q < R; ++q) {
          const int jq = j + q, r = w + EW * jq;
          const float gs = __shfl_sync(0xffffffffu, jq < 32 ? g0 : g1, jq & 31);
          const uint4 dv = sm90::ld_shared_v4(dhb + static_cast<unsigned>(r * C::DH_ROW + ((lane ^ (r & 7)) << 4)));
          const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
          const uint4 av = cok ? sm90::ld_shared_v4(zs[q]) : zero;
          const uint4 bv = (G2 && cok) ? sm90::ld_shared_v4(zs[q] + C::DH_ROW) : zero;
          const unsigned dw[4] = {dv.x, dv.y, dv.z, dv.w}, aw[4] = {av.x, av.y, av.z, av.w};
          const unsigned bw[4] = {bv.x, bv.y, bv.z, bv.w};
          ps[q] = 0.f;
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const float2 d = sm90::unpack2<T>(dw[u]);
            if constexpr (IL) {
              // columns 2 u, 2 u + 1: words 2 u, 2 u + 1 of the lane's 8 ([gate, up] each); dz's words alike, the
              // first four in da, the others in db
              const unsigned w0 = u < 2 ? aw[2 * u] : bw[2 * u - 4], w1 = u < 2 ? aw[2 * u + 1] : bw[2 * u - 3];
              const float2 p0 = sm90::unpack2<T>(w0), p1 = sm90::unpack2<T>(w1);
              const DhcurPair o = dhcur_math<ACT>(p0.x, p1.x, p0.y, p1.y, d.x, d.y, gs);
              unsigned* dzw = u < 2 ? &da[q][2 * u] : &db[q][2 * u - 4];
              dzw[0] = sm90::pack2<T>(o.da0, o.db0);
              dzw[1] = sm90::pack2<T>(o.da1, o.db1);
              hg[q][u] = sm90::pack2<T>(o.hg0, o.hg1);
              ps[q] += o.p;
            } else {
              const float2 a = sm90::unpack2<T>(aw[u]), b = G2 ? sm90::unpack2<T>(bw[u]) : make_float2(0.f, 0.f);
              const DhcurPair o = dhcur_math<ACT>(a.x, a.y, b.x, b.y, d.x, d.y, gs);
              da[q][u] = sm90::pack2<T>(o.da0, o.da1);
              db[q][u] = sm90::pack2<T>(o.db0, o.db1);
              hg[q][u] = sm90::pack2<T>(o.hg0, o.hg1);
              ps[q] += o.p;
            }
          }
        }
        // the step's z values are in registers: refill its slots before the stores
#pragma unroll
        for (int q = 0; q < R; ++q) {
          if (j + q + ZD < nj) fetch();  // row j + q + ZD
        }
        if (cok && !BLZ_PROBE_EPI) {
#pragma unroll
          for (int q = 0; q < R; ++q) {
            T* dzr = dz_row + q * dz_step;
            sm90::st_global_v4_hint(dzr, make_uint4(da[q][0], da[q][1], da[q][2], da[q][3]), zpol);
            if constexpr (G2)
              sm90::st_global_v4_hint(IL ? dzr + EPC : dzr + zup, make_uint4(db[q][0], db[q][1], db[q][2], db[q][3]), zpol);
            sm90::st_global_v4_hint(hg_row + q * hg_step, make_uint4(hg[q][0], hg[q][1], hg[q][2], hg[q][3]), zpol);
          }
        }
        dz_row += R * dz_step;
        hg_row += R * hg_step;
        if constexpr (R == 2) {
          // one butterfly for both rows: after the first exchange lanes 0-15 hold row j's pair sums and lanes 16-31
          // row j + 1's (each lane's own value first, as in a butterfly of its own, so the sums have the same bits)
          const bool hi = (lane & 16) != 0;
          float v = (hi ? ps[1] : ps[0]) + __shfl_xor_sync(0xffffffffu, hi ? ps[0] : ps[1], 16);
#pragma unroll
          for (int m = 8; m >= 1; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
          if ((lane & 15) == 0) part[(long long)(m0 + w + EW * (j + (hi ? 1 : 0))) * part_ld + tn] = v;
        } else {
#pragma unroll
          for (int m = 16; m >= 1; m >>= 1) {
#pragma unroll
            for (int q = 0; q < R; ++q) ps[q] += __shfl_xor_sync(0xffffffffu, ps[q], m);
          }
          if (lane == 0) {
#pragma unroll
            for (int q = 0; q < R; ++q) part[(long long)(m0 + w + EW * (j + q)) * part_ld + tn] = ps[q];
          }
        }
      };
      sm90::mbar_wait(dh_full, static_cast<unsigned>(li) & 1u);
      if (w == 0 && lane == 0) BLZ_TIMELINE_MARK(blz_dh_timeline[5][li], li);
      if (BLZ_PROBE_EPI != 2) {
        int j = 0;
        for (; j + RS <= nj; j += RS) step(j, sm90::IntC<RS>());
        for (; j < nj; ++j) step(j, sm90::IntC<1>());
      }
      sm90::mbar_arrive(dh_empty);  // this thread's part of dh' is read: the consumers may rewrite it
      if (w == 0 && lane == 0) BLZ_TIMELINE_MARK(blz_dh_timeline[6][li], li);
    }
  }
  } else {
    // ================================ consumer warpgroups ================================
    if constexpr (WIDE) sm90::setmaxnreg_inc<176>();
    const int cw = (tid >> 7) - 1;
    const int t = tid & 127;
    const unsigned long long da0 = sm90::make_desc(sbase + cw * 64 * sm90::ROW_BYTES, 16, 1024);
    const unsigned long long db0 = B_KMAJOR ? sm90::make_desc(sbase + C::A_BYTES, 16, 1024)
                                            : sm90::make_desc(sbase + C::A_BYTES, C::B_ATOM, 1024);
    constexpr unsigned B_KSTEP = B_KMAJOR ? (16 * 2) >> 4 : (16 * sm90::ROW_BYTES) >> 4;
    int stage = 0;
    unsigned phase = 0;
    // the tile's accumulators; the WIDE form's two m64n128 wgmmas a k16 step write its halves, registers 0..63
    // (columns [0, 128)) and 64..127 (columns [128, 256)), which is the m64n256 fragment's layout
    float acc[BN / 2];
    float (&acc_lo)[BN / 4] = *reinterpret_cast<float (*)[BN / 4]>(&acc[0]);
    float (&acc_hi)[BN / 4] = *reinterpret_cast<float (*)[BN / 4]>(&acc[BN / 4]);
    // WIDE: this lane's ldmatrix.x4 row (block q = lane / 8: rows + 8 (q % 2), k chunk + q / 2) in the A tile
    const int lane = t & 31, a_q = lane >> 3, a_r = lane & 7;
    const unsigned a_row_off = static_cast<unsigned>((cw * 64 + (t >> 5) * 16 + (a_q & 1) * 8 + a_r) * sm90::ROW_BYTES);
    constexpr unsigned B_HALF = (16 * 1024) >> 4;  // the B tile's columns [128, 256): 2 atoms / 128 rows on, encoded
    unsigned af[BK / 16][4];                       // WIDE: the k-tile's A registers
    int cit = 0;                                   // k-tiles consumed over the CTA's tiles (BLZ_PROBE_TIMELINE)
    // WIDE: the k-tile's A fragments by ldmatrix after its stage's wait (consumer_mainloop's prep step), then two
    // m64n128k16 a k16 step on the B tile's column halves; INFLIGHT 0: the k-tile's wgmmas are done before its A
    // registers are rewritten (the other warpgroup's keep the tensor cores busy meanwhile; two register sets, one
    // k-tile in flight, need more registers than the 176 the consumers have: ptxas serializes the wgmmas), and every
    // consumer thread releases the stage it read itself
    auto wide_prep = [&](unsigned long long soff, int) {
      if (tid == 128) BLZ_TIMELINE_MARK(blz_dh_timeline[2][cit], cit);
      ++cit;
      const unsigned st = sbase + (static_cast<unsigned>(soff) << 4) + a_row_off;
#pragma unroll
      for (int ks = 0; ks < BK / 16; ++ks) sm90::ldmatrix_x4_s(af[ks], st + (((2 * ks + (a_q >> 1)) ^ a_r) << 4));
    };
    auto wide_issue = [&](unsigned long long soff, int kt) {
#pragma unroll
      for (int ks = 0; ks < BK / 16; ++ks) {
        const unsigned long long db = db0 + soff + ks * B_KSTEP;
        sm90::WgmmaRs<BN / 2, T>::template mma<B_KMAJOR ? 0 : 1>(acc_lo, af[ks], db, (kt | ks) != 0);
        sm90::WgmmaRs<BN / 2, T>::template mma<B_KMAJOR ? 0 : 1>(acc_hi, af[ks], db + B_HALF, (kt | ks) != 0);
      }
    };
    for (int li = 0;; ++li) {
      sm90::mbar_wait(info_full0 + 8 * (li % sm90::INFO_SLOTS), static_cast<unsigned>(li / sm90::INFO_SLOTS) & 1u);
      const uint4 ti = sm90::ld_shared_v4(info0 + 16 * (li % sm90::INFO_SLOTS));
      if (ti.x == ~0u) break;
      auto issue = [&](unsigned long long soff, int kt) {
        if (tid == 128) BLZ_TIMELINE_MARK(blz_dh_timeline[2][cit], cit);
        ++cit;
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks)
          sm90::Wgmma<BN, T>::template mma<B_KMAJOR ? 0 : 1>(acc, da0 + soff + ks * 2, db0 + soff + ks * B_KSTEP,
                                                              (kt | ks) != 0);
      };
      if constexpr (WIDE) {
        // A through ldmatrix and B by TMA: no generic-proxy writes the wgmmas read
        sm90::consumer_mainloop<C::STAGES, BN / 2, decltype(wide_issue)&, 0, decltype(wide_prep)&, false>(
            acc, full0, empty0, num_kt, t, C::STAGE_BYTES, stage, phase, wide_issue, /*keep_acc=*/true, wide_prep);
      } else {
        sm90::consumer_mainloop<C::STAGES, BN / 2, decltype(issue)&, 1, sm90::NoPrep, true>(
            acc, full0, empty0, num_kt, t, C::STAGE_BYTES, stage, phase, issue, /*keep_acc=*/true);
      }
      // dh' to shared memory once the producer has read the previous tile's
      if (tid == 128) BLZ_TIMELINE_MARK(blz_dh_timeline[3][li], li);
      if (li > 0) sm90::mbar_wait(dh_empty, static_cast<unsigned>(li - 1) & 1u);
      if (tid == 128) BLZ_TIMELINE_MARK(blz_dh_timeline[4][li], li);
      const int rr = cw * 64 + sm90::acc_row(0, t), c0 = sm90::acc_col(0, t);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int R = rr + 8 * h;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          const int i = sm90::acc_reg(j, h);
          sm90::st_shared_u32(dhb + static_cast<unsigned>(R * C::DH_ROW + ((j ^ (R & 7)) << 4) + (c0 & 7) * 2),
                              sm90::pack2<T>(acc[i], acc[i + 1]));
        }
      }
      sm90::mbar_arrive(dh_full);
    }
  }
#else
  // Built for another target: this kernel needs sm_90a (wgmma); launch moe_gemm instead.
  __trap();
#endif
}

}  // namespace blz
