
// ---- The wave index's whole build on the device (appended to decode.cu; build.rs) ----
// A layer's f16 KV, already in device memory as the prefill left it (kv_heads × tokens ×
// HEAD_DIM), is clustered and laid out without a round trip to the host. Job j = (head h,
// segment s), j = h·segments + s: segment s holds the indexed tokens sink + s·seg ..
// (at most seg of them; indexed = tokens − sink − local), and ⌈len / tpc⌉ clusters that start
// at cluster h·clusters + s·kfull of the layer (kfull = ⌈seg / tpc⌉: every segment but the
// last is full). Unit rows (keys centred per job, normalized) are f16: the assignment runs on
// the tensor cores (mma.sync m16n8k16, f32 accumulation).

#define LB_MEAN_SPLIT 8
#define AS_WARPS 4
#define AS_MT (HEAD_DIM <= 128 ? 2 : 1)
#define AS_KS (HEAD_DIM / 16)
#define AS_CT (HEAD_DIM <= 128 ? 64 : 32)
// Centroid tile row stride in halves: +8 halves (4 words) spreads a fragment load's eight
// rows over different banks.
#define AS_STRIDE (HEAD_DIM + 8)

__device__ __forceinline__ int job_rows(int s, int indexed, int seg) { return min(seg, indexed - s * seg); }

// A lane's PER_LANE elements of a row as f16 (one 8-byte store when PER_LANE is 4, as
// load_row reads them).
__device__ __forceinline__ void store_row(unsigned short* __restrict__ p, const float* v) {
#if PER_LANE == 4
  uint2 raw;
  raw.x = (unsigned)f2h(v[0]) | (unsigned)f2h(v[1]) << 16;
  raw.y = (unsigned)f2h(v[2]) | (unsigned)f2h(v[3]) << 16;
  *reinterpret_cast<uint2*>(p) = raw;
#else
#pragma unroll
  for (int i = 0; i < PER_LANE; i++) p[i] = f2h(v[i]);
#endif
}

// Grid (jobs, LB_MEAN_SPLIT), 256 threads: each CTA sums a share of its job's keys (a warp
// per row, PER_LANE dimensions per lane) into mean_sum[j] (zeroed before; divided later).
extern "C" __global__ void lay_mean(const unsigned short* __restrict__ keys, int tokens, int sink, int indexed, int seg,
                                    int segments, float* __restrict__ mean_sum) {
  __shared__ float red[8][HEAD_DIM];
  const int j = blockIdx.x, h = j / segments, s = j % segments;
  const int len = job_rows(s, indexed, seg);
  const int share = (len + LB_MEAN_SPLIT - 1) / LB_MEAN_SPLIT;
  const int r0 = blockIdx.y * share, r1 = min(len, r0 + share);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float acc[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; i++) acc[i] = 0.f;
  for (int r = r0 + warp; r < r1; r += 8) {
    float x[PER_LANE];
    load_row(keys + ((long long)h * tokens + sink + s * seg + r) * HEAD_DIM + lane * PER_LANE, x);
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) acc[i] += x[i];
  }
#pragma unroll
  for (int i = 0; i < PER_LANE; i++) red[warp][lane * PER_LANE + i] = acc[i];
  __syncthreads();
  for (int e = threadIdx.x; e < HEAD_DIM; e += blockDim.x) {
    float t = 0.f;
    for (int w = 0; w < 8; w++) t += red[w][e];
    atomicAdd(&mean_sum[(long long)j * HEAD_DIM + e], t);
  }
}

