// Sort-free, atomic-free dispatch build (MoEBlaze's three phases), for blazecore/dispatch.py.
//
// The (L, K) expert ids are read as a flat array of N = L*K pairs in (token, k) order. The dispatch is
// the stable counting sort of that array by expert: within an expert, slots follow flat pair order,
// which is token order then k order. Pairs are cut into tiles of P = BLOCK * ITEMS consecutive pairs,
// one thread block per tile, and the build is three launches at most:
//
//   dispatch_count       phases 1+2: each block keeps its tile's token-expert map in registers (one
//                        expert id per pair) and counts pairs per expert with warp match/popc into
//                        warp-private shared-memory rows; writes tile_counts[tile, e] (num_tiles, E).
//   dispatch_scan_tiles  phase 2: per expert, the exclusive scan over tiles, in place, plus the expert
//                        totals. Skipped when the scatter blocks can sum tile_counts themselves
//                        (few tiles) or when there is a single tile.
//   dispatch_scatter     phase 3: re-reads its tile, ranks every pair among the tile's pairs of the
//                        same expert (warp match.any in pair order, then a scan over warps and experts),
//                        stages the tile in expert order in shared memory and writes slot_token and
//                        slot_k in runs of consecutive slots; pair_slot is written in pair order.
//                        Every block also scans the E expert totals to the expert offsets (E ints from
//                        L2); block 0 writes expert_offsets.
//
// Dropped pairs: an id of -1 routes the pair to no expert. The build counts such pairs in one more
// bucket, E, after the experts' (NB = E + 1 buckets), so they take the slots [expert_offsets[E], N) in
// pair order, and their pair_slot entries are -1; expert_offsets[E] is the number of routed pairs.
//
// No atomics anywhere (the results are the same bits every run) and no value read back by the host,
// so the build can be captured in a CUDA graph. Invalid ids are never trusted: a negative id goes to
// the dropped bucket and one >= E is clamped to E - 1 before it indexes anything, so a build with
// validate=False reads and writes only inside its arrays whatever the ids hold. dispatch_check is the
// optional value check.
//
// Index widths: N <= 2^31 - 1 (checked on the host), so pair and slot indices are 32-bit; offsets
// into the (num_tiles, E) matrix are 64-bit. Shared-memory words pack (expert << 16 | index < 2^16),
// so NB <= 65535 and P <= 65536 (the host's shared-memory check is far stricter than that).

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr unsigned kNoExpert = 0xffffu;  // marks a lane past the last pair; never a valid expert

// The bucket of an id: itself in [0, E), E (dropped) when negative, E - 1 when >= E (unvalidated).
template <typename IdT>
__device__ __forceinline__ unsigned clamp_expert(IdT v, int num_experts) {
    // Compare in IdT so an int64 id beyond the int32 range clamps instead of wrapping.
    if (v < IdT(0)) return unsigned(num_experts);
    if (v >= IdT(num_experts)) return unsigned(num_experts - 1);
    return unsigned(v);
}

__device__ __forceinline__ unsigned lanemask_lt() {
    return (1u << (threadIdx.x & 31)) - 1u;
}

// Phases 1+2 inside one tile. Warp w owns the pairs [tile_start + w*32*ITEMS, ... + 32*ITEMS); item j
// of lane l is pair (seg + 32*j + l), so each load instruction reads 32 consecutive ids. For each item
// the lanes holding the same expert find each other with match.any; the rank of a pair among the
// warp's earlier pairs of its expert is the warp-private running count plus the matching lanes below
// it, and the group's highest lane adds the group size to the running count (one writer per shared
// word, so no atomics). Leaves per-warp totals in cnt[w*NB + e] (NB = E + 1 buckets, the last for the
// dropped pairs) and (bucket << 16 | rank) in packed.
template <int BLOCK, int ITEMS, typename IdT>
__device__ __forceinline__ void rank_tile(const IdT* __restrict__ ids, unsigned n_pairs, int num_experts,
                                          unsigned tile_start, unsigned short* cnt, unsigned (&packed)[ITEMS]) {
    const unsigned lane = threadIdx.x & 31;
    const unsigned warp = threadIdx.x >> 5;
    const unsigned seg = tile_start + warp * (32u * ITEMS);
    // All loads first: ITEMS independent 128-byte (int32) or 256-byte (int64) requests per warp in flight.
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
        const unsigned p = seg + 32u * j + lane;
        packed[j] = p < n_pairs ? clamp_expert(ids[p], num_experts) : kNoExpert;
    }
    unsigned short* row = cnt + warp * (num_experts + 1);
    const unsigned lt = lanemask_lt();
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
        const unsigned e = packed[j];
        const unsigned same = __match_any_sync(kFull, e);
        const unsigned below = __popc(same & lt);
        unsigned before = 0;
        if (e != kNoExpert) before = row[e];
        __syncwarp();  // every lane of the group has read the count before its leader updates it
        if (e != kNoExpert && lane == 31u - __clz(same)) row[e] = (unsigned short)(before + __popc(same));
        __syncwarp();  // the update is visible to the next item, whichever lane leads it
        packed[j] = (e << 16) | (before + below);
    }
}

