// Router kernels: scores (softmax or sigmoid over the E experts), top-k selection, gates, the backward,
// and the load-balancing / z-loss terms with their gradients.
//
// Every kernel here is memory-bound: it reads each logit once with all math in fp32 registers, so the
// design goal is one coalesced pass over the (L, E) logits. (The backward of the renormalised softmax and
// of the sigmoid router reads only the K selected logits: their gates do not depend on the others.)
//
// Row groups. A row group of NT = 32 * WARPS threads owns one token row and holds VPT of its elements per
// thread in registers (VPT is a template argument, so the arrays are fully unrolled and never spill).
// For E <= 1024 a group is one warp (WARPS = 1, four rows per 128-thread block) and every reduction is a
// shuffle or a redux.sync; above that a group is the whole 256-thread block (WARPS = 8) and reductions
// pass through shared memory. Register slot j of thread t holds element
//   vectorised (host checks E % V == 0 and V*sizeof(T)-aligned rows):  e = ((j / V) * NT + t) * V + j % V
//   scalar:                                                             e = j * NT + t
// Both put consecutive threads on consecutive addresses, so each warp-wide load is one contiguous segment
// (512 bytes per instruction for the 16-byte vector loads, 64 or 128 for the scalar ones). In both, e
// grows with j inside a thread, which the top-k tie-break below relies on.
//
// bf16 / fp16 travel as raw 16-bit words (a vector of them is one 4-, 8- or 16-byte load) and are widened
// to fp32 right after the load; outputs are rounded to nearest-even once, at the store.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace blz {

constexpr unsigned kFull = 0xffffffffu;
enum RouterScore : int { SCORE_SOFTMAX = 0, SCORE_SIGMOID = 1 };

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// One-warp groups run four to a block: 128 threads is enough to fill an SM with 16 blocks while keeping
// the tail of a small L short. Eight-warp groups run one to a block. The kernels declare
// __launch_bounds__(threads, 1): with the thread count alone ptxas aimed at full occupancy (32 registers)
// and spilled a few bytes in the small variants; with min-blocks 1 none spills (36-128 registers on sm_90a).
__host__ __device__ constexpr int router_groups(int warps) { return warps == 1 ? 4 : 1; }
__host__ __device__ constexpr int router_threads(int warps) { return 32 * warps * router_groups(warps); }

