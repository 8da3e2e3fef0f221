// Expert GEMMs on mma.sync (sm_80 and later, every dtype): grouped GEMMs with gathered operands and fused
// epilogues. The small kernels beside them (tile offsets, combine, dgates, bias gradients, token blocks) are
// in moe_helpers.cu; the sm_90a wgmma kernels in moe_gemm_sm90.cu and moe_wgrad_sm90.cu.
//
// One templated tensor-core GEMM serves every expert matmul of the layer:
//   M-grouped (MODE_M): C[s, n] = sum_k A[row(s), k] * B_e[n, k] over each expert's slot range; the A rows
//     are gathered through slot_token on the fly (x in the forward, dy in the backward), so no L*K x d
//     copy of x or dy ever exists. Tiles per expert come from expert_offsets on the device (no host sync).
//   K-grouped (MODE_K): W_e[m, n] = sum_{s in e} A[row(s), m] * B[row(s), n], reducing over the expert's
//     slots in a fixed order (deterministic weight gradients).
// Operands are staged into shared memory with 16-byte cp.async in a 4-stage pipeline; fragments are
// loaded with ldmatrix (.trans for operands stored m/n-contiguous) and multiplied with mma.sync m16n8k16
// (fp32 accumulators). The fp32 instantiation (tests) uses the same tiles and fragment ownership with
// FMA instead of mma, so every epilogue is shared.
#include "moe_common.cuh"

