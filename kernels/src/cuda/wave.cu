
// ---- A whole wave-index decode step on the GPU (appended to decode.cu) ----
// Per KV head the layer's rows are laid out cluster after cluster (rows 0..indexed, cluster
// c at offsets[c]..offsets[c+1]), then the steady zone (sink and local window) at
// indexed..rows. A step is: scoring + top-r of the centroids (decode.cu's selection),
// wave_expand (the retrieved clusters and the steady zone as one row list, Gpu-tier hits as
// cache rows), attn_partial over those rows, est_partial over every cluster not retrieved,
// and attn_merge over both kinds of partials. No step needs the host.

// Exclusive prefix sum of v[0..n) in place by the whole CTA (blockDim.x a multiple of 32,
// at most 1024); returns the total to every thread.
__device__ int block_exclusive_scan(int* v, int n) {
  __shared__ int warp_sums[32];
  __shared__ int carry;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < n; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const int x = i < n ? v[i] : 0;
    const int incl = warp_inclusive_scan(x);
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      const int w = warp_inclusive_scan(lane < warps ? warp_sums[lane] : 0);
      if (lane < warps) warp_sums[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int before = carry + (warp > 0 ? warp_sums[warp - 1] : 0);
    if (i < n) v[i] = before + incl - x;
    __syncthreads();
    if (threadIdx.x == 0) carry += warp_sums[warps - 1];
    __syncthreads();
  }
  return carry;
}

// Sum of x over the CTA (every thread gets it).
__device__ int block_sum(int x) {
  __shared__ int part[32];
  __shared__ int total;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  if (lane == 0) part[warp] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    int t = 0;
    for (int w = 0; w < warps; w++) t += part[w];
    total = t;
  }
  __syncthreads();
  return total;
}

// Row list entry of row t of head h: a cache row when t's block is in the Gpu tier
// (block_slot[h][t / block_rows] = s ≥ 0: cache row s·slot_rows + t % block_rows, encoded
// −row−1), else t. A layer's own table names first cache rows (slot_rows 1); the buffer
// manager's table names Gpu slots of whole blocks (slot_rows = rows per block) and is shared
// by every head (blocks_per_head 0).
__device__ __forceinline__ int row_ref(const int* __restrict__ block_slot, int h, int blocks_per_head,
                                       int block_rows, int slot_rows, int t) {
  if (block_slot != nullptr) {
    const int s = block_slot[h * blocks_per_head + t / block_rows];
    if (s >= 0) return -(s * slot_rows + t % block_rows) - 1;
  }
  return t;
}

__device__ __forceinline__ int cluster_len(const int* __restrict__ offsets, int n, int h, int c) {
  const int* off = offsets + (long long)h * (n + 1);
  return off[c + 1] - off[c];
}