// ---- element access ----------------------------------------------------------------------------------
template <typename T> struct Elem;
template <> struct Elem<float> {
  using Bits = unsigned;
  __device__ static __forceinline__ float widen(unsigned b) { return __uint_as_float(b); }
  __device__ static __forceinline__ unsigned narrow(float f) { return __float_as_uint(f); }
};
template <> struct Elem<__half> {
  using Bits = unsigned short;
  __device__ static __forceinline__ float widen(unsigned b) { return __half2float(__ushort_as_half((unsigned short)b)); }
  __device__ static __forceinline__ unsigned narrow(float f) { return __half_as_ushort(__float2half_rn(f)); }
};
template <> struct Elem<__nv_bfloat16> {
  using Bits = unsigned short;
  // bf16 is the top half of an fp32: widening is a shift, exact.
  __device__ static __forceinline__ float widen(unsigned b) { return __uint_as_float(b << 16); }
  __device__ static __forceinline__ unsigned narrow(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
};

template <typename T> __device__ __forceinline__ float load_elem(const T* p) {
  using B = typename Elem<T>::Bits;
  return Elem<T>::widen(__ldg(reinterpret_cast<const B*>(p)));
}
template <typename T> __device__ __forceinline__ void store_elem(T* p, float v) {
  using B = typename Elem<T>::Bits;
  *reinterpret_cast<B*>(p) = (B)Elem<T>::narrow(v);
}

// N 32-bit words with one vector instruction (N = 1, 2, 4; the address is 4N-byte aligned).
template <int N> __device__ __forceinline__ void load_words(const void* p, unsigned (&w)[N]) {
  if constexpr (N == 4) {
    const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
    w[0] = r.x; w[1] = r.y; w[2] = r.z; w[3] = r.w;
  } else if constexpr (N == 2) {
    const uint2 r = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = r.x; w[1] = r.y;
  } else {
    w[0] = __ldg(reinterpret_cast<const unsigned*>(p));
  }
}
template <int N> __device__ __forceinline__ void store_words(void* p, const unsigned (&w)[N]) {
  if constexpr (N == 4) {
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  } else if constexpr (N == 2) {
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<unsigned*>(p) = w[0];
  }
}

// Where each register slot of a row lives (see the file comment).
template <typename T, int WARPS, int VPT> struct RowTile {
  static constexpr int NT = 32 * WARPS;
  static constexpr int ES = (int)sizeof(T);
  static constexpr int V = (16 / ES < VPT) ? 16 / ES : VPT;  // elements per vector: at most 16 bytes
  static constexpr bool CAN_VEC = V * ES >= 4;                // a vector is at least one 32-bit word
  static constexpr int NW = CAN_VEC ? V * ES / 4 : 1;
  __device__ static __forceinline__ int elem(int j, int t, bool vec) {
    return vec ? ((j / V) * NT + t) * V + (j % V) : j * NT + t;
  }
};

// Row -> x[VPT] in fp32; slots past E get `pad`.
template <typename T, int WARPS, int VPT>
__device__ __forceinline__ void load_row(const T* __restrict__ row, int E, int t, bool vec, float pad,
                                         float (&x)[VPT]) {
  using R = RowTile<T, WARPS, VPT>;
  if constexpr (R::CAN_VEC) {
    if (vec) {
#pragma unroll
      for (int c = 0; c < VPT / R::V; ++c) {
        const int e0 = (c * R::NT + t) * R::V;
        unsigned w[R::NW] = {};
        // E % V == 0, so a vector is either wholly inside the row or wholly past its end.
        if (e0 < E) load_words<R::NW>(row + e0, w);
#pragma unroll
        for (int v = 0; v < R::V; ++v) {
          unsigned b;
          if constexpr (R::ES == 4) b = w[v];
          else b = (w[v >> 1] >> ((v & 1) * 16)) & 0xffffu;  // little-endian: element 2i is the low half
          x[c * R::V + v] = e0 < E ? Elem<T>::widen(b) : pad;
        }
      }
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int e = j * R::NT + t;
    x[j] = e < E ? load_elem(row + e) : pad;
  }
}

// y[VPT] (fp32) -> row, rounded once to T; slots past E are not written.
template <typename T, int WARPS, int VPT>
__device__ __forceinline__ void store_row(T* __restrict__ row, int E, int t, bool vec, const float (&y)[VPT]) {
  using R = RowTile<T, WARPS, VPT>;
  if constexpr (R::CAN_VEC) {
    if (vec) {
#pragma unroll
      for (int c = 0; c < VPT / R::V; ++c) {
        const int e0 = (c * R::NT + t) * R::V;
        if (e0 >= E) continue;
        unsigned w[R::NW];
#pragma unroll
        for (int i = 0; i < R::NW; ++i) w[i] = 0;
#pragma unroll
        for (int v = 0; v < R::V; ++v) {
          const unsigned b = Elem<T>::narrow(y[c * R::V + v]);
          if constexpr (R::ES == 4) w[v] = b;
          else w[v >> 1] |= b << ((v & 1) * 16);
        }
        store_words<R::NW>(row + e0, w);
      }
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int e = j * R::NT + t;
    if (e < E) store_elem(row + e, y[j]);
  }
}

// ---- reductions over a row group -----------------------------------------------------------------------
// Butterfly (xor) shuffles leave the same bits in every lane (each step adds the same two values in both
// partner lanes), so every thread of a group takes the same decisions from a reduced value.
struct OpSum { __device__ __forceinline__ float operator()(float a, float b) const { return a + b; } };
struct OpMax { __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); } };

template <int WARPS, typename Op>
__device__ __forceinline__ float group_reduce(float v, float* scratch, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(kFull, v, o));
  if constexpr (WARPS > 1) {
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    v = scratch[0];
#pragma unroll
    for (int i = 1; i < WARPS; ++i) v = op(v, scratch[i]);  // fixed order: deterministic
    __syncthreads();                                         // scratch is reused by the next reduction
  }
  return v;
}

