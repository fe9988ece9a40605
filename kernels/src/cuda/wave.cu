
// ---- A whole wave-index decode step on the GPU (appended to decode.cu) ----
// Per KV head the layer's rows are laid out cluster after cluster (rows 0..indexed, cluster
// c at offsets[c]..offsets[c+1]), then the steady zone (sink and local window) at
// indexed..rows. A step is: scoring + top-r of the centroids (decode.cu's selection),
// wave_expand (the retrieved clusters and the steady zone as one row list, Gpu-tier hits as
// cache rows), attn_partial over those rows, est_partial over every cluster not retrieved,
// and attn_merge over both kinds of partials. No step needs the host.

#define EXPAND_THREADS 1024

// Exclusive prefix sum of v[0..n) in place by one CTA of EXPAND_THREADS threads; returns
// the total to every thread.
__device__ int block_exclusive_scan(int* v, int n) {
  __shared__ int warp_sums[EXPAND_THREADS / 32];
  __shared__ int carry;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < n; base += EXPAND_THREADS) {
    const int i = base + threadIdx.x;
    const int x = i < n ? v[i] : 0;
    int incl = x;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += y;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      int w = warp_sums[lane];
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, w, off);
        if (lane >= off) w += y;
      }
      warp_sums[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int before = carry + (warp > 0 ? warp_sums[warp - 1] : 0);
    if (i < n) v[i] = before + incl - x;
    __syncthreads();
    if (threadIdx.x == 0) carry += warp_sums[EXPAND_THREADS / 32 - 1];
    __syncthreads();
  }
  return carry;
}

// Row list entry of row t of head h: a cache row (−slot−1) when t's block is in the Gpu
// tier (block_slot[h][t / block_rows] = first cache row of the block, or −1), else t.
__device__ __forceinline__ int row_ref(const int* __restrict__ block_slot, int h, int blocks_per_head,
                                       int block_rows, int t) {
  if (block_slot != nullptr) {
    const int s = block_slot[h * blocks_per_head + t / block_rows];
    if (s >= 0) return -(s + t % block_rows) - 1;
  }
  return t;
}

// One CTA. Per head the elements are [steady zone, retrieved cluster 0, …, r−1]; `scan`
// (kv_heads × (r + 1) ints) receives their lengths, then their start positions in `list`.
// Marks every retrieved cluster with `stamp` (est_partial skips it), writes list_offsets
// (kv_heads + 1) and the row list.
extern "C" __global__ void wave_expand(const int* __restrict__ sel, int r, const int* __restrict__ offsets, int n,
                                       int kv_heads, int indexed, int rows, const int* __restrict__ block_slot,
                                       int block_rows, int blocks_per_head, int* __restrict__ mark, int stamp,
                                       int* __restrict__ scan, int* __restrict__ list, int* __restrict__ list_offsets) {
  const int per = r + 1, total = kv_heads * per;
  for (int e = threadIdx.x; e < total; e += blockDim.x) {
    const int h = e / per, i = e % per;
    int len = rows - indexed;
    if (i > 0) {
      const int c = sel[h * r + i - 1];
      const int* off = offsets + (long long)h * (n + 1);
      len = off[c + 1] - off[c];
      mark[(long long)h * n + c] = stamp;
    }
    scan[e] = len;
  }
  __syncthreads();
  const int all = block_exclusive_scan(scan, total);
  for (int h = threadIdx.x; h <= kv_heads; h += blockDim.x) list_offsets[h] = h < kv_heads ? scan[h * per] : all;
  for (int e = threadIdx.x; e < total; e += blockDim.x) {
    const int h = e / per, i = e % per;
    int lo = indexed, hi = rows;
    if (i > 0) {
      const int c = sel[h * r + i - 1];
      const int* off = offsets + (long long)h * (n + 1);
      lo = off[c];
      hi = off[c + 1];
    }
    int* out = list + scan[e];
    for (int t = lo; t < hi; t++) out[t - lo] = row_ref(block_slot, h, blocks_per_head, block_rows, t);
  }
}

// The estimation zone: one CTA per (chunk of clusters, KV head) folds every cluster not
// marked with `stamp` as one row whose key is the centroid, whose value is the mean value
// and whose weight is its size (score bias ln size): size · e^{q·c} mass, size · e^{q·c} ·
// mean value. Writes the CTA's partial as chunk `first_chunk + blockIdx.x` of `part`.
extern "C" __global__ void est_partial(const unsigned short* __restrict__ cent,
                                       const unsigned short* __restrict__ vmean, const float* __restrict__ log_size,
                                       int n, const int* __restrict__ mark, int stamp, const float* __restrict__ q,
                                       float scale, int group, int per_cta, float* __restrict__ part, int chunk_stride,
                                       int first_chunk) {
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int lo = blockIdx.x * per_cta, hi = min(n, lo + per_cta);
  float qr[MAX_GROUP][PER_LANE], o[MAX_GROUP][PER_LANE], m[MAX_GROUP], l[MAX_GROUP];
#pragma unroll
  for (int g = 0; g < MAX_GROUP; g++) {
    m[g] = NEG_INF;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
      qr[g][i] = g < group ? q[(h * group + g) * HEAD_DIM + lane * PER_LANE + i] * scale : 0.f;
      o[g][i] = 0.f;
    }
  }
  const long long head = (long long)h * n;
  for (int c0 = lo + warp * UNROLL; c0 < hi; c0 += WARPS * UNROLL) {
    float kf[UNROLL][PER_LANE], vf[UNROLL][PER_LANE], bias[UNROLL];
    bool live[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const int c = c0 + u;
      live[u] = c < hi && mark[head + c] != stamp;
      if (live[u]) {
        load_row(cent + (head + c) * HEAD_DIM + lane * PER_LANE, kf[u]);
        load_row(vmean + (head + c) * HEAD_DIM + lane * PER_LANE, vf[u]);
        bias[u] = log_size[head + c];
        live[u] = bias[u] != NEG_INF;  // an empty cluster stands for nothing
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; u++)
      if (live[u]) fold_row(qr, kf[u], vf[u], bias[u], group, o, m, l);
  }
  write_partial(o, m, l, group, part + ((long long)(h * chunk_stride + first_chunk + blockIdx.x) * group) * PART);
}