// CTAs (h, ·) serve KV head h. The head's elements are [steady zone, retrieved cluster 0, …, r−1];
// heads' lists follow each other in `list` (head h starts after every row of heads < h, which
// each CTA sums itself). Each CTA's slice of `scan` (kv_heads × gridDim.y × (r + 1) ints)
// receives the elements' lengths, then their start positions. Writes list_offsets
// (kv_heads + 1), the rows (one warp per element), and in `flags` (kv_heads × r, device
// memory) the selection as the host gets it: cluster c, or −c−1 when a row of it was not in
// the Gpu tier at this step. attn_merge copies `flags` to the job's mapped mailbox at the end
// of the step: mapped writes here, late in the step's first half, slowed batched steps.
// Two layouts: rows of the head's KV (clusters at offsets, the steady zone at indexed..rows),
// or, with `row_map` and `steady_len` (an engine layer homed in the buffer manager), cluster
// row t of head h at KV row row_map[h·indexed + t] (a shared arena, head stride 0) and a
// device steady zone of *steady_len rows, row i of head h at steady row i·kv_heads + h after
// the cache's cache_rows rows (so the launch's row count does not change as tokens append).
extern "C" __global__ void wave_expand(const int* __restrict__ sel, int r, const int* __restrict__ offsets, int n,
                                       int kv_heads, int indexed, int rows, const int* __restrict__ block_slot,
                                       int block_rows, int blocks_per_head, int slot_rows,
                                       const int* __restrict__ row_map, const int* __restrict__ steady_len,
                                       int cache_rows, int* __restrict__ scan, int* __restrict__ list,
                                       int* __restrict__ list_offsets, int* __restrict__ flags) {
  const int h = blockIdx.x, per = r + 1;
  const int steady = steady_len != nullptr ? *steady_len : rows - indexed;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  // gridDim.y CTAs share a head: each computes the head's offsets (cheap) and writes the
  // rows of every gridDim.y-th element; the first also writes the list offsets.
  const bool first = blockIdx.y == 0;
  int before = 0;
  for (int e = threadIdx.x; e < h * r; e += blockDim.x) before += cluster_len(offsets, n, e / r, sel[e]);
  const int start = block_sum(before) + h * steady;
  int* mine = scan + (long long)(h * gridDim.y + blockIdx.y) * per;  // this CTA's own scratch
  for (int i = threadIdx.x; i < per; i += blockDim.x) {
    int len = steady;
    if (i > 0) {
      const int c = sel[h * r + i - 1];
      len = cluster_len(offsets, n, h, c);
    }
    mine[i] = len;
  }
  __syncthreads();
  const int total = block_exclusive_scan(mine, per);
  if (first && threadIdx.x == 0) {
    list_offsets[h] = start;
    if (h == kv_heads - 1) list_offsets[kv_heads] = start + total;
  }
  // The CTAs of a head take its elements in turn, a warp per element.
  for (int i = blockIdx.y + gridDim.y * warp; i < per; i += gridDim.y * warps) {
    int* out = list + start + mine[i];
    if (i == 0 && steady_len != nullptr) {
      for (int t = lane; t < steady; t += 32) out[t] = -(cache_rows + t * kv_heads + h) - 1;
      continue;
    }
    int lo = indexed, hi = indexed + steady, c = -1;
    if (i > 0) {
      c = sel[h * r + i - 1];
      const int* off = offsets + (long long)h * (n + 1);
      lo = off[c];
      hi = off[c + 1];
    }
    const int* map = row_map != nullptr ? row_map + (long long)h * indexed : nullptr;
    bool kv_read = false;  // a row of this element is read from the KV rows, not the cache
    for (int t = lo + lane; t < hi; t += 32) {
      const int ref = row_ref(block_slot, h, blocks_per_head, block_rows, slot_rows, map ? map[t] : t);
      out[t - lo] = ref;
      kv_read |= ref >= 0;
    }
    // Cluster c, or −c−1 when a row of it was not in the Gpu tier at this step (a miss the
    // host may want admitted). `i` is the same for the whole warp: every lane votes.
    const bool missed = __any_sync(0xffffffffu, kv_read);
    if (i > 0 && lane == 0) flags[h * r + i - 1] = missed ? -c - 1 : c;
  }
}

