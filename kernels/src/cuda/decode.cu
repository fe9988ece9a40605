// Decode attention on the GPU, flash-decoding style: one CTA per (KV head, chunk of rows)
// computes the partial (o, m, l) of every query head of the GQA group over its rows, and a
// merge kernel combines the chunks by log-sum-exp. Rows are either all rows of the head
// (exact attention) or a per-head row list (a sparse plan's steady + retrieved rows), read
// from device memory or from mapped pinned host memory (zero-copy: no per-block copies).
//
// HEAD_DIM (a multiple of 32, ≤ 256) and MAX_GROUP are fixed when the module is compiled.
// Keys and values are f16 bits; accumulation is f32.

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef MAX_GROUP
#define MAX_GROUP 8
#endif
#define PER_LANE (HEAD_DIM / 32)
#define PART (HEAD_DIM + 2)
// NVRTC has no math headers: -inf spelled out.
#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float h2f(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ unsigned short f2h(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

__device__ __forceinline__ void load_row(const unsigned short* __restrict__ p, float* out) {
#if PER_LANE == 4
  uint2 raw = *reinterpret_cast<const uint2*>(p);
  out[0] = h2f(raw.x & 0xffff); out[1] = h2f(raw.x >> 16);
  out[2] = h2f(raw.y & 0xffff); out[3] = h2f(raw.y >> 16);
#else
  #pragma unroll
  for (int i = 0; i < PER_LANE; i++) out[i] = h2f(p[i]);
#endif
}

// part layout: [kv_head][chunk][g][PART] with PART = HEAD_DIM outputs, then m, then l.
//
// Partials are computed a tile of TILE rows at a time by a CTA of TILE_THREADS threads,
// templated on the GQA group G (one kernel per group size, so every loop over the group is
// unrolled and no register is spent on heads that do not exist):
// 1. the tile's K and V rows are staged in shared memory with 16-byte loads, all issued
//    before any is used (rows of a row list come from anywhere: KV rows, cache slots);
// 2. each thread computes whole dot products of (row, query head) pairs against K in
//    shared memory — no warp reductions;
// 3. the warp holding a query head's 32 scores updates its running max and sum once per
//    tile and writes the probabilities to shared memory;
// 4. each thread accumulates two output dimensions of one query head over the tile's rows.
#define TILE 32
#define TILE_THREADS 128
#define KPITCH (HEAD_DIM + 8)  // halves per staged K row: 16-byte aligned, quarter-warps hit distinct banks
#define VEC (HEAD_DIM / 8)     // 16-byte vectors per row
#define STAGE (TILE * VEC / TILE_THREADS)  // vectors of K (and of V) each thread stages
#define PAIRS(G) ((G * TILE + TILE_THREADS - 1) / TILE_THREADS)      // scores per thread
#define OUT2(G) ((G * HEAD_DIM / 2 + TILE_THREADS - 1) / TILE_THREADS)  // output pairs per thread

// A CTA's online-softmax state for G query heads, and a tile's probabilities.
template <int G>
struct TileState {
  float m[G], l[G], corr[G];
  float p[G][TILE];
};

template <int G>
__device__ __forceinline__ void tile_init(TileState<G>& st, float (&o)[OUT2(G)][2]) {
  if (threadIdx.x < G) { st.m[threadIdx.x] = NEG_INF; st.l[threadIdx.x] = 0.f; }
#pragma unroll
  for (int j = 0; j < OUT2(G); j++) o[j][0] = o[j][1] = 0.f;
}

__device__ __forceinline__ void unpack8(uint4 raw, float* k) {
  const unsigned int w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int j = 0; j < 4; j++) { k[2 * j] = h2f(w[j] & 0xffff); k[2 * j + 1] = h2f(w[j] >> 16); }
}

// Score pair j of this thread: row (threadIdx.x + TILE_THREADS·j) % TILE of query head
// (threadIdx.x + TILE_THREADS·j) / TILE — a warp's pairs share one query head.
template <int G>
__device__ __forceinline__ void tile_scores(const unsigned short* ks, const float* qs, int valid,
                                            float (&s)[PAIRS(G)]) {
#pragma unroll
  for (int j = 0; j < PAIRS(G); j++) {
    const int pi = threadIdx.x + TILE_THREADS * j, r = pi % TILE, g = pi / TILE;
    s[j] = NEG_INF;
    if (g >= G) continue;
    float acc = 0.f;
#pragma unroll 4
    for (int d = 0; d < HEAD_DIM; d += 8) {
      float k[8];
      unpack8(*reinterpret_cast<const uint4*>(ks + r * KPITCH + d), k);
      const float4 q0 = *reinterpret_cast<const float4*>(qs + g * HEAD_DIM + d);
      const float4 q1 = *reinterpret_cast<const float4*>(qs + g * HEAD_DIM + d + 4);
      acc = fmaf(q0.x, k[0], acc); acc = fmaf(q0.y, k[1], acc); acc = fmaf(q0.z, k[2], acc); acc = fmaf(q0.w, k[3], acc);
      acc = fmaf(q1.x, k[4], acc); acc = fmaf(q1.y, k[5], acc); acc = fmaf(q1.z, k[6], acc); acc = fmaf(q1.w, k[7], acc);
    }
    if (r < valid) s[j] = acc;
  }
}

