
// ---- A whole wave-index decode step over 2-bit rows on the GPU (appended after wave.cu) ----
// The layer's rows are value blocks of Π = 64 rows in the group layout (hack.cu), each
// spread over a few arena blocks (pages); each cluster's rows are a run of its segment's
// value blocks, listed as pieces (value block, row mask). A step is wave.cu's: scoring and
// top-r of the centroids, then hack_expand (the retrieved clusters' pieces as one list per
// head, each page looked up in the Gpu tier's slot table), hack_arena_g{G} (homomorphic
// attention over the listed pieces, reading each page from the Gpu tier or zero-copy from
// the pinned Host arena, the queries quantized once by step_ingest), the steady zone in f16 through
// wave_expand with no cluster and attn_partial, est_partial, and attn_merge over all three.

#if HEAD_DIM % 64 == 0

// Warps per CTA of hack_arena_g{G}; each takes its own pieces, with no CTA barrier between
// them (hack_attend's chain of barriers per block, 128 threads waiting on each other, held
// the GPU's thread slots: session 47's ncu profile, docs/bench.md).
#define ARENA_WARPS (HACK_THREADS / 32)
// Value channels per lane.
#define ARENA_CPL (HEAD_DIM / 32)

// The address of byte `off` of a piece whose page addresses (pages of 2^page_shift bytes)
// are at `pages` in shared memory.
__device__ __forceinline__ const unsigned char* arena_byte(const unsigned long long* pages, int off, int page_shift) {
  const int p = off >> page_shift;
  return reinterpret_cast<const unsigned char*>(pages[p]) + (off - (p << page_shift));
}

// The f16 at byte `off` (even) of a piece, as f32; 0 without `load`.
__device__ __forceinline__ float arena_half(const unsigned long long* pages, int off, int page_shift, bool load) {
  return load ? h2f(*reinterpret_cast<const unsigned short*>(arena_byte(pages, off, page_shift))) : 0.f;
}