// Softmax statistics of a row held VPT values a thread (padding = -inf): returns the row max m and
// sum s = sum_j exp(x_j - m), replacing x[j] by exp(x[j] - m). Group-uniform (every thread gets m and s).
template <int WARPS, int VPT>
__device__ __forceinline__ void softmax_exp_stats(float (&x)[VPT], float* red, float& m, float& s) {
  float mx = neg_inf();
#pragma unroll
  for (int j = 0; j < VPT; ++j) mx = fmaxf(mx, x[j]);
  m = group_reduce<WARPS>(mx, red, OpMax());
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < VPT; ++j) { x[j] = expf(x[j] - m); sum += x[j]; }
  s = group_reduce<WARPS>(sum, red, OpSum());
}

// Orders every other thread's global writes of this group before the calling thread's next ones.
template <int WARPS> __device__ __forceinline__ void group_sync() {
  if constexpr (WARPS == 1) __syncwarp();
  else __syncthreads();
}

// Float -> unsigned with the same order. NaN ranks as -inf (lowest, yet still selectable, so the ids stay
// valid), -0 is folded into +0 (they compare equal, so they tie), and 0 stays free to mark "taken" and
// padding slots: the smallest key of a real value is that of -inf, 0x007fffff.
__device__ __forceinline__ unsigned order_key(float f) {
  f = isnan(f) ? neg_inf() : f + 0.0f;
  const unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// The group's largest key, ties to the lowest element index. Each thread passes its own best (key, e),
// already the lowest e among its equal keys. redux.sync (sm_80+) does each warp step in one instruction.
template <int WARPS>
__device__ __forceinline__ unsigned group_argmax(unsigned key, unsigned e, unsigned (*ks)[WARPS],
                                                 unsigned (*es)[WARPS], int parity) {
  const unsigned wk = __reduce_max_sync(kFull, key);
  const unsigned we = __reduce_min_sync(kFull, key == wk ? e : 0xffffffffu);
  if constexpr (WARPS == 1) {
    return we;
  } else {
    // Two scratch buffers alternate between iterations, so one barrier per iteration suffices: a warp
    // can only overwrite buffer p after every warp passed the next iteration's barrier, i.e. read p.
    if ((threadIdx.x & 31) == 0) { ks[parity][threadIdx.x >> 5] = wk; es[parity][threadIdx.x >> 5] = we; }
    __syncthreads();
    unsigned bk = ks[parity][0], be = es[parity][0];
#pragma unroll
    for (int i = 1; i < WARPS; ++i) {
      const unsigned k2 = ks[parity][i], e2 = es[parity][i];
      if (k2 > bk || (k2 == bk && e2 < be)) { bk = k2; be = e2; }
    }
    return be;
  }
}

// ================================================================================================
// Forward: one row group per token.
//   scores  s_e = softmax(x)_e  or  sigmoid(x_e)              (fp32)
//   select  the K largest of  s_e + bias_e  (bias given)  or  x_e  (no bias: s is increasing in x, so the
//           order is the same and exact: only equal logits tie); ties go to the lower expert index.
//   gates   s_{e_k}, or with renormalize s_{e_k} / sum_k s_{e_k} (computed for softmax as
//           exp(x_{e_k} - m_sel) / sum_k exp(x_{e_k} - m_sel), m_sel = largest selected logit: the full
//           softmax sum cancels, and the sum is >= 1 so no bias can make it underflow).
// ids[k] descend in selection value. K <= E: every iteration finds an unselected real element.
// ================================================================================================
template <typename T, int WARPS, int VPT>
__global__ void __launch_bounds__(router_threads(WARPS), 1) route_topk_fwd(
    const T* __restrict__ logits,    // (L, E)
    const float* __restrict__ bias,  // (E,) selection-only bias, or nullptr
    float* __restrict__ gates,       // (L, K) out
    int* __restrict__ ids,           // (L, K) out, int32 expert ids
    int L, int E, int K, int score, int renorm, int vec_ok) {
  using R = RowTile<T, WARPS, VPT>;
  constexpr int NT = R::NT;
  __shared__ float red[WARPS];
  __shared__ unsigned kred[2][WARPS], ered[2][WARPS];

  const int t = threadIdx.x % NT;
  const long long row = (long long)blockIdx.x * router_groups(WARPS) + threadIdx.x / NT;
  if (row >= L) return;  // a whole group (for WARPS > 1 the whole block) leaves together
  const bool vec = R::CAN_VEC && vec_ok != 0;
  const T* xr = logits + row * E;
  float* gr = gates + row * K;
  int* ir = ids + row * K;

  float x[VPT];
  load_row<T, WARPS, VPT>(xr, E, t, vec, neg_inf(), x);

  // Softmax max and sum: needed for the unnormalised gates and to rank s + bias.
  const bool softmax = score == SCORE_SOFTMAX;
  float m = 0.f, s = 1.f;
  if (softmax && (bias != nullptr || !renorm)) {
    float mx = neg_inf();
#pragma unroll
    for (int j = 0; j < VPT; ++j) mx = fmaxf(mx, x[j]);
    m = group_reduce<WARPS>(mx, red, OpMax());
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) sum += expf(x[j] - m);  // padding: exp(-inf) = 0
    s = group_reduce<WARPS>(sum, red, OpSum());
  }

  unsigned key[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int e = R::elem(j, t, vec);
    float v = x[j];
    if (bias != nullptr && e < E) v = (softmax ? expf(x[j] - m) / s : sigmoid_f(x[j])) + __ldg(bias + e);
    key[j] = e < E ? order_key(v) : 0u;
  }

  // Iterative argmax: each thread keeps its best unselected slot; only the winner's owner rescans.
  unsigned bk = 0;
  int bj = 0;
#pragma unroll
  for (int j = 0; j < VPT; ++j) if (key[j] > bk) { bk = key[j]; bj = j; }  // strict: lowest e on ties
  int first_id = 0;  // thread t owns outputs k = t, t + NT, ...; its first id also stays in a register
  for (int k = 0; k < K; ++k) {
    const unsigned my_e = (unsigned)R::elem(bj, t, vec);
    const unsigned win = group_argmax<WARPS>(bk, my_e, kred, ered, k & 1);
    if (t == (k & (NT - 1))) {
      ir[k] = (int)win;
      if (k < NT) first_id = (int)win;
    }
    if (my_e == win) {
      bk = 0;
      bj = 0;
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        if ((unsigned)R::elem(j, t, vec) == win) key[j] = 0u;
        if (key[j] > bk) { bk = key[j]; bj = j; }
      }
    }
  }

  // Gates from the selected logits, gathered again from the row just read (cached lines, K per row). While
  // K <= NT (the usual case) every thread has at most one output and keeps its logit in a register; past
  // that a thread rereads its own earlier id writes.
  const float x_first = t < K ? load_elem(xr + first_id) : 0.f;
  auto sel_logit = [&](int k) { return k == t ? x_first : load_elem(xr + ir[k]); };
  float msel = 0.f, ssel = 1.f;
  if (renorm) {
    if (softmax) {
      float mx = neg_inf();
      for (int k = t; k < K; k += NT) mx = fmaxf(mx, sel_logit(k));
      msel = group_reduce<WARPS>(mx, red, OpMax());
    }
    float sum = 0.f;
    for (int k = t; k < K; k += NT) {
      const float xk = sel_logit(k);
      sum += softmax ? expf(xk - msel) : sigmoid_f(xk);
    }
    ssel = group_reduce<WARPS>(sum, red, OpSum());
  }
  for (int k = t; k < K; k += NT) {
    const float xk = sel_logit(k);
    float g;
    if (softmax) g = renorm ? expf(xk - msel) / ssel : expf(xk - m) / s;
    else g = renorm ? sigmoid_f(xk) / ssel : sigmoid_f(xk);
    gr[k] = g;
  }
}