// Exclusive scans of a[0, n) and b[0, n) in shared memory, together. Each thread owns a contiguous run
// of ceil(n / BLOCK) entries (E <= 4096 at BLOCK = 256: at most 16 each). Callers sync before.
template <int BLOCK>
__device__ __forceinline__ void block_exclusive_scan2(int* a, int* b, int n, int* warp_sums) {
    constexpr int kWarps = BLOCK / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int per = (n + BLOCK - 1) / BLOCK;
    const int lo = min(n, int(threadIdx.x) * per), hi = min(n, lo + per);
    int sa = 0, sb = 0;
    for (int i = lo; i < hi; ++i) {
        sa += a[i];
        sb += b[i];
    }
    int ia = sa, ib = sb;  // inclusive scan over the warp
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int ua = __shfl_up_sync(kFull, ia, d), ub = __shfl_up_sync(kFull, ib, d);
        if (lane >= d) {
            ia += ua;
            ib += ub;
        }
    }
    if (lane == 31) {
        warp_sums[warp] = ia;
        warp_sums[kWarps + warp] = ib;
    }
    __syncthreads();
    int ra = ia - sa, rb = ib - sb;
    for (int w = 0; w < warp; ++w) {
        ra += warp_sums[w];
        rb += warp_sums[kWarps + w];
    }
    for (int i = lo; i < hi; ++i) {
        const int va = a[i], vb = b[i];
        a[i] = ra;
        b[i] = rb;
        ra += va;
        rb += vb;
    }
    __syncthreads();
}

__device__ __forceinline__ unsigned round_up16(unsigned bytes) {
    return (bytes + 15u) & ~15u;
}

}  // namespace

// Phases 1+2: per-(tile, expert) pair counts.
//   ids          (N,) IdT: expert id of each (token, k) pair, pair p = token * K + k
//   tile_counts  (num_tiles, NB) int32 out, num_tiles = gridDim.x = ceil(N / (BLOCK * ITEMS)), NB = E + 1
// Dynamic shared memory: (BLOCK / 32) * NB uint16 warp-private counters.
template <int BLOCK, int ITEMS, typename IdT>
__global__ void __launch_bounds__(BLOCK)
    dispatch_count(const IdT* __restrict__ ids, int n_pairs, int num_experts, int* __restrict__ tile_counts) {
    constexpr int kWarps = BLOCK / 32;
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned short* cnt = reinterpret_cast<unsigned short*>(smem);
    const int NB = num_experts + 1;
    unsigned* cnt_words = reinterpret_cast<unsigned*>(smem);
    for (int i = threadIdx.x; i < kWarps * NB / 2; i += BLOCK) cnt_words[i] = 0u;  // kWarps * NB is even
    __syncthreads();

    unsigned packed[ITEMS];
    const unsigned tile_start = blockIdx.x * unsigned(BLOCK * ITEMS);
    rank_tile<BLOCK, ITEMS, IdT>(ids, unsigned(n_pairs), num_experts, tile_start, cnt, packed);
    __syncthreads();

    int* out = tile_counts + (long long)blockIdx.x * NB;
    for (int e = threadIdx.x; e < NB; e += BLOCK) {
        int total = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) total += cnt[w * NB + e];
        out[e] = total;
    }
}

