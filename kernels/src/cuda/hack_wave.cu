
// ---- A whole wave-index decode step over 2-bit rows on the GPU (appended after wave.cu) ----
// The layer's rows are value blocks of Π = 64 rows in the group layout (hack.cu), each
// spread over a few arena blocks (pages); each cluster's rows are a run of its segment's
// value blocks, listed as pieces (value block, row mask). A step is wave.cu's: scoring and
// top-r of the centroids, then hack_expand (the retrieved clusters' pieces as one list per
// head, each page looked up in the Gpu tier's slot table), hack_arena_g{G} (homomorphic
// attention over the listed pieces, reading each page from the Gpu tier or zero-copy from
// the pinned Host arena, the queries quantized by every CTA), the steady zone in f16 through
// wave_expand with no cluster and attn_partial, est_partial, and attn_merge over all three.

#if HEAD_DIM % 64 == 0

// The listed pieces as hack_expand resolved them: entry i of head h (at h·cap + i) has its
// value block's page addresses at list_addr[(h·cap + i)·MAX_PAGES…] (each in the Gpu tier or
// the pinned Host arena, 0 past the block's last page), its row count and its row mask. The
// three loads are independent: one memory round trip per piece (resolving the pages through
// the group and slot tables here took three dependent ones).
struct HackArenaSrc : HackPagedSrc {
  const unsigned long long* list_addr; const int* list_rows; const unsigned long long* list_mask; int cap;
  __device__ unsigned long long at(int h, int i) {
    const long long e = (long long)h * cap + i;
    if (threadIdx.x < MAX_PAGES) hack_pages_s[threadIdx.x] = list_addr[e * MAX_PAGES + threadIdx.x];
    set_rows(list_rows[e]);
    return list_mask[e];
  }
};

// One CTA per (slice of the head's listed pieces, KV head): the head's counts[h] pieces are
// spread evenly over the gridDim.x CTAs of the head (the count changes step by step, the
// grid does not). Partials in attn_partial's layout ([kv_head][chunk][g][PART]).
#define HACK_ARENA(G)                                                                                        \
  extern "C" __global__ void hack_arena_g##G(                                                               \
      const unsigned long long* __restrict__ list_addr, const int* __restrict__ list_rows,                   \
      const unsigned long long* __restrict__ list_mask, const int* __restrict__ counts, int cap,             \
      int page_bytes, const float* __restrict__ q, float scale, float* __restrict__ part) {                  \
    HackArenaSrc src;                                                                                        \
    src.list_addr = list_addr; src.list_rows = list_rows; src.list_mask = list_mask; src.cap = cap;          \
    src.pages = nullptr; src.masks = nullptr; src.rows_of = nullptr; src.n_sel = 0;                          \
    src.page_bytes = page_bytes; src.page_shift = page_bytes & (page_bytes - 1) ? -1 : __ffs(page_bytes) - 1; \
    src.vc_off = src.kmin_off = src.kscale_off = src.ksum_off = src.vmin_off = src.vscale_off = 0;           \
    const int listed = counts[blockIdx.y];                                                                   \
    const int per = (listed + gridDim.x - 1) / gridDim.x;                                                    \
    hack_attend<G>(src, listed, nullptr, nullptr, q, scale, per, part);                                      \
  }
HACK_ARENA(1)
HACK_ARENA(2)
HACK_ARENA(3)
HACK_ARENA(4)
HACK_ARENA(5)
HACK_ARENA(6)
HACK_ARENA(7)
HACK_ARENA(8)

// The retrieved clusters' pieces as one list per head (at h·cap), CTAs (h, ·) serving KV
// head h, each computing the head's piece offsets (an exclusive scan over its r selected
// clusters, in its slice of `scan`, kv_heads × gridDim.y × (r + 1) ints) and writing the
// pieces of every gridDim.y-th cluster, a warp per cluster: each piece's row mask, row count
// and page addresses (group_pages[g·MAX_PAGES…], −1 past the last, each read from Gpu slot
// table[s] of the tier at gpu_base when the buffer manager's table holds it there, else
// from the pinned Host arena at host_base; 0 past the last). Writes counts[h] (pieces), and in
// `flags` (device memory, copied to the job's mailbox by the merge) the selection as
// wave_expand does (kv_heads × r: cluster c, or −c−1 when a page of it was not in the Gpu
// tier) followed by the listed value blocks (kv_heads × cap: the block's id, or −id−1 when a
// page of it was not in the Gpu tier; INT_MAX past the head's count).
extern "C" __global__ void hack_expand(const int* __restrict__ sel, int r, const int* __restrict__ bounds, int n,
                                       const int* __restrict__ piece_group,
                                       const unsigned long long* __restrict__ piece_mask,
                                       const int* __restrict__ group_pages, const int* __restrict__ group_ids,
                                       const int* __restrict__ group_rows, const int* __restrict__ table,
                                       unsigned long long host_base, unsigned long long gpu_base, int page_bytes,
                                       int cap, int* __restrict__ scan, unsigned long long* __restrict__ list_addr,
                                       int* __restrict__ list_rows, unsigned long long* __restrict__ list_mask,
                                       int* __restrict__ counts, int* __restrict__ flags) {
  const int h = blockIdx.x, kv_heads = gridDim.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int* b = bounds + (long long)h * (n + 1);
  int* mine = scan + (long long)(h * gridDim.y + blockIdx.y) * (r + 1);
  for (int i = threadIdx.x; i < r; i += blockDim.x) {
    const int c = sel[h * r + i];
    mine[i] = b[c + 1] - b[c];
  }
  __syncthreads();
  const int total = block_exclusive_scan(mine, r);
  int* block_flags = flags + (long long)kv_heads * r + (long long)h * cap;
  if (blockIdx.y == 0) {
    if (threadIdx.x == 0) counts[h] = total;
    for (int j = total + threadIdx.x; j < cap; j += blockDim.x) block_flags[j] = 0x7fffffff;
  }
  for (int i = blockIdx.y + gridDim.y * warp; i < r; i += gridDim.y * warps) {
    const int c = sel[h * r + i], lo = b[c], hi = b[c + 1], out = mine[i];
    bool missed = false;
    for (int p = lo + lane; p < hi; p += 32) {
      const int g = piece_group[p];
      const long long e = (long long)h * cap + out + (p - lo);
      list_rows[e] = group_rows[g];
      list_mask[e] = piece_mask[p];
      bool miss = false;
      for (int k = 0; k < MAX_PAGES; k++) {
        const int s = group_pages[g * MAX_PAGES + k];
        unsigned long long a = 0;
        if (s >= 0) {
          const int slot = table != nullptr ? table[s] : -1;
          miss |= slot < 0;
          a = slot >= 0 ? gpu_base + (unsigned long long)slot * page_bytes
                        : host_base + (unsigned long long)s * page_bytes;
        }
        list_addr[e * MAX_PAGES + k] = a;
      }
      const int id = group_ids[g];
      block_flags[out + (p - lo)] = miss ? -id - 1 : id;
      missed |= miss;
    }
    // `i` is the same for the whole warp: every lane votes.
    missed = __any_sync(0xffffffffu, missed);
    if (lane == 0) flags[h * r + i] = missed ? -c - 1 : c;
  }
}

#endif  // HEAD_DIM % 64 == 0