// ================================================================================================
// Backward: dlogits (L, E) from dgates (L, K), recomputing the scores from the logits.
//   softmax:               dx_j = p_j * (dp_j - c),  dp_j = dg_k if j = e_k else 0,  c = sum_k dg_k g_k
//   softmax, renormalised: g = softmax over the selected logits only, so dx_j = 0 off the selection and
//                          dx_{e_k} = g_k * (dg_k - c),  c = sum_k dg_k g_k
//   sigmoid:               dx_{e_k} = ds_k * s_k * (1 - s_k),  ds_k = dg_k, or renormalised (dg_k - c) / S
//                          with S = sum_k s_k, c = sum_k dg_k g_k
// The dense part (-p_j c, or 0) is stored first, then the K selected entries overwrite theirs after a group
// barrier. ids must be distinct within a row (route_topk's are); ids outside [0, E) are skipped.
// ================================================================================================
template <typename T, int WARPS, int VPT>
__global__ void __launch_bounds__(router_threads(WARPS), 1) route_topk_bwd(
    const float* __restrict__ dgates,  // (L, K)
    const T* __restrict__ logits,      // (L, E)
    const int* __restrict__ ids,       // (L, K)
    T* __restrict__ dlogits,           // (L, E) out
    int L, int E, int K, int score, int renorm, int vec_ok) {
  using R = RowTile<T, WARPS, VPT>;
  constexpr int NT = R::NT;
  __shared__ float red[WARPS];

  const int t = threadIdx.x % NT;
  const long long row = (long long)blockIdx.x * router_groups(WARPS) + threadIdx.x / NT;
  if (row >= L) return;
  const bool vec = R::CAN_VEC && vec_ok != 0;
  const T* xr = logits + row * E;
  T* dr = dlogits + row * E;
  const float* dg = dgates + row * K;
  const int* ir = ids + row * K;
  const bool softmax = score == SCORE_SOFTMAX;
  const bool dense = softmax && !renorm;

  float y[VPT];
  float m = 0.f, s = 1.f, c = 0.f, msel = 0.f, ssel = 1.f;
  if (dense) {
    load_row<T, WARPS, VPT>(xr, E, t, vec, neg_inf(), y);
    softmax_exp_stats<WARPS>(y, red, m, s);
    float cp = 0.f;
    for (int k = t; k < K; k += NT) {
      const int e = ir[k];
      if ((unsigned)e < (unsigned)E) cp += dg[k] * (expf(load_elem(xr + e) - m) / s);
    }
    c = group_reduce<WARPS>(cp, red, OpSum());
#pragma unroll
    for (int j = 0; j < VPT; ++j) y[j] = -(y[j] / s) * c;
  } else {
    if (renorm) {
      if (softmax) {
        float mx = neg_inf();
        for (int k = t; k < K; k += NT) {
          const int e = ir[k];
          if ((unsigned)e < (unsigned)E) mx = fmaxf(mx, load_elem(xr + e));
        }
        msel = group_reduce<WARPS>(mx, red, OpMax());
      }
      float sum = 0.f, dot = 0.f;
      for (int k = t; k < K; k += NT) {
        const int e = ir[k];
        if ((unsigned)e < (unsigned)E) {
          const float xk = load_elem(xr + e);
          const float q = softmax ? expf(xk - msel) : sigmoid_f(xk);
          sum += q;
          dot += dg[k] * q;
        }
      }
      ssel = group_reduce<WARPS>(sum, red, OpSum());
      c = group_reduce<WARPS>(dot, red, OpSum()) / ssel;
    }
#pragma unroll
    for (int j = 0; j < VPT; ++j) y[j] = 0.f;
  }
  store_row<T, WARPS, VPT>(dr, E, t, vec, y);
  group_sync<WARPS>();

  for (int k = t; k < K; k += NT) {
    const int e = ir[k];
    if ((unsigned)e >= (unsigned)E) continue;
    const float xk = load_elem(xr + e), dgk = dg[k];
    float d;
    if (dense) {
      d = (expf(xk - m) / s) * (dgk - c);
    } else if (softmax) {
      d = (expf(xk - msel) / ssel) * (dgk - c);
    } else {
      const float sk = sigmoid_f(xk);
      d = (renorm ? (dgk - c) / ssel : dgk) * sk * (1.f - sk);
    }
    store_elem(dr + e, d);
  }
}

