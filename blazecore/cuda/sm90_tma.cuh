// Tensor memory accelerator (TMA) wrappers for the sm_90a kernels: tensor-map tiles copied from global to shared
// memory by cp.async.bulk.tensor, completing on an mbarrier through its transaction count.
//
// The tensor map (CUtensorMap, 128 bytes, 64-byte aligned) is encoded on the host by the driver
// (cuTensorMapEncodeTiled, see blazecore/_tma.py) and passed by value as a __grid_constant__ kernel parameter, so
// the copy engine reads it from parameter space: no global-memory copy of the map, hence no tensormap proxy fence
// (fence.proxy.tensormap) and nothing to upload before a launch (a CUDA graph captures the map with the launch).
// The instructions take the map's generic address (&param).
//
// Completion: the issuing thread arrives on the stage's mbarrier with expect_tx(bytes of every box it issues for
// that stage) and then issues the boxes; each box's completion subtracts its bytes (a box partly or wholly out of
// the tensor's bounds is zero-filled and still counts its full size). The phase completes when every expected
// arrival came and the transaction count is back at zero, so one barrier can also count cp.async arrivals.
#pragma once

namespace blz {
namespace sm90 {

// Same size and alignment as the driver's CUtensorMap; opaque here.
struct alignas(64) TmaMap {
  unsigned long long opaque[16];
};

// Pull the map into the copy engine's descriptor cache ahead of the first copy (once per CTA).
__device__ __forceinline__ void tma_prefetch_map(const TmaMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// Arrive on the barrier and raise its pending transaction count by `bytes` (this phase).
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// One box of a 2-D / 3-D / 4-D tiled tensor map at element coordinates (c0 innermost, ...) into shared memory at dst
// (1024-byte aligned for the 128-byte swizzle); completes `bytes = box size` on the mbarrier bar.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TmaMap* map, unsigned bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(unsigned dst, const TmaMap* map, unsigned bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TmaMap* map, unsigned bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, "
      "%6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// The same box multicast into the shared memory of every CTA of the cluster in `mask` (bit r: CTA rank r), at the same
// offset dst and completing on the mbarrier at the same offset bar in each of them.
__device__ __forceinline__ void tma_load_2d_mc(unsigned dst, const TmaMap* map, unsigned bar, int c0, int c1,
                                               unsigned short mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster "
      "[%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0), "r"(c1), "h"(mask)
      : "memory");
}

// ---- clusters --------------------------------------------------------------------------------------------
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// The shared::cluster address of this CTA's shared-memory address a in the CTA of rank `rank`.
__device__ __forceinline__ unsigned map_to_rank(unsigned a, unsigned rank) {
  unsigned d;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(rank));
  return d;
}
// Arrive (release, cluster scope) on an mbarrier of another CTA of the cluster (a shared::cluster address).
// (Release at CTA scope, as a local arrival: the arriving warp's wgmmas are done reading the stage. The cluster-scope
// form, .release.cluster, made the 2-CTA weight gradients 20-40% slower than one CTA a tile.)
__device__ __forceinline__ void mbar_arrive_cluster(unsigned remote_bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote_bar) : "memory");
}

// Make this CTA's mbarrier initialisation visible to the cluster (before the cluster barrier that publishes it).
__device__ __forceinline__ void fence_mbarrier_init_cluster() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Every thread of every CTA of the cluster arrives, then waits for all of them.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// Stores: one box of shared memory at src (laid out as the map's swizzle puts it: 128-byte swizzle, src 1024-byte
// aligned; 64-byte swizzle, 512) to the 2-D map at (c0, c1); elements outside the map's bounds are not written. The
// issuing thread groups its stores (commit) and waits for them to have read shared memory (before the staging is
// rewritten) or to be complete (before the CTA exits); the writer threads fence their generic stores to the staging
// (fence_proxy_async_smem) before the issuing thread reads them through the async proxy.
__device__ __forceinline__ void tma_store_2d(const TmaMap* map, unsigned src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n"
               ::"l"(reinterpret_cast<unsigned long long>(map)), "r"(src), "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ void tma_store_3d(const TmaMap* map, unsigned src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n"
               ::"l"(reinterpret_cast<unsigned long long>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
// Whether a map was given (the host passes an all-zero map for "none").
__device__ __forceinline__ bool tma_map_given(const TmaMap* map) {
  unsigned long long v = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) v |= map->opaque[i];
  return v != 0ull;
}

}  // namespace sm90
}  // namespace blz