// Steps 3 and 4 for one tile whose scores are in s (−inf: not a row) and whose value rows are
// staged in vs (zeros where s is −inf for every head).
template <int G>
__device__ __forceinline__ void tile_fold(const float (&s)[PAIRS(G)], const unsigned short* vs, TileState<G>& st,
                                          float (&o)[OUT2(G)][2]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < PAIRS(G); j++) {
    const int pi = threadIdx.x + TILE_THREADS * j, g = pi / TILE;
    if (g >= G) continue;  // uniform per warp
    float mx = s[j];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float mold = st.m[g], mnew = fmaxf(mold, mx);
    const float p = mnew == NEG_INF ? 0.f : __expf(s[j] - mnew);
    float sum = p;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    st.p[g][pi % TILE] = p;
    if (lane == 0) {
      const float corr = mold == NEG_INF ? 0.f : __expf(mold - mnew);
      st.l[g] = st.l[g] * corr + sum;
      st.m[g] = mnew;
      st.corr[g] = corr;
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < OUT2(G); j++) {
    const int idx = threadIdx.x + TILE_THREADS * j;
    if (idx >= G * HEAD_DIM / 2) break;
    const int g = idx / (HEAD_DIM / 2), d = 2 * (idx % (HEAD_DIM / 2));
    const float corr = st.corr[g];
    float a0 = o[j][0] * corr, a1 = o[j][1] * corr;
#pragma unroll 8
    for (int r = 0; r < TILE; r++) {
      const unsigned int w = *reinterpret_cast<const unsigned int*>(vs + r * HEAD_DIM + d);
      const float p = st.p[g][r];
      a0 = fmaf(p, h2f(w & 0xffff), a0);
      a1 = fmaf(p, h2f(w >> 16), a1);
    }
    o[j][0] = a0;
    o[j][1] = a1;
  }
  __syncthreads();
}

// The CTA's partial (o, m, l) of every query head into out (G × PART floats).
template <int G>
__device__ __forceinline__ void tile_write(const TileState<G>& st, const float (&o)[OUT2(G)][2],
                                           float* __restrict__ out) {
#pragma unroll
  for (int j = 0; j < OUT2(G); j++) {
    const int idx = threadIdx.x + TILE_THREADS * j;
    if (idx >= G * HEAD_DIM / 2) break;
    const int g = idx / (HEAD_DIM / 2), d = 2 * (idx % (HEAD_DIM / 2));
    out[g * PART + d] = o[j][0];
    out[g * PART + d + 1] = o[j][1];
  }
  if (threadIdx.x < G) {
    out[threadIdx.x * PART + HEAD_DIM] = st.m[threadIdx.x];
    out[threadIdx.x * PART + HEAD_DIM + 1] = st.l[threadIdx.x];
  }
}

// Stages a tile's rows: row r's K and V start at kr[r] / vr[r] (null: not a row, zeros);
// without KEYS only the values (the estimation's mean values; kr and ks unused).
template <bool KEYS>
__device__ __forceinline__ void tile_stage(const unsigned short* const* kr, const unsigned short* const* vr,
                                           unsigned short* ks, unsigned short* vs) {
  uint4 kx[STAGE], vx[STAGE];
  const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int u = 0; u < STAGE; u++) {
    const int i = threadIdx.x + TILE_THREADS * u, r = i / VEC, c = i % VEC;
    if (KEYS) kx[u] = kr[r] ? reinterpret_cast<const uint4*>(kr[r])[c] : zero;
    vx[u] = vr[r] ? reinterpret_cast<const uint4*>(vr[r])[c] : zero;
  }
#pragma unroll
  for (int u = 0; u < STAGE; u++) {
    const int i = threadIdx.x + TILE_THREADS * u, r = i / VEC, c = i % VEC;
    if (KEYS) *reinterpret_cast<uint4*>(ks + r * KPITCH + c * 8) = kx[u];
    *reinterpret_cast<uint4*>(vs + r * HEAD_DIM + c * 8) = vx[u];
  }
  __syncthreads();
}