// ================================================================================================
// Auxiliary losses (p = softmax(x) per token, lse_t = logsumexp(x_t)):
//   load balancing  aux = E * sum_e f_e P_e,  f_e = count_e / (L K),  P_e = (1/L) sum_t p_te
//   z-loss          z   = (1/L) sum_t lse_t^2
// router_aux_partial: block b covers rows [b R, b R + R) and writes its column sums of p (G, E), its sum of
// lse^2 (G) and its expert counts (G, E); router_aux_finalize reduces the G partials in a fixed order, so
// the losses are the same bits run to run (G depends only on L and E). Null outputs are skipped.
// ================================================================================================
template <typename T, int WARPS, int VPT>
__global__ void __launch_bounds__(router_threads(WARPS), 1) router_aux_partial(
    const T* __restrict__ logits,    // (L, E)
    const int* __restrict__ ids,     // (L, K), or nullptr (no counts)
    int L, int E, int K, int rows_per_block, int vec_ok,
    float* __restrict__ part_p,      // (G, E) column sums of p, or nullptr
    float* __restrict__ part_z,      // (G,) sums of lse^2, or nullptr
    int* __restrict__ part_count) {  // (G, E) expert counts, or nullptr
  using R = RowTile<T, WARPS, VPT>;
  constexpr int NT = R::NT, GROUPS = router_groups(WARPS);
  __shared__ float red[WARPS];
  __shared__ float zs[GROUPS];
  // dynamic: [GROUPS][E] floats (per-group p sums, GROUPS > 1 and part_p) then [E] ints (counts)
  extern __shared__ float dyn[];

  const int t = threadIdx.x % NT, g = threadIdx.x / NT;
  const bool vec = R::CAN_VEC && vec_ok != 0;
  const long long r0 = (long long)blockIdx.x * rows_per_block;
  const long long r1 = min((long long)L, r0 + rows_per_block);

  float acc[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j) acc[j] = 0.f;
  float zacc = 0.f;
  if (part_p != nullptr || part_z != nullptr) {
    for (long long r = r0 + g; r < r1; r += GROUPS) {  // group-uniform trip count: barriers stay matched
      float x[VPT];
      load_row<T, WARPS, VPT>(logits + r * E, E, t, vec, neg_inf(), x);
      float m, s;
      softmax_exp_stats<WARPS>(x, red, m, s);
      const float lse = m + logf(s);
      zacc += lse * lse;
#pragma unroll
      for (int j = 0; j < VPT; ++j) acc[j] += x[j] / s;
    }
  }

  float* sp = dyn;
  int* hist = reinterpret_cast<int*>(dyn + ((GROUPS > 1 && part_p != nullptr) ? GROUPS * E : 0));
  if (part_p != nullptr) {
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int e = R::elem(j, t, vec);
      if (e >= E) continue;
      if constexpr (GROUPS == 1) part_p[(long long)blockIdx.x * E + e] = acc[j];
      else sp[g * E + e] = acc[j];
    }
  }
  if (t == 0) zs[g] = zacc;
  if (part_count != nullptr)
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  if constexpr (GROUPS > 1) {
    if (part_p != nullptr) {
      for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float v = sp[e];
#pragma unroll
        for (int i = 1; i < GROUPS; ++i) v += sp[i * E + e];
        part_p[(long long)blockIdx.x * E + e] = v;
      }
    }
  }
  if (part_z != nullptr && threadIdx.x == 0) {
    float z = zs[0];
#pragma unroll
    for (int i = 1; i < GROUPS; ++i) z += zs[i];
    part_z[blockIdx.x] = z;
  }
  if (part_count != nullptr) {
    // Integer shared-memory atomics: the counts do not depend on the order they land in.
    for (long long i = r0 * K + threadIdx.x; i < r1 * K; i += blockDim.x) {
      const int e = ids[i];
      if ((unsigned)e < (unsigned)E) atomicAdd(hist + e, 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) part_count[(long long)blockIdx.x * E + e] = hist[e];
  }
}

