// The expert FFN's small kernels: tile offsets per expert, the deterministic combine, dgates, bias gradients,
// token-block starts, the experts seen by a chunk and the staging of gathered rows in slot order. The GEMMs are in moe_gemm_sm80.cu / moe_gemm_sm90.cu /
// moe_wgrad_sm90.cu.
#include "moe_common.cuh"

namespace blz {


// tile_offsets[e] = sum_{e' < e} ceil(count[e'] / bm), for e in [0, E]. One block of 1024 threads.
__global__ void __launch_bounds__(1024) moe_tile_offsets(const int* __restrict__ offsets, int num_experts, int bm,
                                                           int* __restrict__ tile_offsets) {
  __shared__ int warp_sums[32];
  __shared__ int carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int base = 0; base < num_experts; base += blockDim.x) {
    const int e = base + threadIdx.x;
    const int v = (e < num_experts) ? (offsets[e + 1] - offsets[e] + bm - 1) / bm : 0;
    int x = v;  // inclusive warp scan
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int w = (lane < (int)(blockDim.x >> 5)) ? warp_sums[lane] : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += y;
      }
      warp_sums[lane] = w;  // inclusive
    }
    __syncthreads();
    const int excl = carry + (warp ? warp_sums[warp - 1] : 0) + x - v;
    if (e < num_experts) tile_offsets[e] = excl;
    __syncthreads();
    if (threadIdx.x == blockDim.x - 1) carry = excl + v;
    __syncthreads();
  }
  if (threadIdx.x == 0) tile_offsets[num_experts] = carry;
}

// out[t, :d] = sum_k src[pair_slot[t, k], :d] in k order (fp32 accumulation) over the entries in [0, n_src), the
// others skipped (a dropped pair's -1, blazecore.sum_rows' padding or an unvalidated entry past its n_src rows, so
// the kernel never reads outside src): deterministic combine. src rows are
// d elements long; out rows are ldo apart (ldo > d: the combine fills a column slice of a wider output).
// acc_mode sums several launches' rows (the backward's slices of the reduction) in fp32 in acc, whose rows are
// ldo apart as out's: 0 none (out = sum), 1 first (acc = sum), 2 next (acc += sum), 3 last (out = acc + sum).
template <typename T>
__global__ void __launch_bounds__(128) moe_combine(const T* __restrict__ src, long long n_src,
                                                    const int* __restrict__ pair_slot, int topk, int d,
                                                    T* __restrict__ out, long long ldo, float* __restrict__ acc,
                                                    int acc_mode) {
  constexpr int EPC = 16 / sizeof(T);
  const long long t = blockIdx.x;
  for (int c = threadIdx.x; c * EPC < d; c += blockDim.x) {
    float accv[EPC];
#pragma unroll
    for (int v = 0; v < EPC; ++v) accv[v] = 0.f;
    for (int k = 0; k < topk; ++k) {
      const long long s = __ldg(pair_slot + t * topk + k);
      if (s < 0 || s >= n_src) continue;  // a dropped pair (or padding, or an entry past the rows) adds nothing
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src + s * d) + c);
      const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int v = 0; v < EPC; ++v) accv[v] += to_f<T>(vals[v]);
    }
    float* ar = acc_mode ? acc + t * ldo + (long long)c * EPC : nullptr;
    if (acc_mode >= 2) {
#pragma unroll
      for (int v = 0; v < EPC; ++v) accv[v] = ar[v] + accv[v];
    }
    if (acc_mode == 1 || acc_mode == 2) {
#pragma unroll
      for (int v = 0; v < EPC; ++v) ar[v] = accv[v];
      continue;
    }
    uint4 res;
    T* rv = reinterpret_cast<T*>(&res);
#pragma unroll
    for (int v = 0; v < EPC; ++v) rv[v] = from_f<T>(accv[v]);
    reinterpret_cast<uint4*>(out + t * ldo)[c] = res;
  }
}

// dgates[t, k] = sum_j part[s, j] (+ dy_t . b2[e] with a bias), s = pair_slot[t, k]; 0 for a dropped pair (s < 0).
// One warp per (t, k).
template <typename T>
__global__ void __launch_bounds__(256) moe_dgates(const float* __restrict__ part, int nparts,
                                                   const int* __restrict__ pair_slot, const int* __restrict__ offsets,
                                                   int num_experts, long long num_pairs, const T* __restrict__ dy,
                                                   const T* __restrict__ b2, int topk, int d,
                                                   float* __restrict__ dgates) {
  const long long p = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (p >= num_pairs) return;
  const long long s = __ldg(pair_slot + p);
  if (s < 0) {  // a dropped pair: no expert output, no gradient (warp-uniform)
    if (lane == 0) dgates[p] = 0.f;
    return;
  }
  float v = 0.f;
  for (int j = lane; j < nparts; j += 32) v += part[s * nparts + j];
  if (b2) {
    const int e = find_expert(offsets, num_experts, static_cast<int>(s));
    const long long t = p / topk;
    for (int c = lane; c < d; c += 32) v += to_f<T>(dy[t * d + c]) * to_f<T>(b2[(long long)e * d + c]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) dgates[p] = v;
}

// moe_dgates without a bias and with at most DGATES_SMALL_PARTS partials a slot: one thread a (t, k). The partials
// are summed in the order of moe_dgates' butterfly (lane j holds part j, zero past nparts; xor offsets 16, 8, 4, 2,
// 1), so both kernels give the same bits.
constexpr int DGATES_SMALL_PARTS = 8;
__global__ void __launch_bounds__(256) moe_dgates_small(const float* __restrict__ part, int nparts,
                                                         const int* __restrict__ pair_slot, long long num_pairs,
                                                         float* __restrict__ dgates) {
  const long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= num_pairs) return;
  const long long s = __ldg(pair_slot + p);
  if (s < 0) {  // a dropped pair
    dgates[p] = 0.f;
    return;
  }
  const float* src = part + s * nparts;
  float a[DGATES_SMALL_PARTS];
#pragma unroll
  for (int j = 0; j < DGATES_SMALL_PARTS; ++j) a[j] = j < nparts ? 0.f + __ldg(src + j) : 0.f;
#pragma unroll
  for (int o = DGATES_SMALL_PARTS / 2; o > 0; o >>= 1) {
#pragma unroll
    for (int j = 0; j < o; ++j) a[j] += a[j + o];
  }
  dgates[p] = a[0];
}