// A row-list entry r ≥ 0 is row r of the head in k/v (at k + h·head_stride + r·HEAD_DIM;
// with no row_offsets every KV head reads the first identity_rows entries of one shared
// list); r < 0 names row i = −r−1 of the Gpu-tier cache ck/cv (device memory) when
// i < cache_rows, else row i − cache_rows of the steady buffer sk/sv (a device-resident
// steady zone): hits, misses and the steady zone of one plan in one pass.
// The CTA takes chunks c, c + gridDim.x, … of the head's rows (one chunk when the grid
// covers the list, as it does for exact and host-built lists; a wave step's device-built
// list may be longer than its grid) and writes one partial.
template <int G>
__device__ __forceinline__ void attn_tiles(const unsigned short* __restrict__ k, const unsigned short* __restrict__ v,
                                           long long head_stride, const float* __restrict__ q, float scale,
                                           const int* __restrict__ rows, const int* __restrict__ row_offsets,
                                           int identity_rows, int chunk, float* __restrict__ part,
                                           const unsigned short* __restrict__ ck,
                                           const unsigned short* __restrict__ cv, int cache_rows,
                                           const unsigned short* __restrict__ sk,
                                           const unsigned short* __restrict__ sv) {
  __shared__ __align__(16) unsigned short ks[TILE * KPITCH];
  __shared__ __align__(16) unsigned short vs[TILE * HEAD_DIM];
  __shared__ __align__(16) float qs[G * HEAD_DIM];
  __shared__ const unsigned short* kr[TILE];
  __shared__ const unsigned short* vr[TILE];
  __shared__ TileState<G> st;
  const int h = blockIdx.y, c = blockIdx.x;
  const int* list = nullptr;
  int count = identity_rows;
  if (rows != nullptr && row_offsets != nullptr) {
    list = rows + row_offsets[h];
    count = row_offsets[h + 1] - row_offsets[h];
  } else if (rows != nullptr) {
    list = rows;  // one list of identity_rows entries for every KV head (h · head_stride apart)
  }
  for (int i = threadIdx.x; i < G * HEAD_DIM; i += TILE_THREADS) qs[i] = q[h * G * HEAD_DIM + i] * scale;
  float o[OUT2(G)][2];
  tile_init<G>(st, o);
  const unsigned short* kh = k + h * head_stride;
  const unsigned short* vh = v + h * head_stride;
  for (int cc = c; cc * chunk < count; cc += gridDim.x) {
    const int hi = min(count, (cc + 1) * chunk);
    for (int t0 = cc * chunk; t0 < hi; t0 += TILE) {
      const int valid = min(TILE, hi - t0);
      if (threadIdx.x < TILE) {
        const unsigned short *kp = nullptr, *vp = nullptr;
        if (threadIdx.x < valid) {
          const long long row = list ? (long long)list[t0 + threadIdx.x] : (long long)(t0 + threadIdx.x);
          if (row >= 0) {
            kp = kh + row * HEAD_DIM;
            vp = vh + row * HEAD_DIM;
          } else if (-row - 1 < cache_rows) {
            kp = ck + (-row - 1) * HEAD_DIM;
            vp = cv + (-row - 1) * HEAD_DIM;
          } else {
            kp = sk + (-row - 1 - cache_rows) * HEAD_DIM;
            vp = sv + (-row - 1 - cache_rows) * HEAD_DIM;
          }
        }
        kr[threadIdx.x] = kp;
        vr[threadIdx.x] = vp;
      }
      __syncthreads();
      tile_stage<true>(kr, vr, ks, vs);
      float s[PAIRS(G)];
      tile_scores<G>(ks, qs, valid, s);
      tile_fold<G>(s, vs, st, o);
    }
  }
  tile_write<G>(st, o, part + ((long long)(h * gridDim.x + c) * G) * PART);
}

#define ATTN_PARTIAL(G)                                                                                           \
  extern "C" __global__ void __launch_bounds__(TILE_THREADS) attn_partial_g##G(                                  \
      const unsigned short* __restrict__ k, const unsigned short* __restrict__ v, long long head_stride,          \
      const float* __restrict__ q, float scale, const int* __restrict__ rows, const int* __restrict__ row_offsets, \
      int identity_rows, int chunk, float* __restrict__ part, const unsigned short* __restrict__ ck,              \
      const unsigned short* __restrict__ cv, int cache_rows, const unsigned short* __restrict__ sk,               \
      const unsigned short* __restrict__ sv) {                                                                    \
    attn_tiles<G>(k, v, head_stride, q, scale, rows, row_offsets, identity_rows, chunk, part, ck, cv, cache_rows, \
                  sk, sv);                                                                                        \
  }
ATTN_PARTIAL(1)
ATTN_PARTIAL(2)
ATTN_PARTIAL(3)
ATTN_PARTIAL(4)
ATTN_PARTIAL(5)
ATTN_PARTIAL(6)
ATTN_PARTIAL(7)
ATTN_PARTIAL(8)

// Elements of the caller's device tensors (an embedding runtime's queries and outputs) in
// their type: 0 f32, 1 f16, 2 bf16 (`IoDType` on the host).
__device__ __forceinline__ float io_load(const void* src, int dtype, int i) {
  if (dtype == 1) return h2f(((const unsigned short*)src)[i]);
  if (dtype == 2) return __int_as_float(((int)((const unsigned short*)src)[i]) << 16);
  return ((const float*)src)[i];
}