// Homomorphic attention over the listed pieces of KV head blockIdx.y, one warp per piece:
// the head's `listed` pieces are spread evenly over the gridDim.x CTAs of the head, and a
// CTA's pieces over its ARENA_WARPS warps. Each piece is a value block of ≤ 64 rows in the
// group layout (hack.cu, HackPagedSrc), its pages at list_addr[(h·cap + i)·MAX_PAGES…] (in the
// Gpu tier or the pinned Host arena), its row count at list_rows and its row mask at
// list_mask. The arithmetic is hack_attend's (8-bit queries `dp4a` 2-bit key codes, 7-bit
// probabilities `dp4a` 2-bit value codes, the same corrections), arranged for one warp:
// lane j scores rows j and j + 32 of the block for every head of the group, then owns value
// channels ARENA_CPL·j… of every head's output. The CTA's warps fold their partials at the
// end (one barrier), in attn_partial's layout ([kv_head][chunk][g][PART]) for attn_merge.
// q8 and qmeta: the queries in 8 bits as step_ingest wrote them (hack_attend's layout).
template <int G>
__device__ void hack_arena_attend(const unsigned long long* __restrict__ list_addr, const int* __restrict__ list_rows,
                                  const unsigned long long* __restrict__ list_mask, int cap, int page_shift,
                                  int listed, const unsigned* __restrict__ q8, const float* __restrict__ qmeta,
                                  float scale, float* __restrict__ part) {
  const int h = blockIdx.y, chunk = blockIdx.x, t = threadIdx.x, warp = t / 32, lane = t % 32;
  __shared__ __align__(16) unsigned q_s[G][HEAD_DIM / 4];
  __shared__ float qm_s[G][KP][3];
  // Each warp's 7-bit probabilities of the current block, per head (byte r: row r).
  __shared__ __align__(16) unsigned char p_s[ARENA_WARPS][G][HBLK];
  // Each warp's partial at the end: output, running maximum and sum per head.
  __shared__ float o_s[ARENA_WARPS][G][HEAD_DIM];
  __shared__ float m_w[ARENA_WARPS][G], l_w[ARENA_WARPS][G];
  // Each warp's current piece's page addresses (0 past its last page).
  __shared__ unsigned long long pages_s[ARENA_WARPS][MAX_PAGES];
  const unsigned long long* pages = pages_s[warp];
  hack_load_queries<G>(q8, qmeta, h, q_s, qm_s);
  __syncthreads();
  const int ch0 = lane * ARENA_CPL;  // this lane's first value channel
  float m[G], l[G], o[G][ARENA_CPL];
#pragma unroll
  for (int g = 0; g < G; g++) {
    m[g] = NEG_INF;
    l[g] = 0.f;
#pragma unroll
    for (int c = 0; c < ARENA_CPL; c++) o[g][c] = 0.f;
  }
  const int per = (listed + gridDim.x - 1) / gridDim.x;
  const int b0 = chunk * per, b1 = min(listed, b0 + per);
  for (int i = b0 + warp; i < b1; i += ARENA_WARPS) {
    const long long e = (long long)h * cap + i;
    const unsigned long long mask = list_mask[e];
    // No row to attend (a padding entry): nothing read. `mask` is the same for the warp.
    if (mask == 0ull) continue;
    const int n = list_rows[e];
    // The previous piece's reads of the page addresses are done (the __syncwarp closing it).
    if (lane < MAX_PAGES) pages_s[warp][lane] = list_addr[e * MAX_PAGES + lane];
    __syncwarp();
    const HackGroupLayout lay(n);
    // Every load of both rows first (one memory round trip), then the scores.
    uint4 kw[2][KWORDS / 4];
    float sk[2][KP], mk[2][KP], ks[2][KP];
    bool live[2];
#pragma unroll
    for (int half = 0; half < 2; half++) {
      const int r = lane + 32 * half;
      live[half] = mask >> r & 1ull;
      // A row's codes are HEAD_DIM/4 bytes at a multiple of that: never across a page.
      const uint4* row = reinterpret_cast<const uint4*>(arena_byte(pages, r * (HEAD_DIM / 4), page_shift));
#pragma unroll
      for (int j = 0; j < KWORDS / 4; j++) kw[half][j] = live[half] ? row[j] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int k = 0; k < KP; k++) {
        const int at = 2 * (r * KP + k);
        sk[half][k] = arena_half(pages, lay.kscale + at, page_shift, live[half]);
        mk[half][k] = arena_half(pages, lay.kmin + at, page_shift, live[half]);
        const unsigned short* sum = reinterpret_cast<const unsigned short*>(arena_byte(pages, lay.ksum + at, page_shift));
        ks[half][k] = live[half] ? (float)*sum : 0.f;
      }
    }
    float s[2][G];
#pragma unroll
    for (int half = 0; half < 2; half++)
#pragma unroll
      for (int g = 0; g < G; g++) s[half][g] = 0.f;
#pragma unroll
    for (int k = 0; k < KP; k++) {
      unsigned acc[2][G];
#pragma unroll
      for (int half = 0; half < 2; half++)
#pragma unroll
        for (int g = 0; g < G; g++) acc[half][g] = 0u;
      // The partition's four words (64 codes) of each row.
#pragma unroll
      for (int w = 4 * k; w < 4 * k + 4; w++) {
        unsigned c4[2][4];
#pragma unroll
        for (int half = 0; half < 2; half++) {
          const uint4 v = kw[half][w / 4];
          const unsigned word = (w % 4 == 0) ? v.x : (w % 4 == 1) ? v.y : (w % 4 == 2) ? v.z : v.w;
#pragma unroll
          for (int sh = 0; sh < 4; sh++) c4[half][sh] = word >> (2 * sh) & 0x03030303u;
        }
#pragma unroll
        for (int g = 0; g < G; g++) {
          // The same four query words for every lane: a broadcast.
          const uint4 qw = reinterpret_cast<const uint4*>(q_s[g])[w];
#pragma unroll
          for (int half = 0; half < 2; half++) {
            unsigned a = __dp4a(c4[half][0], qw.x, acc[half][g]);
            a = __dp4a(c4[half][1], qw.y, a);
            a = __dp4a(c4[half][2], qw.z, a);
            acc[half][g] = __dp4a(c4[half][3], qw.w, a);
          }
        }
      }
#pragma unroll
      for (int g = 0; g < G; g++) {
        const float sq = qm_s[g][k][0], mq = qm_s[g][k][1], cq = qm_s[g][k][2];
#pragma unroll
        for (int half = 0; half < 2; half++)
          s[half][g] += sk[half][k] * (sq * (float)acc[half][g] + mq * ks[half][k]) + mk[half][k] * cq;
      }
    }
    // Softmax bookkeeping and 7-bit probabilities per head; bit r of `alive`: some head
    // gives row r a nonzero weight.
    unsigned long long alive = 0ull;
    float corr[G], step[G], psum[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
      const float a = live[0] ? s[0][g] * scale : NEG_INF, c = live[1] ? s[1][g] * scale : NEG_INF;
      float bm = fmaxf(a, c);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, off));
      const float m_new = fmaxf(m[g], bm);
      step[g] = m_new == NEG_INF ? 0.f : __expf(bm - m_new) / P_LEVELS;
      unsigned ca = 0, cc = 0;
      if (step[g] > 0.f) {
        ca = (unsigned)fminf(__expf(a - m_new) / step[g] + 0.5f, P_LEVELS);
        cc = (unsigned)fminf(__expf(c - m_new) / step[g] + 0.5f, P_LEVELS);
      }
      unsigned sum = ca + cc;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      p_s[warp][g][lane] = (unsigned char)ca;
      p_s[warp][g][lane + 32] = (unsigned char)cc;
      alive |= (unsigned long long)__ballot_sync(0xffffffffu, cc != 0) << 32 | __ballot_sync(0xffffffffu, ca != 0);
      corr[g] = m[g] == NEG_INF ? 0.f : __expf(m[g] - m_new);
      psum[g] = (float)sum;
      l[g] = l[g] * corr[g] + step[g] * psum[g];
      m[g] = m_new;
    }
    __syncwarp();
    // Values: this lane's ARENA_CPL channels of each quad (four rows) whose rows weigh
    // something for some head (`alive` is the same for the warp: no divergence); a quad's
    // channel bytes are at a multiple of ARENA_CPL within the block's pages, never across one.
    unsigned acc[G][ARENA_CPL];
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
      for (int c = 0; c < ARENA_CPL; c++) acc[g][c] = 0u;