// Phase 2 over tiles: tile_counts[:, e] becomes its exclusive scan over tiles, in place, and
// expert_totals[e] the column sum, for the NB = E + 1 buckets (num_experts here is NB). Block b owns experts [8b, 8b + 8): thread (row group g, column c)
// sums a contiguous run of ceil(num_tiles / (BLOCK / 8)) rows, so a row is read as one 32-byte sector
// and up to 128 row groups (BLOCK = 1024) walk the rows in parallel.
//   tile_counts    (num_tiles, NB) int32, in/out
//   expert_totals  (NB,) int32 out
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK)
    dispatch_scan_tiles(int* __restrict__ tile_counts, int* __restrict__ expert_totals, int num_tiles, int num_experts) {
    constexpr int kCols = 8, kGroups = BLOCK / kCols, kPerLane = kGroups / 32;
    static_assert(kGroups % 32 == 0 && BLOCK / 32 >= kCols, "one warp scans each column's row groups");
    __shared__ int part[kGroups][kCols + 1];
    const int E = num_experts;
    const int c = threadIdx.x % kCols, g = threadIdx.x / kCols;
    const int e = blockIdx.x * kCols + c;
    const int chunk = (num_tiles + kGroups - 1) / kGroups;
    const int t0 = min(num_tiles, g * chunk), t1 = min(num_tiles, t0 + chunk);
    int sum = 0;
    if (e < E) {
#pragma unroll 8
        for (int t = t0; t < t1; ++t) sum += tile_counts[(long long)t * E + e];
    }
    part[g][c] = sum;
    __syncthreads();

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (warp < kCols) {  // warp w scans column w over the row groups; lane owns kPerLane groups
        int s = 0;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) s += part[lane * kPerLane + i][warp];
        int incl = s;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int u = __shfl_up_sync(kFull, incl, d);
            if (lane >= d) incl += u;
        }
        int run = incl - s;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            const int v = part[lane * kPerLane + i][warp];
            part[lane * kPerLane + i][warp] = run;
            run += v;
        }
        const int ew = blockIdx.x * kCols + warp;
        if (lane == 31 && ew < E) expert_totals[ew] = incl;
    }
    __syncthreads();

    if (e < E) {
        int run = part[g][c];
#pragma unroll 8
        for (int t = t0; t < t1; ++t) {
            const long long i = (long long)t * E + e;
            const int v = tile_counts[i];
            tile_counts[i] = run;
            run += v;
        }
    }
}