__device__ __forceinline__ void io_store(void* dst, int dtype, int i, float x) {
  if (dtype == 1) {
    ((unsigned short*)dst)[i] = f2h(x);
  } else if (dtype == 2) {
    // Round to nearest even; a NaN stays a (quiet) NaN.
    unsigned int b = (unsigned int)__float_as_int(x);
    unsigned short r = (b & 0x7fffffffu) > 0x7f800000u
        ? (unsigned short)((b >> 16) | 0x40u)
        : (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    ((unsigned short*)dst)[i] = r;
  } else {
    ((float*)dst)[i] = x;
  }
}

// A step's I/O descriptor in device memory (the job's, copied there by step_ingest from the
// mapped words the host wrote before the launch): the caller's query and output addresses
// (0: the query came through the job's mailbox, no caller output), their element type, the
// step's token, and the token of the last step whose query held a non-finite element (that
// step writes no output).
#define IO_QUERY 0
#define IO_OUTPUT 1
#define IO_TYPE 2
#define IO_TOKEN 3
#define IO_BAD 4
#define IO_WORDS 5

// One CTA per query head, MERGE_WARPS warps: the maximum m over chunks by a block
// reduction, then warp w folds chunks w, w + MERGE_WARPS, … (lanes split the head
// dimension, so each chunk's partial is one coalesced read), then the warps' sums are
// combined: out[qh] = Σ_c e^{m_c−M} o_c / Σ_c e^{m_c−M} l_c.
// 32 warps: a wave step merges ~160 partials per query head, and with 8 warps each warp's
// chain of dependent L2 reads was the kernel's time (15 µs at 128K on the H100).
#define MERGE_WARPS 32
#define MERGE_UNROLL 4
// `lse` (may be null): per query head, the log of the softmax denominator m + ln l, so the
// normalized output and it form a partial (o = out, m = lse, l = 1) the host can merge.
// `part2` (may be null): `chunks2` more partials per KV head in a second buffer, same layout
// (a wave step's estimation partials, written on another stream); `part3`/`chunks3` (may be
// null) a third (a 2-bit wave step's homomorphic partials). `out_copy` (may be null):
// a second destination of the output, e.g. a job's mapped pinned buffer, so the host reads
// the result with no copy node after the kernel. `words_src` (may be null): `words` ints the
// step wrote in device memory (a wave step's flagged selection) that go to `words_dst` (mapped)
// too, each CTA one run of consecutive words, written first so the writes overlap the merge.
// (Its launch of MERGE_WARPS × 32 threads needs ≤ 64 registers a thread: the bound says so.)
extern "C" __global__ void __launch_bounds__(MERGE_WARPS * 32) attn_merge(const float* __restrict__ part, int chunks, int group, float* __restrict__ out,
                                      float* __restrict__ lse, const float* __restrict__ part2, int chunks2,
                                      const float* __restrict__ part3, int chunks3,
                                      float* __restrict__ out_copy, const int* __restrict__ words_src, int words,
                                      int* __restrict__ words_dst, const unsigned long long* __restrict__ io) {
  const int qh = blockIdx.x;
  if (words_src != nullptr) {
    const int span = (words + gridDim.x - 1) / gridDim.x, lo = qh * span, hi = min(words, lo + span);
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) words_dst[i] = words_src[i];
  }
  const int h = qh / group, g = qh % group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long stride = (long long)group * PART;
  const float* base1 = part + (long long)h * chunks * stride + g * PART;
  const float* base2 = part2 == nullptr ? nullptr : part2 + (long long)h * chunks2 * stride + g * PART;
  if (part2 == nullptr) chunks2 = 0;
  const float* base3 = part3 == nullptr ? nullptr : part3 + (long long)h * chunks3 * stride + g * PART;
  if (part3 == nullptr) chunks3 = 0;
  // Chunk c of the merge: c < chunks from the first buffer, then the second's, then the third's.
#define CHUNK_AT(c)                                                 \
  ((c) < chunks            ? base1 + (long long)(c) * stride        \
   : (c) < chunks + chunks2 ? base2 + (long long)((c) - chunks) * stride \
                            : base3 + (long long)((c) - chunks - chunks2) * stride)
  const int all = chunks + chunks2 + chunks3;
  // `io` (may be null): the step's I/O descriptor; a caller output is written too unless the
  // step's query was not finite.
  void* io_out = nullptr;
  int io_type = 0;
  if (io != nullptr && io[IO_OUTPUT] != 0 && io[IO_BAD] != io[IO_TOKEN]) {
    io_out = (void*)io[IO_OUTPUT];
    io_type = (int)io[IO_TYPE];
  }
  __shared__ float red[MERGE_WARPS];
  __shared__ float acc_s[MERGE_WARPS][HEAD_DIM + 1];
  float mx = NEG_INF;
  for (int c = threadIdx.x; c < all; c += blockDim.x) mx = fmaxf(mx, CHUNK_AT(c)[HEAD_DIM]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = NEG_INF;
  for (int w = 0; w < MERGE_WARPS; w++) mx = fmaxf(mx, red[w]);
  float acc[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; i++) acc[i] = 0.f;
  float lsum = 0.f;
  if (mx != NEG_INF) {
    // MERGE_UNROLL chunks per warp step, their loads issued before the math.
    for (int c0 = warp; c0 < all; c0 += MERGE_WARPS * MERGE_UNROLL) {
      float pm[MERGE_UNROLL], pl[MERGE_UNROLL], po[MERGE_UNROLL][PER_LANE];
#pragma unroll
      for (int u = 0; u < MERGE_UNROLL; u++) {
        const int c = c0 + u * MERGE_WARPS;
        pm[u] = c < all ? CHUNK_AT(c)[HEAD_DIM] : NEG_INF;
        // A chunk with no rows (e.g. past a row list's end) has m = −inf: nothing to read.
        if (pm[u] != NEG_INF) {
          const float* p = CHUNK_AT(c);
          pl[u] = p[HEAD_DIM + 1];
#pragma unroll
          for (int i = 0; i < PER_LANE; i++) po[u][i] = p[lane * PER_LANE + i];
        }
      }
#pragma unroll
      for (int u = 0; u < MERGE_UNROLL; u++) {
        if (pm[u] == NEG_INF) continue;
        const float e = __expf(pm[u] - mx);
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) acc[i] = fmaf(e, po[u][i], acc[i]);
        lsum = fmaf(e, pl[u], lsum);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < PER_LANE; i++) acc_s[warp][lane * PER_LANE + i] = acc[i];
  if (lane == 0) acc_s[warp][HEAD_DIM] = lsum;
  __syncthreads();
  for (int i = threadIdx.x; i < HEAD_DIM; i += blockDim.x) {
    float a = 0.f, l = 0.f;
    for (int w = 0; w < MERGE_WARPS; w++) { a += acc_s[w][i]; l += acc_s[w][HEAD_DIM]; }
    const float o = l > 0.f ? a / l : 0.f;
    out[qh * HEAD_DIM + i] = o;
    if (out_copy != nullptr) out_copy[qh * HEAD_DIM + i] = o;
    if (io_out != nullptr) io_store(io_out, io_type, qh * HEAD_DIM + i, o);
  }
  if (lse != nullptr && threadIdx.x == 0) {
    float l = 0.f;
    for (int w = 0; w < MERGE_WARPS; w++) l += acc_s[w][HEAD_DIM];
    lse[qh] = l > 0.f ? mx + __logf(l) : NEG_INF;
  }
}
#undef CHUNK_AT

// Copies rows (head, row) of k/v (device or mapped host memory) into cache slots: the Gpu
// tier's admission, one warp per row, off the decode path.
extern "C" __global__ void admit_rows(
    const unsigned short* __restrict__ k, const unsigned short* __restrict__ v, long long head_stride,
    const int* __restrict__ heads, const int* __restrict__ rows, const int* __restrict__ slots, int n,
    unsigned short* __restrict__ ck, unsigned short* __restrict__ cv) {
  const int w = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (w >= n) return;
  const long long src = heads[w] * head_stride + (long long)rows[w] * HEAD_DIM;
  const long long dst = (long long)slots[w] * HEAD_DIM;
  for (int i = lane; i < HEAD_DIM; i += 32) {
    ck[dst + i] = k[src + i];
    cv[dst + i] = v[src + i];
  }
}

// Inclusive prefix sum of x over the lanes of a warp; every lane of the warp takes part.
template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T x) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  return x;
}