#pragma unroll
    for (int q4 = 0; q4 < HBLK / 16; q4++) {
      unsigned char vb[4][ARENA_CPL];
#pragma unroll
      for (int u = 0; u < 4; u++) {
        const int qi = 4 * q4 + u;
        const bool used = (alive >> (4 * qi) & 0xfull) != 0ull;
        const unsigned char* at = arena_byte(pages, lay.vc + qi * HEAD_DIM + ch0, page_shift);
#if ARENA_CPL % 4 == 0
#pragma unroll
        for (int j = 0; j < ARENA_CPL / 4; j++) {
          const unsigned word = used ? reinterpret_cast<const unsigned*>(at)[j] : 0u;
#pragma unroll
          for (int b = 0; b < 4; b++) vb[u][4 * j + b] = (unsigned char)(word >> (8 * b));
        }
#else
#pragma unroll
        for (int j = 0; j < ARENA_CPL / 2; j++) {
          const unsigned pair = used ? reinterpret_cast<const unsigned short*>(at)[j] : 0u;
          vb[u][2 * j] = (unsigned char)pair;
          vb[u][2 * j + 1] = (unsigned char)(pair >> 8);
        }
#endif
      }
#pragma unroll
      for (int g = 0; g < G; g++) {
        const uint4 pw = reinterpret_cast<const uint4*>(p_s[warp][g])[q4];
#pragma unroll
        for (int c = 0; c < ARENA_CPL; c++) {
          unsigned a = __dp4a(spread4(vb[0][c]), pw.x, acc[g][c]);
          a = __dp4a(spread4(vb[1][c]), pw.y, a);
          a = __dp4a(spread4(vb[2][c]), pw.z, a);
          acc[g][c] = __dp4a(spread4(vb[3][c]), pw.w, a);
        }
      }
    }