// Phase 3: every pair's final slot, written straight there.
//   ids             (N,) IdT, N = num_tokens * top_k
//   tile_counts     (num_tiles, NB) int32: mode 1 raw per-tile counts, mode 2 their exclusive scan over
//                   tiles (dispatch_scan_tiles); unread in mode 0 (a single tile), where the host
//                   passes any valid pointer for it and for expert_totals
//   expert_totals   (NB,) int32: pairs per bucket, read in mode 2 only
//   expert_offsets  (E + 1,) int32 out (block 0 writes it): the buckets' starts, the dropped one's last
//   slot_token, slot_k  (N,) int32 out: token and k of each slot, in expert order, the dropped pairs last
//   pair_slot       (N,) int32 out: slot of each pair (the (L, K) array, flat), -1 for a dropped pair
// Dynamic shared memory (bytes): 3 * 16-rounded 4 NB (totals, tile totals, per-bucket base) plus
// max(2 * (BLOCK / 32) * NB, 4 * BLOCK * ITEMS): the warp counters, later reused as the staged tile.
// __launch_bounds__(BLOCK, 1024 / BLOCK) caps registers at 64: 1024 threads per SM, so two or more
// blocks per SM overlap one tile's loads with another's ranking (ITEMS = 16 fits 64 without spills).
template <int BLOCK, int ITEMS, typename IdT>
__global__ void __launch_bounds__(BLOCK, 1024 / BLOCK)
    dispatch_scatter(const IdT* __restrict__ ids, int n_pairs, int top_k, int num_experts,
                     const int* __restrict__ tile_counts, const int* __restrict__ expert_totals, int mode,
                     int num_tiles, int* __restrict__ expert_offsets, int* __restrict__ slot_token,
                     int* __restrict__ slot_k, int* __restrict__ pair_slot) {
    constexpr int kWarps = BLOCK / 32;
    constexpr unsigned kTile = BLOCK * ITEMS;
    static_assert(kTile <= 65536, "tile-local indices are packed into 16 bits");
    __shared__ int warp_sums[2 * kWarps];
    extern __shared__ __align__(16) unsigned char smem[];
    const int E = num_experts, NB = E + 1;
    const unsigned e_bytes = round_up16(4u * NB);
    int* s_total = reinterpret_cast<int*>(smem);                  // expert totals -> expert offsets
    int* s_local = reinterpret_cast<int*>(smem + e_bytes);        // tile totals -> tile-local offsets
    int* s_base = reinterpret_cast<int*>(smem + 2 * e_bytes);     // tile base -> slot = s_base[e] + pos
    unsigned short* cnt = reinterpret_cast<unsigned short*>(smem + 3 * e_bytes);
    unsigned* stage = reinterpret_cast<unsigned*>(smem + 3 * e_bytes);  // reuses cnt after the ranks
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    unsigned* cnt_words = reinterpret_cast<unsigned*>(cnt);
    for (int i = threadIdx.x; i < kWarps * NB / 2; i += BLOCK) cnt_words[i] = 0u;
    __syncthreads();

    unsigned packed[ITEMS];
    const unsigned tile = blockIdx.x;
    const unsigned tile_start = tile * kTile;
    rank_tile<BLOCK, ITEMS, IdT>(ids, unsigned(n_pairs), E, tile_start, cnt, packed);
    __syncthreads();

    // Per bucket: counters become exclusive over warps; the tile total; where the tile's run of this
    // bucket starts among the bucket's slots (tile base), and the bucket's total.
    for (int e = threadIdx.x; e < NB; e += BLOCK) {
        int run = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const int v = cnt[w * NB + e];
            cnt[w * NB + e] = (unsigned short)run;
            run += v;
        }
        s_local[e] = run;
        int base = 0, total = run;
        if (mode == 1) {
            base = 0;
            total = 0;
#pragma unroll 8
            for (int t = 0; t < num_tiles; ++t) {  // num_tiles <= 32 in this mode (host plan)
                const int v = tile_counts[(long long)t * NB + e];
                base += (t < int(tile)) ? v : 0;
                total += v;
            }
        } else if (mode == 2) {
            base = tile_counts[(long long)tile * NB + e];
            total = expert_totals[e];
        }
        s_base[e] = base;
        s_total[e] = total;
    }
    __syncthreads();
    block_exclusive_scan2<BLOCK>(s_total, s_local, NB, warp_sums);

    for (int e = threadIdx.x; e < NB; e += BLOCK) {
        const int lo = s_local[e];
#pragma unroll
        for (int w = 0; w < kWarps; ++w) cnt[w * NB + e] = (unsigned short)(cnt[w * NB + e] + lo);
        s_base[e] = s_total[e] + s_base[e] - lo;
        if (tile == 0) expert_offsets[e] = s_total[e];  // e = E: the routed pairs' count
    }
    __syncthreads();

    // Tile-local position of each pair: its (warp, expert) base plus its rank in the warp.
    const unsigned seg = tile_start + warp * (32u * ITEMS);
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
        const unsigned e = packed[j] >> 16;
        if (e != kNoExpert) {
            const unsigned pos = cnt[warp * NB + e] + (packed[j] & 0xffffu);
            // coalesced: pairs in order; a dropped pair (bucket E) has a slot but no slot of its own to name
            pair_slot[seg + 32u * j + lane] = e == unsigned(E) ? -1 : s_base[e] + int(pos);
            packed[j] = (e << 16) | pos;
        }
    }
    __syncthreads();  // the counters are dead from here; their memory holds the staged tile
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
        const unsigned e = packed[j] >> 16;
        if (e != kNoExpert) stage[packed[j] & 0xffffu] = (e << 16) | (warp * (32u * ITEMS) + 32u * j + lane);
    }
    __syncthreads();

    // Staged in expert order: consecutive positions of one expert go to consecutive slots, so a warp's
    // stores form a few contiguous runs instead of 32 scattered words.
    const unsigned n_tile = min(kTile, unsigned(n_pairs) - tile_start);
    const unsigned k = unsigned(top_k);
    for (unsigned j = threadIdx.x; j < n_tile; j += BLOCK) {
        const unsigned v = stage[j];
        const int slot = s_base[v >> 16] + int(j);
        const unsigned pair = tile_start + (v & 0xffffu);
        const unsigned token = pair / k;
        slot_token[slot] = int(token);
        slot_k[slot] = int(pair - token * k);
    }
}