// A warp per indexed row (h, i): the key minus its job's mean, normalized (a zero row stays
// zero), as f16 into unit row h·indexed + i; the row's assignment starts at −1 (none).
extern "C" __global__ void lay_unit(const unsigned short* __restrict__ keys, int kv_heads, int tokens, int sink,
                                    int indexed, int seg, int segments, const float* __restrict__ mean_sum,
                                    unsigned short* __restrict__ unit, int* __restrict__ assign) {
  const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (w >= (long long)kv_heads * indexed) return;
  const int h = (int)(w / indexed), i = (int)(w % indexed), s = i / seg;
  const float inv_n = 1.f / (float)job_rows(s, indexed, seg);
  const float* mu = mean_sum + (long long)(h * segments + s) * HEAD_DIM + lane * PER_LANE;
  float v[PER_LANE], ss = 0.f;
  load_row(keys + ((long long)h * tokens + sink + i) * HEAD_DIM + lane * PER_LANE, v);
#pragma unroll
  for (int e = 0; e < PER_LANE; e++) {
    v[e] -= mu[e] * inv_n;
    ss = fmaf(v[e], v[e], ss);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const float inv = ss > 0.f ? rsqrtf(ss) : 0.f;
#pragma unroll
  for (int e = 0; e < PER_LANE; e++) v[e] *= inv;
  store_row(unit + w * HEAD_DIM + lane * PER_LANE, v);
  if (lane == 0) assign[w] = -1;
}

// A warp per centroid of the layer: centroid ci starts as unit row init_rows[ci] of its job.
extern "C" __global__ void lay_init(const unsigned short* __restrict__ unit, const int* __restrict__ init_rows,
                                    int kv_heads, int indexed, int seg, int kfull, int clusters,
                                    unsigned short* __restrict__ cent) {
  const long long ci = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (ci >= (long long)kv_heads * clusters) return;
  const int h = (int)(ci / clusters), s = (int)(ci % clusters) / kfull;
  const long long row = (long long)h * indexed + (long long)s * seg + init_rows[ci];
  float x[PER_LANE];
  load_row(unit + row * HEAD_DIM + lane * PER_LANE, x);
  store_row(cent + ci * HEAD_DIM + lane * PER_LANE, x);
}

__device__ __forceinline__ void mma_16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned to = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(gmem));
}

__device__ __forceinline__ void keep_best(float& best, int& arg, float x, int c) {
  if (x > best) { best = x; arg = c; }
}