#pragma unroll
    for (int c = 0; c < ARENA_CPL; c++) {
      const float sv = arena_half(pages, lay.vscale + 2 * (ch0 + c), page_shift, true);
      const float mv = arena_half(pages, lay.vmin + 2 * (ch0 + c), page_shift, true);
#pragma unroll
      for (int g = 0; g < G; g++) o[g][c] = o[g][c] * corr[g] + step[g] * (sv * (float)acc[g][c] + mv * psum[g]);
    }
    // The next piece's probabilities and page addresses overwrite p_s and pages_s only after
    // every lane read these.
    __syncwarp();
  }
  // Fold the CTA's warps: each head's maximum over the warps, their sums and outputs
  // rescaled to it (a warp that attended nothing has maximum −∞ and adds nothing).
#pragma unroll
  for (int g = 0; g < G; g++) {
#pragma unroll
    for (int c = 0; c < ARENA_CPL; c++) o_s[warp][g][ch0 + c] = o[g][c];
    if (lane == 0) { m_w[warp][g] = m[g]; l_w[warp][g] = l[g]; }
  }
  __syncthreads();
  float* out = part + ((long long)(h * gridDim.x + chunk) * G) * PART;
  for (int x = t; x < G * HEAD_DIM; x += HACK_THREADS) {
    const int g = x / HEAD_DIM, ch = x % HEAD_DIM;
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < ARENA_WARPS; w++) mx = fmaxf(mx, m_w[w][g]);
    float acc = 0.f, sum = 0.f;
    if (mx != NEG_INF) {
#pragma unroll
      for (int w = 0; w < ARENA_WARPS; w++) {
        if (m_w[w][g] == NEG_INF) continue;
        const float f = __expf(m_w[w][g] - mx);
        acc += o_s[w][g][ch] * f;
        sum += l_w[w][g] * f;
      }
    }
    out[g * PART + ch] = acc;
    if (ch == 0) { out[g * PART + HEAD_DIM] = mx; out[g * PART + HEAD_DIM + 1] = sum; }
  }
}

// One CTA of HACK_THREADS per (slice of the head's listed pieces, KV head): the head's
// counts[h] pieces are spread evenly over the gridDim.x CTAs of the head (the count changes
// step by step, the grid does not), one warp per piece (hack_arena_attend), pages of
// 2^page_shift bytes. Up to groups of 4 at d ≤ 128, registers are capped for 4 CTAs (16
// warps) per SM: each warp is a chain of dependent loads, and more of them hide it.
#define ARENA_MIN_CTAS(G) ((G) <= 4 && HEAD_DIM <= 128 ? 4 : 1)
#define HACK_ARENA(G)                                                                                        \
  extern "C" __global__ void __launch_bounds__(HACK_THREADS, ARENA_MIN_CTAS(G)) hack_arena_g##G(          \
      const unsigned long long* __restrict__ list_addr, const int* __restrict__ list_rows,                   \
      const unsigned long long* __restrict__ list_mask, const int* __restrict__ counts, int cap,             \
      int page_shift, const unsigned* __restrict__ q8, const float* __restrict__ qmeta, float scale,          \
      float* __restrict__ part) {                                                                            \
    hack_arena_attend<G>(list_addr, list_rows, list_mask, cap, page_shift, counts[blockIdx.y], q8, qmeta, scale, part); \
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