// All threads of a radix-select CTA: the highest bin b with (count above b) < need ≤ (count
// above b) + hist[b]. Thread t owns bins nbins−1−t·per … nbins−per−t·per (highest first), a
// block scan gives each thread the count above its bins, and the one thread holding b writes
// it: a few steps per thread, where a single warp walking 64 bins per lane took most of a
// level's time. `scan` is shared scratch of 32 ints; nbins is a multiple of blockDim.x.
__device__ void find_bin(const unsigned int* hist, int nbins, unsigned int need, unsigned int* sel_bin,
                         unsigned int* above, unsigned int* scan) {
  const int t = threadIdx.x, lane = t % 32, warp = t / 32, warps = blockDim.x / 32;
  const int per = nbins / blockDim.x;
  const int top = nbins - 1 - t * per;  // this thread's highest bin
  unsigned int mine = 0;
  for (int i = 0; i < per; i++) mine += hist[top - i];
  // Inclusive scan of `mine` over threads (lower threads hold higher bins).
  const unsigned int incl = warp_inclusive_scan(mine);
  if (lane == 31) scan[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const unsigned int w = warp_inclusive_scan(lane < warps ? scan[lane] : 0u);
    if (lane < warps) scan[lane] = w;  // inclusive totals of warps 0..lane
  }
  __syncthreads();
  unsigned int acc = incl - mine + (warp > 0 ? scan[warp - 1] : 0);  // count above this thread's bins
  for (int i = 0; i < per; i++) {
    const unsigned int c = hist[top - i];
    if (acc < need && need <= acc + c) {
      *sel_bin = top - i;
      *above = acc;
    }
    acc += c;
  }
  // Not reachable when need ≤ the histogram's total; then the lowest bin is taken.
  if (t == blockDim.x - 1 && acc < need) {
    *sel_bin = 0;
    *above = acc - hist[0];
  }
}