// One 1024-thread block. Warps split the G partial rows, lanes take 32 experts at a time (coalesced), and
// the 32 warp sums are added in warp order.
__global__ void __launch_bounds__(1024) router_aux_finalize(
    const float* __restrict__ part_p,     // (G, E) or nullptr
    const int* __restrict__ part_count,   // (G, E) or nullptr
    const float* __restrict__ part_z,     // (G,) or nullptr
    int G, int L, int K, int E,
    float* __restrict__ lb_out,           // () load-balancing loss, or nullptr
    float* __restrict__ z_out,            // () z-loss, or nullptr
    float* __restrict__ f_out) {          // (E,) f_e = count_e / (L K), or nullptr
  __shared__ float sp[32][33];
  __shared__ int sc[32][33];
  __shared__ float red[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const double inv_lk = L > 0 ? 1.0 / ((double)L * (double)K) : 0.0;
  const float inv_l = L > 0 ? 1.0f / (float)L : 0.0f;

  float term = 0.f;  // warp 0: this lane's share of sum_e f_e P_e
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane;
    float ap = 0.f;
    int ac = 0;  // counts <= L K < 2^31 (checked on the host)
    if (e < E) {
      for (int b = warp; b < G; b += 32) {
        if (part_p != nullptr) ap += part_p[(long long)b * E + e];
        if (part_count != nullptr) ac += part_count[(long long)b * E + e];
      }
    }
    sp[warp][lane] = ap;
    sc[warp][lane] = ac;
    __syncthreads();
    if (warp == 0 && e < E) {
      float P = 0.f;
      int cnt = 0;
      for (int w = 0; w < 32; ++w) { P += sp[w][lane]; cnt += sc[w][lane]; }
      const float f = (float)((double)cnt * inv_lk);
      if (f_out != nullptr) f_out[e] = f;
      term += f * (P * inv_l);
    }
    __syncthreads();
  }
  if (warp == 0) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) term += __shfl_xor_sync(kFull, term, o);
    if (lane == 0 && lb_out != nullptr) *lb_out = (float)E * term;
  }
  if (z_out != nullptr) {
    float z = 0.f;
    for (int b = threadIdx.x; b < G; b += blockDim.x) z += part_z[b];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) z += __shfl_xor_sync(kFull, z, o);
    if (lane == 0) red[warp] = z;
    __syncthreads();
    if (threadIdx.x == 0) {
      float tot = 0.f;
      for (int w = 0; w < 32; ++w) tot += red[w];
      *z_out = tot * inv_l;
    }
  }
}