// The estimation zone: one CTA per (chunk of `per_cta` clusters, KV head) folds every cluster
// not marked (mark ≠ 0: retrieved this step) as one row whose score is its centroid's (kept
// by score_filter in `group_scores`, [h][g][n], scaled), whose value is the mean value and
// whose weight is its size: mass size·e^{q·c}, value size·e^{q·c}·mean. The same tiles as
// attention (decode.cu), with the scores read instead of computed. Writes the CTA's partial
// as chunk blockIdx.x of `part`. Each mark is read by exactly one thread, which clears it for
// the next step (so a step's launches take no per-step argument and can be replayed from a
// graph).
template <int G>
__device__ __forceinline__ void est_tiles(const float* __restrict__ group_scores,
                                          const unsigned short* __restrict__ vmean,
                                          const float* __restrict__ log_size, int n, int* __restrict__ mark,
                                          int per_cta, float* __restrict__ part) {
  __shared__ __align__(16) unsigned short vs[TILE * HEAD_DIM];
  __shared__ const unsigned short* vr[TILE];
  __shared__ float bias[TILE];
  __shared__ TileState<G> st;
  const int h = blockIdx.y;
  const int lo = blockIdx.x * per_cta, hi = min(n, lo + per_cta);
  const long long head = (long long)h * n;
  float o[OUT2(G)][2];
  tile_init<G>(st, o);
  for (int t0 = lo; t0 < hi; t0 += TILE) {
    if (threadIdx.x < TILE) {
      const int c = t0 + threadIdx.x;
      float b = NEG_INF;
      if (c < hi) {
        if (mark[head + c] != 0) mark[head + c] = 0;
        else b = log_size[head + c];  // −inf for an empty cluster
      }
      bias[threadIdx.x] = b;
      vr[threadIdx.x] = b == NEG_INF ? nullptr : vmean + (head + c) * HEAD_DIM;
    }
    __syncthreads();
    tile_stage<false>(nullptr, vr, nullptr, vs);  // mean values only
    float s[PAIRS(G)];
#pragma unroll
    for (int j = 0; j < PAIRS(G); j++) {
      const int pi = threadIdx.x + TILE_THREADS * j, r = pi % TILE, g = pi / TILE;
      s[j] = NEG_INF;
      if (g < G && bias[r] != NEG_INF) s[j] = group_scores[((long long)h * G + g) * n + t0 + r] + bias[r];
    }
    tile_fold<G>(s, vs, st, o);
  }
  tile_write<G>(st, o, part + ((long long)(h * gridDim.x + blockIdx.x) * G) * PART);
}

#define EST_PARTIAL(G)                                                                                         \
  extern "C" __global__ void __launch_bounds__(TILE_THREADS) est_partial_g##G(                                \
      const float* __restrict__ group_scores, const unsigned short* __restrict__ vmean,                       \
      const float* __restrict__ log_size, int n, int* __restrict__ mark, int per_cta, float* __restrict__ part) { \
    est_tiles<G>(group_scores, vmean, log_size, n, mark, per_cta, part);                                      \
  }
EST_PARTIAL(1)
EST_PARTIAL(2)
EST_PARTIAL(3)
EST_PARTIAL(4)
EST_PARTIAL(5)
EST_PARTIAL(6)
EST_PARTIAL(7)
EST_PARTIAL(8)