namespace blz {

constexpr int NTHREADS = 256;  // 8 warps: 2 (m) x 4 (n), warp tile 64 x 32
constexpr int BM = 128, BN = 128, WARPS_M = 2, WARPS_N = 4;
constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;  // 64 x 32
constexpr int MF = WM / 16, NF = WN / 8;             // 4 x 4 fragments
constexpr int STAGES = 4;

template <typename T> struct Tile {
  static constexpr int EPC = 16 / sizeof(T);  // elements per 16-byte chunk
  static constexpr int BK = 64 / sizeof(T);   // 32 for 16-bit types: 64-byte rows
  static constexpr int PAD = EPC;             // +16 bytes per row: conflict-free ldmatrix
};

template <typename T, bool KMAJOR, int ROWS> __host__ __device__ constexpr int tile_elems() {
  // KMAJOR: [ROWS][BK + PAD]; otherwise [BK][ROWS + PAD]
  return KMAJOR ? ROWS * (Tile<T>::BK + Tile<T>::PAD) : Tile<T>::BK * (ROWS + Tile<T>::PAD);
}

// Arguments: MGroupedArgs<T> (MODE_M) or KGroupedArgs<T> (MODE_K), moe_args.cuh.
template <typename T, int MODE, bool A_KMAJOR, bool B_KMAJOR, int EPI, int ACT, bool A_GATHER, bool B_GATHER>
__global__ void __launch_bounds__(NTHREADS) moe_gemm(const typename GemmArgsFor<MODE, T>::type p) {
  // the fields of both families under one set of names (the other family's read as 0 / null)
  const T* __restrict__ A = p.A;
  const T* __restrict__ B = p.B;
  const int* __restrict__ slot_token = p.slot_token;
  const int* __restrict__ offsets = p.offsets;
  const long long lda = p.lda, ldb = p.ldb;
  const int num_experts = p.num_experts, N = p.N;
  T* out = p.out;  // MODE_M: out and aux may alias (EPI_DHCUR writes dz over z)
  const long long ldo = p.ldo;
  const int* __restrict__ slot_k = nullptr;
  const int* __restrict__ tile_offsets = nullptr;
  const int* __restrict__ kblocks = nullptr;
  const T* __restrict__ bias = nullptr;
  const T* aux = nullptr;
  T* __restrict__ out2 = nullptr;
  const float* __restrict__ gates = nullptr;
  float* __restrict__ part = nullptr;
  float* __restrict__ carry = nullptr;
  const int* __restrict__ carry_seen = nullptr;
  long long b_estride = 0, o_estride = 0, ldo2 = 0, ldaux = 0, bias_estride = 0, up = 0;
  int M = 0, Kd = 0, topk = 1, part_ld = 0, num_kblocks = 0;
  bool store_h = false, store_z = false, carry_in_asked = false, carry_out = false;
  if constexpr (MODE == MODE_M) {
    slot_k = p.slot_k;
    tile_offsets = p.tile_offsets;
    bias = p.bias;
    aux = p.aux;
    out2 = p.out2;
    gates = p.gates;
    part = p.part;
    b_estride = p.b_estride;
    ldo2 = p.ldo2;
    ldaux = p.ldaux;
    bias_estride = p.bias_estride;
    up = p.up;
    Kd = p.Kd;
    topk = p.topk;
    part_ld = p.part_ld;
    store_h = p.store_h != 0;
    store_z = p.store_z != 0;
  } else {
    kblocks = p.kblocks;
    carry = p.carry;
    carry_seen = p.carry_seen;
    o_estride = p.o_estride;
    M = p.M;
    num_kblocks = p.num_kblocks;
    carry_in_asked = p.carry_in != 0;
    carry_out = p.carry_out != 0;
  }
  using TL = Tile<T>;
  constexpr int BK = TL::BK, EPC = TL::EPC, PAD = TL::PAD;
  constexpr int AB = act_base(ACT);             // the activation; ACT may carry ACT_INTERLEAVED
  constexpr bool IL = act_interleaved(ACT);
  static_assert(!IL || (act_gated(AB) && (EPI == EPI_ACT || EPI == EPI_DHCUR)), "interleaving is for gated z");
  // GATED: a tile takes BN/2 gate rows and the BN/2 matching up rows of B; interleaved gemm1 tiles take BN
  // consecutive rows instead (BN/2 (gate, up) pairs). Both yield BN/2 output columns per tile.
  constexpr bool GATED = (EPI == EPI_ACT) && act_gated(AB) && !IL;
  constexpr bool HALF_N = (EPI == EPI_ACT) && act_gated(AB);
  constexpr int A_ELEMS = tile_elems<T, A_KMAJOR, BM>();
  constexpr int B_ELEMS = tile_elems<T, B_KMAJOR, BN>();
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* As = reinterpret_cast<T*>(smem_raw);
  T* Bs = As + STAGES * A_ELEMS;
  __shared__ float red[BM * WARPS_N];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N;
  const int g = lane >> 2, q = lane & 3;

  // ---- which tile ---------------------------------------------------------------------------------
  int e, m0, m_end, tn, slot_lo = 0, slot_hi = 0, tm = 0;
  const int tiles_n = HALF_N ? (N + BN / 2 - 1) / (BN / 2) : (N + BN - 1) / BN;
  const int NB = (HALF_N && IL) ? 2 * N : N;  // bound of B's output-column index n of a plain tile
  // gated EPI_ACT: where B's (and the bias') up half starts; a launch over a column slice of h passes h
  const long long bup = (GATED && up) ? up : N;
  if constexpr (MODE == MODE_M) {
    const long long bid = blockIdx.x;
    const int tmg = static_cast<int>(bid / tiles_n);
    tn = static_cast<int>(bid % tiles_n);
    if (tmg >= __ldg(tile_offsets + num_experts)) return;  // surplus tile of the upper-bound grid
    e = find_expert(tile_offsets, num_experts, tmg);
    m0 = __ldg(offsets + e) + (tmg - __ldg(tile_offsets + e)) * BM;
    m_end = __ldg(offsets + e + 1);
  } else {
    const int tiles_m = (M + BM - 1) / BM;
    const long long bid = blockIdx.x;
    e = static_cast<int>(bid / ((long long)tiles_m * tiles_n));
    const int r = static_cast<int>(bid % ((long long)tiles_m * tiles_n));
    tm = r / tiles_n;
    tn = r % tiles_n;
    m0 = tm * BM;
    m_end = M;
    slot_lo = __ldg(offsets + e);
    slot_hi = __ldg(offsets + e + 1);
  }
  const int num_kt = (MODE == MODE_M) ? (Kd + BK - 1) / BK
                                      : ktile_count<BK>(kblocks, e, num_kblocks, slot_lo, slot_hi);
  // MODE_K: the reduction tiles, in order; load_stage is called once per k-tile in increasing kt
  KTileWalk<BK> kwalk(kblocks, e, MODE == MODE_K ? num_kblocks : 0, slot_lo, slot_hi);

  // ---- producer: one pipeline stage ----------------------------------------------------------------
  const T* Be = B + ((MODE == MODE_M) ? (long long)e * b_estride : 0);
  auto load_stage = [&](int stage, int kt) {
    const int k0 = kt * BK;
    T* as = As + stage * A_ELEMS;
    T* bs = Bs + stage * B_ELEMS;
    if constexpr (MODE == MODE_M) {
      // A: [BM rows = slots][BK], rows gathered through slot_token
      constexpr int CPR = BK / EPC, CH = BM * CPR;
#pragma unroll
      for (int c = tid; c < CH; c += NTHREADS) {
        const int r = c / CPR, cc = c % CPR;
        const int s = m0 + r, k = k0 + cc * EPC;
        const bool ok = (s < m_end) && (k < Kd);
        const long long row = ok ? (A_GATHER ? (long long)__ldg(slot_token + s) : (long long)s) : 0;
        cp_async16(as + r * (BK + PAD) + cc * EPC, A + row * lda + (ok ? k : 0), ok ? 16 : 0);
      }
      if constexpr (B_KMAJOR) {
        // B: [BN rows = output cols][BK]; gated tiles take BN/2 gate rows and the matching BN/2 up rows
#pragma unroll
        for (int c = tid; c < BN * CPR; c += NTHREADS) {
          const int r = c / CPR, cc = c % CPR;
          int n, row;
          if constexpr (GATED) {
            const int rr = r % (BN / 2);
            n = tn * (BN / 2) + rr;
            row = (r < BN / 2) ? n : static_cast<int>(bup) + n;
          } else {
            n = tn * BN + r;
            row = n;
          }
          const int k = k0 + cc * EPC;
          const bool ok = (n < NB) && (k < Kd);
          cp_async16(bs + r * (BK + PAD) + cc * EPC, Be + (ok ? (long long)row * ldb + k : 0), ok ? 16 : 0);
        }
      } else {
        // B: [BK rows = k][BN], weights stored k-major rows (n contiguous)
        constexpr int CPRB = BN / EPC;
#pragma unroll
        for (int c = tid; c < BK * CPRB; c += NTHREADS) {
          const int r = c / CPRB, cc = c % CPRB;
          const int k = k0 + r;
          int n, col;
          if constexpr (GATED) {  // columns [0, BN/2) of the tile from the gate half, the rest from the up half
            const int cw = cc * EPC;
            n = tn * (BN / 2) + cw % (BN / 2);
            col = (cw < BN / 2) ? n : static_cast<int>(bup) + n;
          } else {
            n = tn * BN + cc * EPC;
            col = n;
          }
          const bool ok = (k < Kd) && (n < NB);
          cp_async16(bs + r * (BN + PAD) + cc * EPC, Be + (ok ? (long long)k * ldb + col : 0), ok ? 16 : 0);
        }
      }
    } else {
      // MODE_K: rows are the slots of the current reduction tile [t0, tend), gathered for x / dy
      constexpr int CPRA = BM / EPC, CPRB = BN / EPC;
      const int t0 = kwalk.t0, tend = kwalk.end();
      kwalk.next();
#pragma unroll
      for (int c = tid; c < BK * CPRA; c += NTHREADS) {
        const int r = c / CPRA, cc = c % CPRA;
        const int s = t0 + r, m = m0 + cc * EPC;
        const bool ok = (s < tend) && (m < M);
        const long long row = ok ? (A_GATHER ? (long long)__ldg(slot_token + s) : (long long)s) : 0;
        cp_async16(as + r * (BM + PAD) + cc * EPC, A + row * lda + (ok ? m : 0), ok ? 16 : 0);
      }
#pragma unroll
      for (int c = tid; c < BK * CPRB; c += NTHREADS) {
        const int r = c / CPRB, cc = c % CPRB;
        const int s = t0 + r, n = tn * BN + cc * EPC;
        const bool ok = (s < tend) && (n < N);
        const long long row = ok ? (B_GATHER ? (long long)__ldg(slot_token + s) : (long long)s) : 0;
        cp_async16(bs + r * (BN + PAD) + cc * EPC, B + row * ldb + (ok ? n : 0), ok ? 16 : 0);
      }
    }
  };

  // Shared-memory row of B fragment f of this warp (gated: first NF/2 fragments gate rows, rest up rows).
  auto b_row = [&](int f) -> int {
    if constexpr (GATED) {
      return (f < NF / 2) ? wn * (WN / 2) + f * 8 : BN / 2 + wn * (WN / 2) + (f - NF / 2) * 8;
    } else {
      return wn * WN + f * 8;
    }
  };

  float acc[MF][NF][4];
#pragma unroll
  for (int i = 0; i < MF; ++i)
#pragma unroll
    for (int j = 0; j < NF; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;
  // K-grouped with carry_in: continue the partial sums an earlier launch left in carry (chunked execution)
  constexpr int ACC_N = MF * NF * 4;
  const bool carry_in = MODE == MODE_K && carry_in_asked && (carry_seen == nullptr || __ldg(carry_seen + e));
  if (carry_in) {
    const float* cb = carry + (long long)blockIdx.x * ACC_N * NTHREADS + tid;
#pragma unroll
    for (int i = 0; i < MF; ++i)
#pragma unroll
      for (int j = 0; j < NF; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[i][j][v] = cb[((i * NF + j) * 4 + v) * NTHREADS];
  }

  // ---- mainloop ------------------------------------------------------------------------------------
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_kt) load_stage(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < num_kt; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int nk = kt + STAGES - 1;
    if (nk < num_kt) load_stage(nk % STAGES, nk);
    cp_async_commit();
    const T* as = As + (kt % STAGES) * A_ELEMS;
    const T* bs = Bs + (kt % STAGES) * B_ELEMS;
    if constexpr (sizeof(T) == 2) {
      const int j = lane >> 3, l8 = lane & 7;
#pragma unroll
      for (int ks = 0; ks < BK / 16; ++ks) {
        unsigned af[MF][4], bf[NF][2];
#pragma unroll
        for (int i = 0; i < MF; ++i) {
          const int r0 = wm * WM + i * 16;
          if constexpr (A_KMAJOR) {
            ldmatrix_x4(af[i], as + (r0 + (j & 1) * 8 + l8) * (BK + PAD) + ks * 16 + (j >> 1) * 8);
          } else {
            ldmatrix_x4_trans(af[i], as + (ks * 16 + (j >> 1) * 8 + l8) * (BM + PAD) + r0 + (j & 1) * 8);
          }
        }
#pragma unroll
        for (int f = 0; f < NF; f += 2) {
          unsigned r[4];
          const int n0 = b_row(f);
          if constexpr (B_KMAJOR) {
            ldmatrix_x4(r, bs + (n0 + (j >> 1) * 8 + l8) * (BK + PAD) + ks * 16 + (j & 1) * 8);
          } else {
            ldmatrix_x4_trans(r, bs + (ks * 16 + (j & 1) * 8 + l8) * (BN + PAD) + n0 + (j >> 1) * 8);
          }
          bf[f][0] = r[0]; bf[f][1] = r[1]; bf[f + 1][0] = r[2]; bf[f + 1][1] = r[3];
        }
#pragma unroll
        for (int i = 0; i < MF; ++i)
#pragma unroll
          for (int f = 0; f < NF; ++f) mma16816<T>(acc[i][f], af[i], bf[f]);
      }
    } else {
      // fp32 (test path): same fragment ownership as mma m16n8: rows g, g+8; cols 2q, 2q+1
#pragma unroll 4
      for (int kk = 0; kk < BK; ++kk) {
        float av[MF][2], bv[NF][2];
#pragma unroll
        for (int i = 0; i < MF; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int m = wm * WM + i * 16 + g + 8 * h;
            av[i][h] = A_KMAJOR ? as[m * (BK + PAD) + kk] : as[kk * (BM + PAD) + m];
          }
#pragma unroll
        for (int f = 0; f < NF; ++f)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int n = b_row(f) + 2 * q + h;
            bv[f][h] = B_KMAJOR ? bs[n * (BK + PAD) + kk] : bs[kk * (BN + PAD) + n];
          }
#pragma unroll
        for (int i = 0; i < MF; ++i)
#pragma unroll
          for (int f = 0; f < NF; ++f) {
            acc[i][f][0] = fmaf(av[i][0], bv[f][0], acc[i][f][0]);
            acc[i][f][1] = fmaf(av[i][0], bv[f][1], acc[i][f][1]);
            acc[i][f][2] = fmaf(av[i][1], bv[f][0], acc[i][f][2]);
            acc[i][f][3] = fmaf(av[i][1], bv[f][1], acc[i][f][3]);
          }
      }
    }
  }
  cp_async_wait<0>();

  // ---- epilogues -----------------------------------------------------------------------------------
  if constexpr (EPI == EPI_WGRAD) {
    if (carry_out) {  // partial sums for a later launch, in this CTA's private fp32 slice of carry
      float* cb = carry + (long long)blockIdx.x * ACC_N * NTHREADS + tid;
#pragma unroll
      for (int i = 0; i < MF; ++i)
#pragma unroll
        for (int j = 0; j < NF; ++j)
#pragma unroll
          for (int v = 0; v < 4; ++v) cb[((i * NF + j) * 4 + v) * NTHREADS] = acc[i][j][v];
      return;
    }
    T* oe = out + (long long)e * o_estride;
#pragma unroll
    for (int i = 0; i < MF; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = m0 + wm * WM + i * 16 + g + 8 * h;
        if (m >= M) continue;
#pragma unroll
        for (int f = 0; f < NF; ++f) {
          const int n = tn * BN + wn * WN + f * 8 + 2 * q;
          if (n < N) store2<T>(oe + (long long)m * ldo + n, acc[i][f][2 * h], acc[i][f][2 * h + 1]);
        }
      }
  } else if constexpr (EPI == EPI_ACT) {
    const T* be = bias ? bias + (long long)e * bias_estride : nullptr;
    T* hout = store_h ? out : nullptr;
    T* zout = store_z ? out2 : nullptr;
#pragma unroll
    for (int i = 0; i < MF; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int s = m0 + wm * WM + i * 16 + g + 8 * h;
        if (s >= m_end) continue;
        if constexpr (GATED) {
#pragma unroll
          for (int f = 0; f < NF / 2; ++f) {
            const int n = tn * (BN / 2) + wn * (WN / 2) + f * 8 + 2 * q;
            if (n < N)
              epi_act_gated<T, AB>(be, bup, N, hout, ldo, zout, ldo2, s, n, acc[i][f][2 * h], acc[i][f][2 * h + 1],
                                   acc[i][f + NF / 2][2 * h], acc[i][f + NF / 2][2 * h + 1]);
          }
        } else if constexpr (IL) {
#pragma unroll
          for (int f = 0; f < NF; ++f) {
            const int c = tn * BN + wn * WN + f * 8 + 2 * q;  // z column of the (gate, up) pair
            if (c < NB) epi_act_interleaved<T, AB>(be, hout, ldo, zout, ldo2, s, c, acc[i][f][2 * h],
                                                   acc[i][f][2 * h + 1]);
          }
        } else {
#pragma unroll
          for (int f = 0; f < NF; ++f) {
            const int n = tn * BN + wn * WN + f * 8 + 2 * q;
            if (n < N) epi_act_plain<T, AB>(be, hout, ldo, zout, ldo2, s, n, acc[i][f][2 * h], acc[i][f][2 * h + 1]);
          }
        }
      }
  } else if constexpr (EPI == EPI_ROWSCALE) {
    const T* be = bias ? bias + (long long)e * bias_estride : nullptr;
#pragma unroll
    for (int i = 0; i < MF; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int s = m0 + wm * WM + i * 16 + g + 8 * h;
        if (s >= m_end) continue;
        const float gs = gates ? slot_gate(gates, slot_token, slot_k, topk, s) : 1.f;
#pragma unroll
        for (int f = 0; f < NF; ++f) {
          const int n = tn * BN + wn * WN + f * 8 + 2 * q;
          if (n < N) epi_rowscale<T>(be, out, ldo, s, n, acc[i][f][2 * h], acc[i][f][2 * h + 1], gs);
        }
      }
  } else {  // EPI_DHCUR: acc = dh' = dy_t w2_e  (cols of h); out = dz (may alias aux = z), out2 = g * hcur
    // a nonzero up is the up half's column offset in z / dz (a launch over a column slice of h); 0: N
    const int zup = up ? static_cast<int>(up) : N;
#pragma unroll
    for (int i = 0; i < MF; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rl = wm * WM + i * 16 + g + 8 * h;
        const int s = m0 + rl;
        float psum = 0.f;
        if (s < m_end) {
          const float gs = slot_gate(gates, slot_token, slot_k, topk, s);
#pragma unroll
          for (int f = 0; f < NF; ++f) {
            const int n = tn * BN + wn * WN + f * 8 + 2 * q;
            if (n >= N) continue;
            if constexpr (IL) {
              psum += epi_dhcur_interleaved<T, AB>(aux, ldaux, out, ldo, out2, ldo2, s, n, acc[i][f][2 * h],
                                                   acc[i][f][2 * h + 1], gs);
            } else {
              psum += epi_dhcur<T, AB>(aux, ldaux, zup, out, ldo, out2, ldo2, s, n, acc[i][f][2 * h],
                                       acc[i][f][2 * h + 1], gs);
            }
          }
        }
        // the 4 lanes of a quad share a row: fixed-order butterfly, then a fixed-order sum over warps_n
        psum += __shfl_xor_sync(0xffffffffu, psum, 1);
        psum += __shfl_xor_sync(0xffffffffu, psum, 2);
        if (q == 0) red[rl * WARPS_N + wn] = psum;
      }
    __syncthreads();
    for (int r = tid; r < BM; r += NTHREADS) {
      const int s = m0 + r;
      if (s < m_end) {
        float t = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS_N; ++w) t += red[r * WARPS_N + w];
        part[(long long)s * part_ld + tn] = t;
      }
    }
  }
}

}  // namespace blz
