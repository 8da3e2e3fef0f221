// The expert GEMMs' arguments: one struct per GEMM family, passed to the kernels by value.
//   MGroupedArgs: the M-grouped GEMMs (gemm1, gemm2, dh', dx) of moe_gemm (MODE_M) and moe_gemm_sm90;
//   KGroupedArgs: the K-grouped weight gradients (dw13, dw2) of moe_gemm (MODE_K) and moe_wgrad_sm90.
// blazecore/_moe_args.py mirrors both field for field (NumPy structured dtypes with C alignment);
// tests/test_kernel_config.py checks every offset and the size against these definitions.
// Field order: 8-byte fields (pointers, then 64-bit strides and offsets), then 32-bit ones, so the layout has no
// holes but the tail padding to a multiple of 8. The layout does not depend on T.
#pragma once

namespace blz {

// M-grouped: C[s, n] = sum_k A[row(s), k] * B_e[n, k] for the slots s of expert e, row(s) = slot_token[s] (A
// gathered) or s. Strides and offsets are in elements.
template <typename T> struct MGroupedArgs {
  const T* A;                // (rows, lda): x or dy (gathered), hcur, z or dz (slot order)
  const T* B;                // weights, expert e at B + e * b_estride: (N, Kd) K-major or (Kd, N) N-major
  const int* slot_token;     // (L*K) token of each slot: A's gather map and the gate lookup
  const int* slot_k;         // (L*K) top-k position of each slot (gate lookup)
  const int* offsets;        // (E + 1) expert_offsets
  const int* tile_offsets;   // (E + 1) cumulative m-tiles per expert (moe_tile_offsets)
  T* out;                    // EPI_ACT: hcur; EPI_ROWSCALE: rows; EPI_DHCUR: dz (may be aux itself)
  T* out2;                   // EPI_ACT: z; EPI_DHCUR: g * hcur
  const T* aux;              // EPI_DHCUR: z, read before dz is written over it
  const T* bias;             // (E, ...) bias rows, expert e at bias + e * bias_estride; null: none
  const float* gates;        // (L, topk) gates; EPI_ROWSCALE: null scales by 1
  float* part;               // EPI_DHCUR: (L*K, part_ld) fp32 dgates partial sums, one column per n-tile
  long long lda, ldb, b_estride;
  long long ldo, ldo2, ldaux, bias_estride;
  long long up;              // gated EPI_ACT: the up half's offset in B's rows (N-major: columns) and in the bias;
                             // EPI_DHCUR: the up half's column offset in z and dz; 0 means N (a launch over a
                             // column slice of h passes h)
  int num_experts, N, Kd;    // output columns (of h, gated EPI_ACT), reduction length (> 0)
  int topk, part_ld;
  int store_h, store_z;      // EPI_ACT: write hcur to out / z to out2 (0 or 1)
  static constexpr int FIELDS = 27;  // the number of fields above (the layout test checks the mirror has as many)
};

// K-grouped: W_e[m, n] = sum over the slots s of expert e, in slot order, of A[rowA(s), m] * B[rowB(s), n],
// rowA / rowB = slot_token[s] for a gathered operand, else s; W_e at out + e * o_estride, rows ldo apart.
template <typename T> struct KGroupedArgs {
  const T* A;                // (rows, lda)
  const T* B;                // (rows, ldb)
  const int* slot_token;     // (L*K) gather map
  const int* offsets;        // (E + 1) expert_offsets
  const int* kblocks;        // (E, num_kblocks) token-block starts (KTileWalk); null with num_kblocks <= 1
  T* out;                    // (E, M, N) or, for a transposed store, (E, N, M)
  float* carry;              // fp32 partial sums of a chunked backward (one slice per CTA); null: none
  const int* carry_seen;     // (E) experts that had slots in an earlier chunk
  long long lda, ldb, ldo, o_estride;
  int num_experts, M, N, num_kblocks;
  int carry_in;              // continue the sums an earlier launch left in carry (experts in carry_seen)
  int carry_out;             // leave the fp32 sums in carry for a later launch instead of writing W
  int a_off32, b_off32;      // every byte offset into A's (B's) rows from its pointer fits 32 bits (shorter addressing)
  static constexpr int FIELDS = 20;
};

}  // namespace blz
