// Shared device helpers for the expert FFN kernels: dtype conversion, activations, cp.async, ldmatrix, mma.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "moe_args.cuh"


namespace blz {

// ---- dtype conversion ----------------------------------------------------------------------------
template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Store two adjacent elements (column c, c+1) with one 4- or 8-byte store; c is even and the row
// length is a multiple of 8, so the pair is aligned.
template <typename T> __device__ __forceinline__ void store2(T* p, float a, float b) {
  p[0] = from_f<T>(a);
  p[1] = from_f<T>(b);
}
template <> __device__ __forceinline__ void store2<float>(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
template <> __device__ __forceinline__ void store2<__half>(__half* p, float a, float b) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}
template <> __device__ __forceinline__ void store2<__nv_bfloat16>(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
template <typename T> __device__ __forceinline__ void load2(const T* p, float& a, float& b) {
  a = to_f<T>(p[0]);
  b = to_f<T>(p[1]);
}

// ---- activations (fp32 in registers) ------------------------------------------------------------
// Names match blazecore.moe.ACTIVATIONS. Gated ones (SWIGLU, GEGLU, SWIGLU_OAI) apply act to the gate half a
// and multiply by up_f(b) of the up half b (b itself but for SWIGLU_OAI); the others apply act to the whole
// pre-activation. SWIGLU_OAI is gpt-oss's clamped SwiGLU: a' = min(a, 7), act = a' sigmoid(1.702 a'),
// up_f = clamp(b, -7, 7) + 1; a clamp passes the gradient where the value lies inside it, bounds included.
enum Act : int { SWIGLU = 0, GEGLU = 1, GELU = 2, SILU = 3, RELU2 = 4, SWIGLU_OAI = 5 };
// ACT_INTERLEAVED | a gated Act (every GEMM kernel with an activation): w13's 2h rows, z's and dz's columns and b13 alternate
// gate and up ([g0, u0, g1, u1, ...], gpt-oss's layout) instead of [gate half | up half].
constexpr int ACT_INTERLEAVED = 8;
__host__ __device__ constexpr int act_base(int act) { return act & (ACT_INTERLEAVED - 1); }
__host__ __device__ constexpr bool act_interleaved(int act) { return (act & ACT_INTERLEAVED) != 0; }
constexpr float OAI_ALPHA = 1.702f, OAI_LIMIT = 7.f;

__host__ __device__ constexpr bool act_gated(int act) { return act == SWIGLU || act == GEGLU || act == SWIGLU_OAI; }

// Fast-path sigmoid: ex2.approx-based exp and an approximate reciprocal (a few ulp in fp32, far inside the
// bf16 / fp16 outputs' rounding; x -> -inf gives 1 / inf = 0, x -> +inf gives 1). The exp flushes results below
// 2^-126 to zero (.ftz): __expf's fix-up for them (three more instructions an exp) cannot change 1 + exp, so the
// values are __expf's bit for bit.
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float sigmoidf_(float x) { return __fdividef(1.f, 1.f + ex2_ftz(x * -1.4426950408889634f)); }

// gelu with the tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
__device__ __forceinline__ float gelu_tanh(float x) {
  const float c = 0.7978845608028654f;
  return 0.5f * x * (1.f + tanhf(c * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float gelu_tanh_grad(float x) {
  const float c = 0.7978845608028654f;
  float t = tanhf(c * (x + 0.044715f * x * x * x));
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * c * (1.f + 3.f * 0.044715f * x * x);
}

template <int ACT> __device__ __forceinline__ float act_f(float x) {
  if constexpr (ACT == SWIGLU || ACT == SILU) {
    return x * sigmoidf_(x);
  } else if constexpr (ACT == SWIGLU_OAI) {
    const float c = fminf(x, OAI_LIMIT);
    return c * sigmoidf_(OAI_ALPHA * c);
  } else if constexpr (ACT == GEGLU || ACT == GELU) {
    return gelu_tanh(x);
  } else {
    float r = fmaxf(x, 0.f);
    return r * r;
  }
}
template <int ACT> __device__ __forceinline__ float act_grad(float x) {
  if constexpr (ACT == SWIGLU || ACT == SILU) {
    float s = sigmoidf_(x);
    return s * (1.f + x * (1.f - s));
  } else if constexpr (ACT == SWIGLU_OAI) {
    const float s = sigmoidf_(OAI_ALPHA * x);
    return x <= OAI_LIMIT ? s * (1.f + OAI_ALPHA * x * (1.f - s)) : 0.f;
  } else if constexpr (ACT == GEGLU || ACT == GELU) {
    return gelu_tanh_grad(x);
  } else {
    return 2.f * fmaxf(x, 0.f);
  }
}
// The up half's factor of a gated activation and its derivative (b and 1 but for SWIGLU_OAI).
template <int ACT> __device__ __forceinline__ float up_f(float b) {
  if constexpr (ACT == SWIGLU_OAI) {
    return fminf(fmaxf(b, -OAI_LIMIT), OAI_LIMIT) + 1.f;
  } else {
    return b;
  }
}
template <int ACT> __device__ __forceinline__ float up_grad(float b) {
  if constexpr (ACT == SWIGLU_OAI) {
    return (b >= -OAI_LIMIT && b <= OAI_LIMIT) ? 1.f : 0.f;
  } else {
    return 1.f;
  }
}
// hcur of a gated activation from the gate value a and the up value b
template <int ACT> __device__ __forceinline__ float gated_f(float a, float b) { return act_f<ACT>(a) * up_f<ACT>(b); }

// ---- async copies and tensor-core fragments -------------------------------------------------------
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// 16-byte global->shared copy that bypasses L1; src_bytes = 0 zero-fills (out-of-range rows/cols).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// D += A(16x16, row) * B(16x8, col), fp32 accumulators.
template <typename T> __device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], const unsigned* b);
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4], const unsigned* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void mma16816<__half>(float (&d)[4], const unsigned (&a)[4], const unsigned* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---- tile bookkeeping shared by the mma.sync and wgmma GEMMs ---------------------------------------
enum Mode : int { MODE_M = 0, MODE_K = 1 };  // M-grouped (gathered rows per expert) / K-grouped (weight grads)
enum Epi : int {
  EPI_ACT = 0,       // z = acc + b13; store act(z) (hcur) and/or z itself (checkpoint "ab" / recompute)
  EPI_ROWSCALE = 1,  // out = (acc + bias) * gate(slot)   (forward w2 GEMM; dx GEMM without scale)
  EPI_DHCUR = 2,     // dh' = acc; recompute hcur from z; dgates partials; dz = act backward; hg = g * hcur
  EPI_WGRAD = 3,     // per-expert weight gradient tile store
};

// The argument struct (moe_args.cuh) of a kernel that serves both modes (moe_gemm).
template <int MODE, typename T> struct GemmArgsFor { using type = MGroupedArgs<T>; };
template <typename T> struct GemmArgsFor<MODE_K, T> { using type = KGroupedArgs<T>; };

// The expert owning global m-tile v: the largest e with offs[e] <= v (experts with no tile repeat a value).
__device__ __forceinline__ int find_expert(const int* __restrict__ offs, int n, int v) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(offs + mid) <= v) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// ---- reduction tiles of the K-grouped (weight-gradient) GEMMs ---------------------------------------
// An expert's slots [lo, hi) are in token order. Tokens are grouped in blocks of a fixed size; blk[e * nb + b]
// is the first slot of expert e in token block b (b < nb, blk[e * nb] = lo), and block b ends where block
// b + 1 starts (the last at hi). The reduction walks each block's slots in tiles of BK that restart at the
// block's first slot, in block order. A run over a token range that starts on a block boundary therefore
// visits exactly the tiles (same slots, same zero padding, same order) that the run over all tokens visits
// there, which is what makes chunked weight gradients bit-identical to unchunked ones. nb <= 1: one block,
// blk unused.
template <int BK> struct KTileWalk {
  const int* bs;
  int nb, hi, b, t0, bend;  // current tile [t0, end()) of block b, which ends at bend
  __device__ __forceinline__ KTileWalk(const int* blk, int e, int nblocks, int lo, int hi_)
      : bs(nblocks > 1 ? blk + (long long)e * nblocks : nullptr), nb(nblocks > 1 ? nblocks : 1), hi(hi_), b(0),
        t0(lo), bend(nblocks > 1 ? __ldg(bs + 1) : hi_) {
    skip_empty();
  }
  __device__ __forceinline__ int end() const { return min(t0 + BK, bend); }
  __device__ __forceinline__ void next() {
    t0 = end();
    skip_empty();
  }
  __device__ __forceinline__ void skip_empty() {
    while (t0 >= bend && b + 1 < nb) {
      ++b;
      t0 = __ldg(bs + b);
      bend = (b + 1 < nb) ? __ldg(bs + b + 1) : hi;
    }
  }
};

// Number of tiles KTileWalk visits for expert e.
template <int BK>
__device__ __forceinline__ int ktile_count(const int* blk, int e, int nblocks, int lo, int hi) {
  if (nblocks <= 1) return (hi - lo + BK - 1) / BK;
  const int* bs = blk + (long long)e * nblocks;
  int n = 0;
  for (int b = 0; b < nblocks; ++b) {
    const int end = (b + 1 < nblocks) ? __ldg(bs + b + 1) : hi;
    n += (end - __ldg(bs + b) + BK - 1) / BK;
  }
  return n;
}

// ---- epilogue math shared by the mma.sync and wgmma GEMMs ------------------------------------------
// Each call handles one accumulator pair: row (slot) s, adjacent output columns n, n+1.

// gate of slot s: gates[(slot_token[s], slot_k[s])]
__device__ __forceinline__ float slot_gate(const float* gates, const int* slot_token, const int* slot_k, int topk,
                                           int s) {
  return __ldg(gates + (long long)__ldg(slot_token + s) * topk + __ldg(slot_k + s));
}

// z = acc + b13; gated: a = gate columns, b = up columns (z column n + N, bias element n + bup: bup = N but for a
// launch over a column slice of h, where the bias' up half starts h after the slice); hcur = act(a) * b.
// Stores z to zout (row stride ldz) when zout != nullptr, hcur to hout when hout != nullptr.
template <typename T, int ACT>
__device__ __forceinline__ void epi_act_gated(const T* bias_e, long long bup, int N, T* hout, long long ldh, T* zout,
                                              long long ldz, int s, int n, float a0, float a1, float b0, float b1) {
  if (bias_e) {
    float x0, x1, y0, y1;
    load2<T>(bias_e + n, x0, x1);
    load2<T>(bias_e + bup + n, y0, y1);
    a0 += x0; a1 += x1; b0 += y0; b1 += y1;
  }
  if (zout) {
    store2<T>(zout + (long long)s * ldz + n, a0, a1);
    store2<T>(zout + (long long)s * ldz + N + n, b0, b1);
  }
  if (hout) store2<T>(hout + (long long)s * ldh + n, gated_f<ACT>(a0, b0), gated_f<ACT>(a1, b1));
}

template <typename T, int ACT>
__device__ __forceinline__ void epi_act_plain(const T* bias_e, T* hout, long long ldh, T* zout, long long ldz, int s,
                                              int n, float z0, float z1) {
  if (bias_e) {
    float x0, x1;
    load2<T>(bias_e + n, x0, x1);
    z0 += x0; z1 += x1;
  }
  if (zout) store2<T>(zout + (long long)s * ldz + n, z0, z1);
  if (hout) store2<T>(hout + (long long)s * ldh + n, act_f<ACT>(z0), act_f<ACT>(z1));
}

// Interleaved gated z (ACT_INTERLEAVED): the pair at z columns c, c+1 (c even) is (gate, up) of h column c / 2.
// z = acc + b13 (b13 interleaved alike); stores the pair to zout and hcur's one element to hout.
template <typename T, int ACT>
__device__ __forceinline__ void epi_act_interleaved(const T* bias_e, T* hout, long long ldh, T* zout, long long ldz,
                                                    int s, int c, float a, float b) {
  if (bias_e) {
    float x0, x1;
    load2<T>(bias_e + c, x0, x1);
    a += x0; b += x1;
  }
  if (zout) store2<T>(zout + (long long)s * ldz + c, a, b);
  if (hout) hout[(long long)s * ldh + c / 2] = from_f<T>(gated_f<ACT>(a, b));
}
// out = (acc + bias) * gs
template <typename T>
__device__ __forceinline__ void epi_rowscale(const T* bias_e, T* out, long long ldo, int s, int n, float o0, float o1,
                                             float gs) {
  if (bias_e) {
    float x0, x1;
    load2<T>(bias_e + n, x0, x1);
    o0 += x0; o1 += x1;
  }
  store2<T>(out + (long long)s * ldo + n, o0 * gs, o1 * gs);
}

// Activation backward of one pair of columns (c, c+1) of h. In: the pre-activations a (gate part; the whole
// pre-activation when not gated), b (up part; unused when not gated), dh' = dy_t w2_e and the slot's gate.
// Out: dz (gate part da and up part db; db unused when not gated), g * hcur, and the dgates contribution
// sum(dh' * hcur) of the pair.
struct DhcurPair {
  float da0, da1, db0, db1, hg0, hg1, p;
};
template <int ACT>
__device__ __forceinline__ DhcurPair dhcur_math(float a0, float a1, float b0, float b1, float d0, float d1, float gs) {
  DhcurPair r;
  const float s0 = act_f<ACT>(a0), s1 = act_f<ACT>(a1);
  if constexpr (act_gated(ACT)) {
    const float u0 = up_f<ACT>(b0), u1 = up_f<ACT>(b1);  // b0, b1 but for SWIGLU_OAI
    const float h0 = s0 * u0, h1 = s1 * u1;
    const float dh0 = gs * d0, dh1 = gs * d1;
    r.da0 = dh0 * u0 * act_grad<ACT>(a0);
    r.da1 = dh1 * u1 * act_grad<ACT>(a1);
    if constexpr (ACT == SWIGLU_OAI) {
      r.db0 = dh0 * s0 * up_grad<ACT>(b0);
      r.db1 = dh1 * s1 * up_grad<ACT>(b1);
    } else {
      r.db0 = dh0 * s0;
      r.db1 = dh1 * s1;
    }
    r.hg0 = gs * h0;
    r.hg1 = gs * h1;
    r.p = d0 * h0 + d1 * h1;
  } else {
    r.da0 = gs * d0 * act_grad<ACT>(a0);
    r.da1 = gs * d1 * act_grad<ACT>(a1);
    r.db0 = r.db1 = 0.f;
    r.hg0 = gs * s0;
    r.hg1 = gs * s1;
    r.p = d0 * s0 + d1 * s1;
  }
  return r;
}

// acc = dh' at columns n, n+1 of h for slot s: read z (row of z: gate columns, up columns at N + n), write
// dz (may be the same memory as z: every element is read before this thread writes it, and no other
// thread touches it) and g * hcur to hg; return the dgates contribution.
template <typename T, int ACT>
__device__ __forceinline__ float epi_dhcur(const T* z, long long ldz, int N, T* dz, long long lddz, T* hg,
                                           long long ldhg, int s, int n, float d0, float d1, float gs) {
  const T* zr = z + (long long)s * ldz;
  T* dzr = dz + (long long)s * lddz;
  float a0, a1, b0 = 0.f, b1 = 0.f;
  load2<T>(zr + n, a0, a1);
  if constexpr (act_gated(ACT)) load2<T>(zr + N + n, b0, b1);
  const DhcurPair r = dhcur_math<ACT>(a0, a1, b0, b1, d0, d1, gs);
  store2<T>(dzr + n, r.da0, r.da1);
  if constexpr (act_gated(ACT)) store2<T>(dzr + N + n, r.db0, r.db1);
  store2<T>(hg + (long long)s * ldhg + n, r.hg0, r.hg1);
  return r.p;
}
// epi_dhcur for interleaved z / dz (gated): the gate and up values of h columns n, n+1 are z's columns 2n .. 2n+3
// ([a0, b0, a1, b1]), read and written as two pairs.
template <typename T, int ACT>
__device__ __forceinline__ float epi_dhcur_interleaved(const T* z, long long ldz, T* dz, long long lddz, T* hg,
                                                       long long ldhg, int s, int n, float d0, float d1, float gs) {
  static_assert(act_gated(ACT), "interleaved z needs a gated activation");
  const T* zr = z + (long long)s * ldz + 2 * n;
  T* dzr = dz + (long long)s * lddz + 2 * n;
  float a0, a1, b0, b1;
  load2<T>(zr, a0, b0);
  load2<T>(zr + 2, a1, b1);
  const DhcurPair r = dhcur_math<ACT>(a0, a1, b0, b1, d0, d1, gs);
  store2<T>(dzr, r.da0, r.db0);
  store2<T>(dzr + 2, r.da1, r.db1);
  store2<T>(hg + (long long)s * ldhg + n, r.hg0, r.hg1);
  return r.p;
}

}  // namespace blz