// Order-preserving bits of a float (larger float → larger unsigned).
__device__ __forceinline__ unsigned int ordered(float x) {
  const unsigned int b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Keys a radix-select thread keeps in registers: with n ≤ blockDim.x · RADIX_REGS scores
// (8192 centroids per head at 128K), every pass (two or three levels, the emission) reads
// registers instead of memory. The kernel calling it is bounded to 1024 threads, so 8
// keys fit the 64 registers a thread may have. Fixed when the module is compiled (the host
// decides from the same constant when a select needs candidates first).
#ifndef RADIX_REGS
#define RADIX_REGS 8
#endif

// The radix select's body (see radix_top_r). REGS: this thread's keys i = threadIdx.x +
// j·blockDim.x (j < RADIX_REGS) are loaded once into registers; otherwise every pass reads
// and converts them again.
template <bool REGS>
__device__ __forceinline__ void radix_select(const float* __restrict__ s, const int* __restrict__ idx, int n, int r,
                                             int* __restrict__ o, unsigned int* __restrict__ level0) {
  __shared__ unsigned int hist[2048];
  __shared__ unsigned int scan[32];
  __shared__ unsigned int sel_bin, above, emitted, tied;
  const int passes = REGS ? RADIX_REGS : (n + blockDim.x - 1) / blockDim.x;
  unsigned int key[REGS ? RADIX_REGS : 1];
  // Element i is score AT(i): s[idx[i]] over a candidate list, s[i] without one.
#define AT(i) (idx != nullptr ? idx[i] : (i))
  if (REGS) {
#pragma unroll
    for (int j = 0; j < (REGS ? RADIX_REGS : 1); j++) {
      const int i = threadIdx.x + j * blockDim.x;
      key[j] = i < n ? ordered(s[AT(i)]) : 0u;
    }
  }
  // Key j of this thread (only where threadIdx.x + j·blockDim.x < n).
#define KEY(j) (REGS ? key[(j) % (REGS ? RADIX_REGS : 1)] : ordered(s[AT(threadIdx.x + (j) * blockDim.x)]))
  unsigned int prefix = 0, need = r;
  const int shifts[3] = {21, 10, 0};
  const unsigned int masks[3] = {2047u, 2047u, 1023u};
  for (int level = 0; level < 3; level++) {
    const int shift = shifts[level];
    if (level == 0 && level0 != nullptr) {
      // The first level's histogram was counted while the scores were computed (score_hist):
      // taken, and cleared for the next step.
      for (int i = threadIdx.x; i < 2048; i += blockDim.x) {
        hist[i] = level0[i];
        level0[i] = 0;
      }
    } else {
      // Counted here: every key at the first level (over a candidate list), then the keys
      // whose higher bits equal the prefix chosen so far.
      for (int i = threadIdx.x; i < 2048; i += blockDim.x) hist[i] = 0;
      __syncthreads();
#pragma unroll
      for (int j = 0; j < passes; j++) {
        if (threadIdx.x + j * blockDim.x >= n) break;
        const unsigned int k = KEY(j);
        if (level == 0 || (k >> shifts[level - 1]) == prefix) atomicAdd(&hist[(k >> shift) & masks[level]], 1u);
      }
    }
    __syncthreads();
    find_bin(hist, (int)masks[level] + 1, need, &sel_bin, &above, scan);
    __syncthreads();
    need -= above;
    prefix = level == 0 ? sel_bin : (prefix << (level == 1 ? 11 : 10)) | sel_bin;
    __syncthreads();
  }
  // prefix is now the r-th largest key; `need` of the keys equal to it are taken.
  if (threadIdx.x == 0) { emitted = 0; tied = 0; }
  __syncthreads();
  // One atomic per warp and kind: the warp's lanes take consecutive places by their rank
  // among the warp's lanes of that kind (per-element atomics on one counter serialize).
  const int lane = threadIdx.x % 32;
  const unsigned int below = (1u << lane) - 1;
#pragma unroll
  for (int j = 0; j < passes; j++) {  // the same trip count for every thread
    const int i = threadIdx.x + j * blockDim.x;
    if (j * blockDim.x >= n) break;  // uniform across the CTA
    const unsigned int k = i < n ? KEY(j) : 0u;
    const bool gt = i < n && k > prefix, eq = i < n && k == prefix;
    const unsigned int mgt = __ballot_sync(0xffffffffu, gt), meq = __ballot_sync(0xffffffffu, eq);
    unsigned int bgt = 0, beq = 0;
    if (lane == 0) {
      if (mgt) bgt = atomicAdd(&emitted, __popc(mgt));
      if (meq) beq = atomicAdd(&tied, __popc(meq));
    }
    bgt = __shfl_sync(0xffffffffu, bgt, 0);
    beq = __shfl_sync(0xffffffffu, beq, 0);
    if (gt) {
      o[bgt + __popc(mgt & below)] = AT(i);
    } else if (eq) {
      const unsigned int t = beq + __popc(meq & below);
      if (t < need) o[r - need + t] = AT(i);
    }
  }
#undef KEY
#undef AT
}

// One CTA: writes to o the indices of the r largest of the n scores s, unordered. A
// three-level radix select on the ordered 32-bit keys (11 + 11 + 10 bits, histograms in
// shared memory, a parallel bin search) finds the r-th key exactly; every key above it is
// emitted and keys equal to it fill the remainder. No sort. `level0`: the first level's
// 2048-bin histogram of these keys, already counted while scoring (read and zeroed here). Up
// to blockDim.x · RADIX_REGS scores stay in registers for every pass.
__device__ void radix_top_r(const float* __restrict__ s, int n, int r, int* __restrict__ o,
                            unsigned int* __restrict__ level0) {
  if (n <= (int)blockDim.x * RADIX_REGS) radix_select<true>(s, nullptr, n, r, o, level0);
  else radix_select<false>(s, nullptr, n, r, o, level0);
}

// Scores of one f16 row against the group's queries (qs: group × HEAD_DIM floats in shared
// memory, 16-byte aligned, already scaled), computed by one thread: 16-byte loads of the row, no warp
// reductions (a warp scores 32 rows at once). out[g] for g < group.
__device__ __forceinline__ void thread_scores(const unsigned short* __restrict__ row, const float* qs, int group,
                                              float* out) {
  float acc[MAX_GROUP];
#pragma unroll
  for (int g = 0; g < MAX_GROUP; g++) acc[g] = 0.f;
#pragma unroll 4
  for (int i = 0; i < HEAD_DIM; i += 8) {
    const uint4 raw = *reinterpret_cast<const uint4*>(row + i);
    const unsigned int w[4] = {raw.x, raw.y, raw.z, raw.w};
    float k[8];
#pragma unroll
    for (int j = 0; j < 4; j++) { k[2 * j] = h2f(w[j] & 0xffff); k[2 * j + 1] = h2f(w[j] >> 16); }
#pragma unroll
    for (int g = 0; g < MAX_GROUP; g++) {
      if (g >= group) break;
      // Two 16-byte shared loads per 8 dimensions (qs is 16-byte aligned, i a multiple of 8):
      // a quarter of the load instructions of scalar reads, which bounded this loop.
      const float4 qa = *reinterpret_cast<const float4*>(qs + g * HEAD_DIM + i);
      const float4 qb = *reinterpret_cast<const float4*>(qs + g * HEAD_DIM + i + 4);
      acc[g] = fmaf(qa.x, k[0], acc[g]);
      acc[g] = fmaf(qa.y, k[1], acc[g]);
      acc[g] = fmaf(qa.z, k[2], acc[g]);
      acc[g] = fmaf(qa.w, k[3], acc[g]);
      acc[g] = fmaf(qb.x, k[4], acc[g]);
      acc[g] = fmaf(qb.y, k[5], acc[g]);
      acc[g] = fmaf(qb.z, k[6], acc[g]);
      acc[g] = fmaf(qb.w, k[7], acc[g]);
    }
  }
#pragma unroll
  for (int g = 0; g < MAX_GROUP; g++) out[g] = acc[g];
}

// The group's queries of KV head h, scaled, into shared memory (call with the whole CTA).
__device__ __forceinline__ void load_group_queries(const float* __restrict__ q, int h, int group, float scale,
                                                   float* qs) {
  for (int i = threadIdx.x; i < group * HEAD_DIM; i += blockDim.x) qs[i] = q[h * group * HEAD_DIM + i] * scale;
  __syncthreads();
}

// ---- top-r of every centroid's score, the first radix level counted while scoring ----
// 1. score_hist: every centroid is scored (one thread each: the group's best head) into
//    `scores`, every query head's score into `group_scores` when kept, and the first radix
//    level's histogram of the best scores is counted per head (in shared memory, then added
//    to the head's 2048 bins in `hist0`).
// 2. select_scored: per head one CTA finishes the exact radix select over all the head's
//    scores, starting from that histogram (so it reads the scores in two passes, not three).
// This replaced a sampled threshold (one CTA per head scoring and sorting a strided sample),
// a filtering pass and a select over the candidates: the sample's CTA alone took longer than
// the whole select does now.
extern "C" __global__ void score_hist(const unsigned short* __restrict__ cent, int n, const float* __restrict__ q,
                                      float scale, int group, float* __restrict__ scores,
                                      float* __restrict__ group_scores, unsigned int* __restrict__ hist0) {
  __shared__ __align__(16) float qs[MAX_GROUP * HEAD_DIM];
  __shared__ unsigned int hist[2048];
  const int h = blockIdx.y;
  for (int i = threadIdx.x; i < 2048; i += blockDim.x) hist[i] = 0;
  load_group_queries(q, h, group, scale, qs);  // ends with a barrier
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c < n) {
    float s[MAX_GROUP];
    thread_scores(cent + ((long long)h * n + c) * HEAD_DIM, qs, group, s);
    float best = NEG_INF;
#pragma unroll
    for (int g = 0; g < MAX_GROUP; g++) best = g < group ? fmaxf(best, s[g]) : best;
    scores[(long long)h * n + c] = best;
    if (group_scores != nullptr) {
#pragma unroll
      for (int g = 0; g < MAX_GROUP; g++)
        if (g < group) group_scores[((long long)h * group + g) * n + c] = s[g];
    }
    atomicAdd(&hist[ordered(best) >> 21], 1u);
  }
  __syncthreads();
  unsigned int* head_hist = hist0 + (long long)h * 2048;
  for (int i = threadIdx.x; i < 2048; i += blockDim.x) {
    if (hist[i] != 0) atomicAdd(&head_hist[i], hist[i]);
  }
}