// The head of every wave step: the job's queries into the device buffers the selection
// (`q_a`) and the attention (`q_b`) read, one 16-byte word (four floats) per thread (the
// host launches enough CTAs), from one of two places the job's I/O descriptor `io_desc`
// (mapped; IO_* words, decode.cu) names: the job's mapped pinned mailbox `q_src`, or, when
// its IO_QUERY word is not 0, the caller's device tensor there (f32, f16 or bf16: an
// embedding runtime's query read in place, no copy through the host). A non-finite element of
// a caller's query is read as 0; the step's token goes to the device descriptor's IO_BAD word
// (so attn_merge writes no caller output) and its index + 1 and bits to `io_status` (mapped,
// zeroed by the host) for the host to report. CTA 0 copies the descriptor to `io_dev` for
// attn_merge. Then CTA 0, for an arena layer (`marks` not null), the steady zone.
// That zone arrives through mapped pinned staging laid out like the device zone (row i of
// every head at i·row_words 16-byte words, keys then values): the host writes rows and then
// marks[0] = its length and marks[1] = min(marks[1], the first row it changed). CTA 0 copies
// rows [min(*dev_len, marks[1]), marks[0]) to the device zone, sets *dev_len = marks[0] and
// marks[1] = INT_MAX. So a step's launches take no per-step argument and the host makes no
// copy call, whatever was appended: one kernel node instead of copy nodes. For a 2-bit layer
// (`q8` not null, HEAD_DIM % 64 == 0) each CTA then quantizes its own words' queries to 8
// bits once for the step's hack_arena CTAs (hack_quantize_partition).
#define INGEST_THREADS 256
extern "C" __global__ void __launch_bounds__(INGEST_THREADS) step_ingest(const uint4* __restrict__ q_src, uint4* __restrict__ q_a,
                                       uint4* __restrict__ q_b, int q_words,
                                       const unsigned long long* __restrict__ io_desc,
                                       unsigned long long* __restrict__ io_dev, int* __restrict__ io_status,
                                       const uint4* __restrict__ stage_k,
                                       const uint4* __restrict__ stage_v, int* marks, uint4* __restrict__ k,
                                       uint4* __restrict__ v, int* __restrict__ dev_len, int row_words,
                                       unsigned* __restrict__ q8, float* __restrict__ qmeta) {
  __shared__ unsigned long long desc[IO_WORDS];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const bool mine = i < q_words;
  // The mailbox's word is read while the descriptor is (both over PCIe: one round trip).
  uint4 x = make_uint4(0u, 0u, 0u, 0u);
  if (mine) x = q_src[i];
  if (threadIdx.x < IO_TOKEN + 1) desc[threadIdx.x] = ((const volatile unsigned long long*)io_desc)[threadIdx.x];
  __syncthreads();
  if (mine && desc[IO_QUERY] != 0) {
    const void* src = (const void*)desc[IO_QUERY];
    const int type = (int)desc[IO_TYPE];
    float f[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
      f[j] = io_load(src, type, 4 * i + j);
      if ((__float_as_int(f[j]) & 0x7f800000) == 0x7f800000) {
        io_dev[IO_BAD] = desc[IO_TOKEN];
        if (atomicCAS(io_status, 0, 4 * i + j + 1) == 0) io_status[1] = __float_as_int(f[j]);
        f[j] = 0.0f;
      }
    }
    x = make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
  if (mine) {
    q_a[i] = x;
    q_b[i] = x;
  }
  if (blockIdx.x == 0 && threadIdx.x <= IO_TOKEN) io_dev[threadIdx.x] = desc[threadIdx.x];
#if HEAD_DIM % 64 == 0
  // A 2-bit layer's queries in 8 bits for hack_arena (q8: [q_heads][HEAD_DIM/4] words,
  // qmeta: [q_heads][KP][3]), one warp per 64-dim partition of this CTA's words (16 words
  // each), read back from q_b once the CTA wrote them.
  if (q8 != nullptr) {
    __shared__ unsigned char codes_s[INGEST_THREADS / 32][64];
    __syncthreads();
    const int warp = threadIdx.x / 32, per_cta = INGEST_THREADS / 16;
    const int hi = min(q_words * 4 / 64, (blockIdx.x + 1) * per_cta);
    for (int p = blockIdx.x * per_cta + warp; p < hi; p += INGEST_THREADS / 32)
      hack_quantize_partition(reinterpret_cast<const float*>(q_b) + p * 64, codes_s[warp], q8 + p * 16, qmeta + p * 3);
  }
#endif
  if (blockIdx.x != 0 || marks == nullptr) return;
  __shared__ int bounds[2];
  if (threadIdx.x == 0) {
    const int len = ((volatile int*)marks)[0], first = ((volatile int*)marks)[1];
    bounds[0] = min(*dev_len, first);
    bounds[1] = len;
  }
  __syncthreads();
  const long long lo = (long long)bounds[0] * row_words, hi = (long long)bounds[1] * row_words;
  for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    k[i] = stage_k[i];
    v[i] = stage_v[i];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *dev_len = bounds[1];
    ((volatile int*)marks)[1] = 0x7fffffff;
  }
}