// Gradient of  d_lb * aux + d_z * z  with respect to the logits (either term may be off):
//   dx_tj = p_tj * ( a * (f_j - sum_e f_e p_te) + b * lse_t ),  a = d_lb E / L,  b = 2 d_z / L
// (only P carries a gradient in aux: f is a count). The scales come from device scalars when given, so
// a loss scale living on the device needs no host round trip.
template <typename T, int WARPS, int VPT>
__global__ void __launch_bounds__(router_threads(WARPS), 1) router_aux_bwd(
    const T* __restrict__ logits,    // (L, E)
    const float* __restrict__ f,     // (E,) or nullptr: no load-balancing term
    const float* __restrict__ d_lb,  // () or nullptr: use d_lb_value
    float d_lb_value,
    const float* __restrict__ d_z,   // () or nullptr: use d_z_value
    float d_z_value,
    int L, int E, int vec_ok,
    T* __restrict__ dlogits) {       // (L, E) out
  using R = RowTile<T, WARPS, VPT>;
  constexpr int NT = R::NT;
  __shared__ float red[WARPS];
  const int t = threadIdx.x % NT;
  const long long row = (long long)blockIdx.x * router_groups(WARPS) + threadIdx.x / NT;
  if (row >= L) return;
  const bool vec = R::CAN_VEC && vec_ok != 0;

  float x[VPT];
  load_row<T, WARPS, VPT>(logits + row * E, E, t, vec, neg_inf(), x);
  float m, s;
  softmax_exp_stats<WARPS>(x, red, m, s);
#pragma unroll
  for (int j = 0; j < VPT; ++j) x[j] /= s;  // p

  const float inv_l = 1.0f / (float)L;
  const float a = (f != nullptr) ? (d_lb != nullptr ? *d_lb : d_lb_value) * (float)E * inv_l : 0.f;
  const float b = (d_z != nullptr ? *d_z : d_z_value) * 2.f * inv_l * (m + logf(s));
  float fj[VPT];
  float fp = 0.f;
  if (f != nullptr) {
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int e = R::elem(j, t, vec);
      fj[j] = e < E ? __ldg(f + e) : 0.f;
      fp += fj[j] * x[j];
    }
    fp = group_reduce<WARPS>(fp, red, OpSum());
  } else {
#pragma unroll
    for (int j = 0; j < VPT; ++j) fj[j] = 0.f;
  }
#pragma unroll
  for (int j = 0; j < VPT; ++j) x[j] *= a * (fj[j] - fp) + b;
  store_row<T, WARPS, VPT>(dlogits + row * E, E, t, vec, x);
}

}  // namespace blz
