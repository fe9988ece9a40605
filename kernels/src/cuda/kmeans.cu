
// ---- Segmented spherical k-means (appended to decode.cu): the wave index's build ----
// Rows are unit vectors (keys centred per segment and normalized on the host), f32,
// HEAD_DIM wide; segment s owns rows seg_rows[s]..seg_rows[s+1] and centroids
// seg_cents[s]..seg_cents[s+1]. One iteration: kmeans_assign (each row's best centroid of
// its segment by cosine), then kmeans_accumulate (member sums and counts by atomics) and
// kmeans_normalize (each centroid = its normalized member sum; an empty one keeps its place).

#define KM_ROWS 256
#define KM_TILE 32

// Grid (row blocks, segments), KM_ROWS threads: one row per thread, held in registers;
// the segment's centroids pass through shared memory KM_TILE at a time (read broadcast).
extern "C" __global__ void kmeans_assign(const float* __restrict__ x, const int* __restrict__ seg_rows,
                                         const int* __restrict__ seg_cents, const float* __restrict__ cent,
                                         int* __restrict__ assign, float* __restrict__ best, int* __restrict__ changed) {
  __shared__ float4 tile[KM_TILE][HEAD_DIM / 4];
  const int s = blockIdx.y;
  const int r0 = seg_rows[s], r1 = seg_rows[s + 1], c0 = seg_cents[s], c1 = seg_cents[s + 1];
  const int row = r0 + blockIdx.x * KM_ROWS + threadIdx.x;
  if (r0 + blockIdx.x * KM_ROWS >= r1) return;  // the whole CTA is past this segment
  const bool live = row < r1;
  float4 xr[HEAD_DIM / 4];
#pragma unroll
  for (int i = 0; i < HEAD_DIM / 4; i++)
    xr[i] = live ? reinterpret_cast<const float4*>(x + (long long)row * HEAD_DIM)[i] : make_float4(0.f, 0.f, 0.f, 0.f);
  float top = NEG_INF;
  int arg = 0;
  for (int t0 = c0; t0 < c1; t0 += KM_TILE) {
    const int n = min(KM_TILE, c1 - t0);
    __syncthreads();
    for (int i = threadIdx.x; i < n * (HEAD_DIM / 4); i += blockDim.x)
      tile[i / (HEAD_DIM / 4)][i % (HEAD_DIM / 4)] =
          reinterpret_cast<const float4*>(cent + (long long)(t0 + i / (HEAD_DIM / 4)) * HEAD_DIM)[i % (HEAD_DIM / 4)];
    __syncthreads();
    for (int c = 0; c < n; c++) {
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < HEAD_DIM / 4; i++) {
        const float4 a = tile[c][i];
        dot = fmaf(xr[i].x, a.x, fmaf(xr[i].y, a.y, fmaf(xr[i].z, a.z, fmaf(xr[i].w, a.w, dot))));
      }
      if (dot > top) { top = dot; arg = t0 + c - c0; }
    }
  }
  if (live) {
    best[row] = top;
    if (assign[row] != arg) {
      assign[row] = arg;
      atomicAdd(changed, 1);
    }
  }
}

// One warp per row: adds the row to its centroid's sum (lanes split the dimension) and
// counts it.
extern "C" __global__ void kmeans_accumulate(const float* __restrict__ x, const int* __restrict__ row_seg,
                                             const int* __restrict__ seg_cents, const int* __restrict__ assign, int n,
                                             float* __restrict__ sums, int* __restrict__ counts) {
  const int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (row >= n) return;
  const int c = seg_cents[row_seg[row]] + assign[row];
  for (int j = lane; j < HEAD_DIM; j += 32) atomicAdd(&sums[(long long)c * HEAD_DIM + j], x[(long long)row * HEAD_DIM + j]);
  if (lane == 0) atomicAdd(&counts[c], 1);
}

// One warp per centroid: the normalized member sum; a centroid without members keeps its
// previous value (the CPU re-seeds it from the worst-fitting row instead).
extern "C" __global__ void kmeans_normalize(const float* __restrict__ sums, const int* __restrict__ counts, int k,
                                            float* __restrict__ cent) {
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (c >= k || counts[c] == 0) return;
  float v[PER_LANE], ss = 0.f;
#pragma unroll
  for (int i = 0; i < PER_LANE; i++) {
    v[i] = sums[(long long)c * HEAD_DIM + lane * PER_LANE + i];
    ss = fmaf(v[i], v[i], ss);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const float inv = ss > 0.f ? rsqrtf(ss) : 0.f;
  if (ss > 0.f) {
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) cent[(long long)c * HEAD_DIM + lane * PER_LANE + i] = v[i] * inv;
  }
}