// ---- the same over many scores per head (more than a CTA keeps in registers) ----
// One CTA per head reading 65,536 scores three times was most of a 1M-token step's
// selection. Instead: select_filter (many CTAs per head) finds, from the first level's
// histogram, the bin holding the head's r-th largest score and appends every score in or
// above that bin to the head's candidates; select_candidates (one CTA per head) finishes the
// radix select over those few thousand, in registers.

// Per (head, chunk of the scores), 256 threads. cand: kv_heads × n ints; cand_count:
// kv_heads counters, zero on entry (select_candidates clears them).
extern "C" __global__ void __launch_bounds__(256) select_filter(const float* __restrict__ scores, int n, int r,
                                                                const unsigned int* __restrict__ hist0,
                                                                int* __restrict__ cand,
                                                                unsigned int* __restrict__ cand_count) {
  __shared__ unsigned int scan[32];
  __shared__ unsigned int sel_bin, above;
  const int h = blockIdx.y;
  find_bin(hist0 + (long long)h * 2048, 2048, (unsigned int)r, &sel_bin, &above, scan);
  __syncthreads();
  const unsigned int b0 = sel_bin;
  const float* s = scores + (long long)h * n;
  int* c = cand + (long long)h * n;
  const int lane = threadIdx.x % 32;
  // `base` is the same for the whole CTA, so every lane of a warp reaches each ballot.
  for (int base = blockIdx.x * blockDim.x; base < n; base += gridDim.x * blockDim.x) {
    const int i = base + threadIdx.x;
    const bool take = i < n && (ordered(s[i]) >> 21) >= b0;
    const unsigned int m = __ballot_sync(0xffffffffu, take);
    unsigned int at = 0;
    if (lane == 0 && m != 0) at = atomicAdd(&cand_count[h], __popc(m));
    at = __shfl_sync(0xffffffffu, at, 0);
    if (take) c[at + __popc(m & ((1u << lane) - 1))] = i;
  }
}