// Grid (row blocks, jobs), AS_WARPS warps: each warp holds 16·AS_MT unit rows as mma A
// fragments and scores them against the job's centroids, AS_CT at a time through shared
// memory, keeping each row's best (the first on ties, as the CPU). Writes each row's cluster
// (within its job) and counts the rows whose cluster changed.
extern "C" __global__ void lay_assign(const unsigned short* __restrict__ unit, const unsigned short* __restrict__ cent,
                                      int indexed, int seg, int segments, int kfull, int clusters, int tpc,
                                      int* __restrict__ assign, int* __restrict__ changed) {
  __shared__ __align__(16) unsigned short tiles[2][AS_CT * AS_STRIDE];
  const int j = blockIdx.y, h = j / segments, s = j % segments;
  const int len = job_rows(s, indexed, seg), k = (len + tpc - 1) / tpc;
  const int r0 = blockIdx.x * (AS_WARPS * 16 * AS_MT);
  if (r0 >= len) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const long long xbase = (long long)h * indexed + (long long)s * seg;
  const long long cbase = (long long)h * clusters + (long long)s * kfull;
  const int wr = r0 + warp * 16 * AS_MT;
  // Fragment registers: a[0] row g, k 2t..2t+1; a[1] row g+8; a[2] row g, k + 8; a[3] row g+8, k + 8.
  unsigned a[AS_MT][AS_KS][4];
#pragma unroll
  for (int mt = 0; mt < AS_MT; mt++) {
    const int ra = wr + mt * 16 + g, rb = ra + 8;
#pragma unroll
    for (int ks = 0; ks < AS_KS; ks++) {
      const unsigned* pa = reinterpret_cast<const unsigned*>(unit + (xbase + ra) * HEAD_DIM + ks * 16 + t * 2);
      const unsigned* pb = reinterpret_cast<const unsigned*>(unit + (xbase + rb) * HEAD_DIM + ks * 16 + t * 2);
      a[mt][ks][0] = ra < len ? pa[0] : 0u;
      a[mt][ks][1] = rb < len ? pb[0] : 0u;
      a[mt][ks][2] = ra < len ? pa[4] : 0u;
      a[mt][ks][3] = rb < len ? pb[4] : 0u;
    }
  }
  float best[AS_MT][2];
  int arg[AS_MT][2];
#pragma unroll
  for (int mt = 0; mt < AS_MT; mt++) {
    best[mt][0] = best[mt][1] = NEG_INF;
    arg[mt][0] = arg[mt][1] = 0;
  }
  // Centroid tiles are double-buffered: the next tile's copy (cp.async) is in flight while
  // this one is scored. Rows past the job's clusters are zeros.
  auto fetch = [&](unsigned short* tile, int c0) {
    const int n = min(AS_CT, k - c0);
    for (int i = threadIdx.x; i < AS_CT * (HEAD_DIM / 8); i += blockDim.x) {
      const int r = i / (HEAD_DIM / 8), v = i % (HEAD_DIM / 8);
      unsigned short* dst = tile + r * AS_STRIDE + v * 8;
      if (r < n)
        cp_async16(dst, cent + (cbase + c0 + r) * HEAD_DIM + v * 8);
      else
        *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
    asm volatile("cp.async.commit_group;");
  };
  fetch(tiles[0], 0);
  for (int c0 = 0, buf = 0; c0 < k; c0 += AS_CT, buf ^= 1) {
    const int n = min(AS_CT, k - c0);
    if (c0 + AS_CT < k)
      fetch(tiles[buf ^ 1], c0 + AS_CT);
    else
      asm volatile("cp.async.commit_group;");  // an empty group keeps "all but the newest" exact
    asm volatile("cp.async.wait_group 1;");
    __syncthreads();
    const unsigned short* tile = tiles[buf];
    // Two n-tiles at a time: four independent accumulator chains per warp hide the mma
    // latency (the tile's rows past n are zeros, and their columns are masked below).
    for (int nt = 0; nt * 8 < n; nt += 2) {
      float acc[2][AS_MT][4];
#pragma unroll
      for (int u = 0; u < 2; u++)
#pragma unroll
        for (int mt = 0; mt < AS_MT; mt++) acc[u][mt][0] = acc[u][mt][1] = acc[u][mt][2] = acc[u][mt][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < AS_KS; ks++) {
#pragma unroll
        for (int u = 0; u < 2; u++) {
          const unsigned short* pb = tile + ((nt + u) * 8 + g) * AS_STRIDE + t * 2 + ks * 16;
          const unsigned b0 = *reinterpret_cast<const unsigned*>(pb);
          const unsigned b1 = *reinterpret_cast<const unsigned*>(pb + 8);
#pragma unroll
          for (int mt = 0; mt < AS_MT; mt++) mma_16816(acc[u][mt], a[mt][ks], b0, b1);
        }
      }
      // acc[u][mt][0..1]: row g, columns 2t and 2t+1 of n-tile nt + u; acc[u][mt][2..3]: row g+8.
#pragma unroll
      for (int u = 0; u < 2; u++) {
        const int ca = c0 + (nt + u) * 8 + t * 2;
#pragma unroll
        for (int mt = 0; mt < AS_MT; mt++) {
          if (ca < k) {
            keep_best(best[mt][0], arg[mt][0], acc[u][mt][0], ca);
            keep_best(best[mt][1], arg[mt][1], acc[u][mt][2], ca);
          }
          if (ca + 1 < k) {
            keep_best(best[mt][0], arg[mt][0], acc[u][mt][1], ca + 1);
            keep_best(best[mt][1], arg[mt][1], acc[u][mt][3], ca + 1);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with this tile before it is refilled
  }
  int moved = 0;
#pragma unroll
  for (int mt = 0; mt < AS_MT; mt++) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
      float b = best[mt][i];
      int c = arg[mt][i];
#pragma unroll
      for (int off = 1; off < 4; off <<= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, b, off);
        const int oc = __shfl_xor_sync(0xffffffffu, c, off);
        if (ob > b || (ob == b && oc < c)) { b = ob; c = oc; }
      }
      const int row = wr + mt * 16 + g + i * 8;
      if (t == 0 && row < len && assign[xbase + row] != c) {
        assign[xbase + row] = c;
        moved++;
      }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) moved += __shfl_xor_sync(0xffffffffu, moved, off);
  if (lane == 0 && moved) atomicAdd(changed, moved);
}

// One warp per job, dynamic shared memory kfull·4 bytes: a stable counting sort of the job's
// rows by cluster (row order kept within a cluster, as the CPU's cluster_order). Writes the
// head's row offset of each of the job's clusters (and `indexed` after a head's last
// cluster), and for slot i of the job's rows in cluster order order[h·row_stride + s·seg + i]
// = first + s·seg + (the row's number in the job). Between k-means steps (row_stride =
// indexed, first = 0) that is each cluster's member list; for the layout (row_stride =
// tokens, first = sink) the token of every indexed row.
extern "C" __global__ void lay_rank(const int* __restrict__ assign, int first, int indexed, int row_stride, int seg,
                                    int segments, int kfull, int clusters, int tpc, unsigned* __restrict__ offsets,
                                    unsigned* __restrict__ order) {
  extern __shared__ int cursor[];
  const int j = blockIdx.x, h = j / segments, s = j % segments, lane = threadIdx.x;
  const int len = job_rows(s, indexed, seg), k = (len + tpc - 1) / tpc;
  const long long xbase = (long long)h * indexed + (long long)s * seg;
  for (int c = lane; c < k; c += 32) cursor[c] = 0;
  __syncwarp();
  for (int r = lane; r < len; r += 32) atomicAdd(&cursor[assign[xbase + r]], 1);
  __syncwarp();
  // Exclusive prefix over the clusters, 32 at a time.
  int carry = 0;
  for (int c0 = 0; c0 < k; c0 += 32) {
    const int c = c0 + lane;
    const int n = c < k ? cursor[c] : 0;
    const int incl = warp_inclusive_scan(n);
    if (c < k) {
      cursor[c] = carry + incl - n;
      offsets[(long long)h * (clusters + 1) + s * kfull + c] = (unsigned)(s * seg + carry + incl - n);
    }
    carry += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (s == segments - 1 && lane == 0) offsets[(long long)h * (clusters + 1) + clusters] = (unsigned)indexed;
  __syncwarp();
  for (int r0 = 0; r0 < len; r0 += 32) {
    const int r = r0 + lane;
    const bool live = r < len;
    const int c = live ? assign[xbase + r] : -1 - lane;
    const unsigned peers = __match_any_sync(0xffffffffu, c);
    const int slot = live ? cursor[c] + __popc(peers & ((1u << lane) - 1u)) : 0;
    __syncwarp();
    if (live) {
      order[(long long)h * row_stride + s * seg + slot] = (unsigned)(first + s * seg + r);
      if (lane == __ffs(peers) - 1) cursor[c] += __popc(peers);
    }
    __syncwarp();
  }
}

// A warp per centroid of the layer: the normalized sum of its members' unit rows (listed
// by lay_rank between offsets of its head), as f16; a centroid without members (or with a
// zero sum) keeps its place. Sums in f32, no atomics: the member lists are sorted.
extern "C" __global__ void lay_centroids(const unsigned short* __restrict__ unit, const unsigned* __restrict__ offsets,
                                         const unsigned* __restrict__ order, int kv_heads, int indexed, int clusters,
                                         unsigned short* __restrict__ cent) {
  const long long ci = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (ci >= (long long)kv_heads * clusters) return;
  const int h = (int)(ci / clusters), c = (int)(ci % clusters);
  const unsigned r0 = offsets[(long long)h * (clusters + 1) + c], r1 = offsets[(long long)h * (clusters + 1) + c + 1];
  if (r1 <= r0) return;
  float v[PER_LANE];
#pragma unroll
  for (int e = 0; e < PER_LANE; e++) v[e] = 0.f;
  for (unsigned r = r0; r < r1; r++) {
    float x[PER_LANE];
    load_row(unit + ((long long)h * indexed + order[(long long)h * indexed + r]) * HEAD_DIM + lane * PER_LANE, x);
#pragma unroll
    for (int e = 0; e < PER_LANE; e++) v[e] += x[e];
  }
  float ss = 0.f;
#pragma unroll
  for (int e = 0; e < PER_LANE; e++) ss = fmaf(v[e], v[e], ss);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (ss > 0.f) {
    const float inv = rsqrtf(ss);
#pragma unroll
    for (int e = 0; e < PER_LANE; e++) v[e] *= inv;
    store_row(cent + ci * HEAD_DIM + lane * PER_LANE, v);
  }
}

// HEAD_DIM / 8 threads per layout row (h, row): copies the row's token's key and value
// (16 bytes each a thread); the steady zone's rows (sinks, then the local window) get their
// positions here, the indexed rows' come from lay_rank.
extern "C" __global__ void lay_gather(const unsigned short* __restrict__ keys, const unsigned short* __restrict__ values,
                                      int kv_heads, int tokens, int sink, int indexed,
                                      unsigned* __restrict__ positions, unsigned short* __restrict__ out_keys,
                                      unsigned short* __restrict__ out_values) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int per_row = HEAD_DIM / 8;
  if (i >= (long long)kv_heads * tokens * per_row) return;
  const long long hr = i / per_row;
  const int v = (int)(i % per_row), h = (int)(hr / tokens), row = (int)(hr % tokens);
  unsigned token;
  if (row < indexed) {
    token = positions[hr];
  } else {
    const int steady_i = row - indexed;
    token = steady_i < sink ? (unsigned)steady_i : (unsigned)(indexed + steady_i);
    if (v == 0) positions[hr] = token;
  }
  const long long src = ((long long)h * tokens + token) * HEAD_DIM;
  reinterpret_cast<uint4*>(out_keys + hr * HEAD_DIM)[v] = reinterpret_cast<const uint4*>(keys + src)[v];
  reinterpret_cast<uint4*>(out_values + hr * HEAD_DIM)[v] = reinterpret_cast<const uint4*>(values + src)[v];
}

// A warp per cluster of the layer: the mean key and mean value of its rows in the laid-out
// KV, as f16 (zero when empty).
extern "C" __global__ void lay_means(const unsigned short* __restrict__ lk, const unsigned short* __restrict__ lv,
                                     const unsigned* __restrict__ offsets, int kv_heads, int rows, int clusters,
                                     unsigned short* __restrict__ key_means, unsigned short* __restrict__ value_means) {
  const long long ci = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (ci >= (long long)kv_heads * clusters) return;
  const int h = (int)(ci / clusters), c = (int)(ci % clusters);
  const unsigned r0 = offsets[(long long)h * (clusters + 1) + c], r1 = offsets[(long long)h * (clusters + 1) + c + 1];
  float sk[PER_LANE], sv[PER_LANE];
#pragma unroll
  for (int e = 0; e < PER_LANE; e++) sk[e] = sv[e] = 0.f;
  for (unsigned r = r0; r < r1; r++) {
    const long long at = ((long long)h * rows + r) * HEAD_DIM + lane * PER_LANE;
    float xk[PER_LANE], xv[PER_LANE];
    load_row(lk + at, xk);
    load_row(lv + at, xv);
#pragma unroll
    for (int e = 0; e < PER_LANE; e++) {
      sk[e] += xk[e];
      sv[e] += xv[e];
    }
  }
  const float inv = r1 > r0 ? 1.f / (float)(r1 - r0) : 0.f;
#pragma unroll
  for (int e = 0; e < PER_LANE; e++) {
    sk[e] *= inv;
    sv[e] *= inv;
  }
  store_row(key_means + ci * HEAD_DIM + lane * PER_LANE, sk);
  store_row(value_means + ci * HEAD_DIM + lane * PER_LANE, sv);
}