// Optional value check (validate=True): for each block, the smallest flat index t*K + k of an invalid
// pair among the rows it visits, or INT_MAX. Invalid: id outside [0, E) other than -1 (a dropped pair,
// any number of them a row), or an id in [0, E) equal to one at a smaller k of the same row. The host
// reads the gridDim.x results.
//   ids             (L, K) IdT
//   block_first_bad (gridDim.x,) int32 out
// K <= 32: a row is a group of G = next_pow2(K) lanes, 32 / G rows per warp step; duplicates are found
// with one match.any on (row in warp, id). K > 32: a warp per row, 32 ids at a time, and a per-warp
// byte map of E flags in dynamic shared memory marks the ids of earlier chunks (cleared after the row).
template <typename IdT>
__global__ void __launch_bounds__(256)
    dispatch_check(const IdT* __restrict__ ids, int num_tokens, int top_k, int num_experts,
                   int* __restrict__ block_first_bad) {
    constexpr int kWarps = 256 / 32;
    constexpr int kNone = 0x7fffffff;
    __shared__ int warp_best[kWarps];
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned lt = lanemask_lt();
    const int K = top_k, E = num_experts;
    const int gwarp = blockIdx.x * kWarps + warp, nwarps = gridDim.x * kWarps;
    int best = kNone;

    if (K <= 32) {
        int group = 1;
        while (group < K) group <<= 1;
        const int rows_per_warp = 32 / group;
        const int sub = lane / group, k = lane % group;
        for (long long row0 = (long long)gwarp * rows_per_warp; row0 < num_tokens;
             row0 += (long long)nwarps * rows_per_warp) {
            const long long t = row0 + sub;
            const bool active = t < num_tokens && k < K;
            const IdT v = active ? ids[t * K + k] : IdT(0);
            const bool in_range = active && v >= IdT(0) && v < IdT(E);
            const unsigned long long key = in_range ? ((unsigned long long)sub << 32) | (unsigned long long)v
                                                    : (1ull << 63) | (unsigned long long)lane;
            const unsigned same = __match_any_sync(kFull, key);
            const bool dup = in_range && (same & lt) != 0u;
            if (active && ((!in_range && v != IdT(-1)) || dup)) best = min(best, int(t * K + k));
        }
    } else {
        unsigned char* seen = smem + warp * round_up16(unsigned(E));
        for (int i = lane; i < E; i += 32) seen[i] = 0;
        __syncwarp();
        for (long long t = gwarp; t < num_tokens; t += nwarps) {
            for (int k0 = 0; k0 < K; k0 += 32) {
                const int k = k0 + lane;
                const bool active = k < K;
                const IdT v = active ? ids[t * K + k] : IdT(0);
                const bool in_range = active && v >= IdT(0) && v < IdT(E);
                const unsigned key = in_range ? unsigned(v) : (0x80000000u | unsigned(lane));
                const unsigned same = __match_any_sync(kFull, key);
                const bool dup = in_range && ((same & lt) != 0u || seen[unsigned(v)] != 0);
                __syncwarp();
                if (in_range && (same & lt) == 0u) seen[unsigned(v)] = 1;  // the group's lowest lane marks it
                __syncwarp();
                if (active && ((!in_range && v != IdT(-1)) || dup)) best = min(best, int(t * K + k));
            }
            for (int k0 = 0; k0 < K; k0 += 32) {  // clear the row's marks (lanes store the same 0)
                const int k = k0 + lane;
                if (k < K) {
                    const IdT v = ids[t * K + k];
                    if (v >= IdT(0) && v < IdT(E)) seen[unsigned(v)] = 0;
                }
            }
            __syncwarp();
        }
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) best = min(best, __shfl_xor_sync(kFull, best, d));
    if (lane == 0) warp_best[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        int b = warp_best[0];
#pragma unroll
        for (int w = 1; w < kWarps; ++w) b = min(b, warp_best[w]);
        block_first_bad[blockIdx.x] = b;
    }
}