// mark_row[o[i]] = 1 for the r selected indices o (the CTA's threads share the work; o must be
// visible to all of them: call after a __syncthreads that follows its writes).
__device__ __forceinline__ void mark_selected(const int* __restrict__ o, int r, int* __restrict__ mark_row) {
  for (int i = threadIdx.x; i < r; i += blockDim.x) mark_row[o[i]] = 1;
}

// Per head (one CTA of 1024 threads): the r largest of the head's candidates (select_filter),
// their score indices to out; clears the head's first-level histogram and candidate count for
// the next step; with `mark`, mark[h][c] = 1 for each selected c.
extern "C" __global__ void __launch_bounds__(1024) select_candidates(const float* __restrict__ scores, int n, int r,
                                                                     unsigned int* __restrict__ hist0,
                                                                     const int* __restrict__ cand,
                                                                     unsigned int* __restrict__ cand_count,
                                                                     int* __restrict__ out, int* __restrict__ mark) {
  const int h = blockIdx.x;
  const int m = (int)cand_count[h];
  int* o = out + (long long)h * r;
  const float* s = scores + (long long)h * n;
  const int* c = cand + (long long)h * n;
  if (m <= (int)blockDim.x * RADIX_REGS) radix_select<true>(s, c, m, r, o, nullptr);
  else radix_select<false>(s, c, m, r, o, nullptr);
  __syncthreads();  // every thread has read the count
  if (threadIdx.x == 0) cand_count[h] = 0;
  for (int i = threadIdx.x; i < 2048; i += blockDim.x) hist0[(long long)h * 2048 + i] = 0;
  if (mark != nullptr) mark_selected(o, r, mark + (long long)h * n);
}

// Per head (one CTA of 1024 threads): the indices of the r largest of its n scores, from the
// first-level histogram score_hist counted (cleared here for the next step). A wave step's
// estimation skips the selected clusters: with `mark`, mark[h][c] = 1 for each.
extern "C" __global__ void __launch_bounds__(1024) select_scored(const float* __restrict__ scores, int n, int r,
                                         unsigned int* __restrict__ hist0, int* __restrict__ out,
                                         int* __restrict__ mark) {
  const int h = blockIdx.x;
  int* o = out + (long long)h * r;
  radix_top_r(scores + (long long)h * n, n, r, o, hist0 + (long long)h * 2048);
  if (mark != nullptr) {
    __syncthreads();
    mark_selected(o, r, mark + (long long)h * n);
  }
}