// out[e, c] = sum_{s in expert e, in order} scale(s) * src[row(s), c]: bias gradients, deterministic.
// row(s) = slot_token[s] when gathering (dy), else s (dz); scale(s) = gate of s when gates != nullptr.
// Chunked execution: carry_in continues the fp32 sums of earlier chunks from carry (E, cols), carry_out
// leaves them there instead of writing out; the slot order (and so every rounding) is the unchunked one.
template <typename T>
__global__ void __launch_bounds__(128) moe_bias_grad(const T* __restrict__ src, long long ld, int cols,
                                                      const int* __restrict__ offsets, const int* __restrict__ slot_token,
                                                      const int* __restrict__ slot_k, const float* __restrict__ gates,
                                                      int topk, int gather, T* __restrict__ out, long long ldo,
                                                      float* __restrict__ carry, int carry_in, int carry_out) {
  const int e = blockIdx.y;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int lo = offsets[e], hi = offsets[e + 1];
  const long long o = (long long)e * cols + c;  // carry's element (out's: e * ldo + c)
  float acc = carry_in ? carry[o] : 0.f;
  for (int s = lo; s < hi; ++s) {
    const long long row = gather ? (long long)slot_token[s] : (long long)s;
    const float sc = gates ? gates[(long long)slot_token[s] * topk + slot_k[s]] : 1.f;
    acc += sc * to_f<T>(src[row * ld + c]);
  }
  if (carry_out) {
    carry[o] = acc;
  } else {
    out[(long long)e * ldo + c] = from_f<T>(acc);
  }
}

// blk[e * nb + b] = the first slot of expert e whose token is >= b * block_tokens (an expert's slots are in
// token order), b in [0, nb): the token blocks of KTileWalk. One thread per (e, b), binary search.
__global__ void __launch_bounds__(256) moe_block_starts(const int* __restrict__ offsets,
                                                         const int* __restrict__ slot_token, int num_experts, int nb,
                                                         int block_tokens, int* __restrict__ blk) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)num_experts * nb) return;
  const int e = static_cast<int>(i / nb), b = static_cast<int>(i % nb);
  const long long tok = (long long)b * block_tokens;
  int lo = offsets[e], hi = offsets[e + 1];
  while (lo < hi) {
    const int mid = lo + ((hi - lo) >> 1);
    if (slot_token[mid] < tok) lo = mid + 1; else hi = mid;
  }
  blk[i] = lo;
}

// dst[s, :width] = src[slot_token[s], :width] for s in [0, n_slots): a gathered operand's rows staged in slot order
// (dst rows width apart), for the GEMMs that read them many times over (see _moe_gpu._stage_rows). One warp a row,
// VEC elements a lane per step (8: 16-byte copies; the launcher picks 1 where src's address or row stride does not
// allow them). Rows whose token is < 0 (none are: the dispatch is dropless) would be left as they are.
template <typename T, int VEC>
__global__ void __launch_bounds__(256) moe_gather_rows(const T* __restrict__ src, long long ld_src,
                                                       const int* __restrict__ slot_token, long long n_slots,
                                                       int width, T* __restrict__ dst) {
  const long long s = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
  if (s >= n_slots) return;
  const int tok = __ldg(slot_token + s);
  if (tok < 0) return;
  const T* sr = src + (long long)tok * ld_src;
  T* dr = dst + s * width;
  const int lane = threadIdx.x & 31;
  if constexpr (VEC == 8) {
    static_assert(sizeof(T) == 2, "16-byte copies of 16-bit elements");
    for (int c = lane * 8; c < width; c += 32 * 8)
      *reinterpret_cast<uint4*>(dr + c) = __ldg(reinterpret_cast<const uint4*>(sr + c));
  } else {
    for (int c = lane; c < width; c += 32) dr[c] = sr[c];
  }
}

// seen[e] |= (expert e has a slot in this chunk): which experts' carried weight-gradient sums hold a value.
__global__ void __launch_bounds__(256) moe_mark_seen(const int* __restrict__ offsets, int num_experts,
                                                      int* __restrict__ seen) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e < num_experts && offsets[e + 1] > offsets[e]) seen[e] = 1;
}

}  // namespace blz
