
// ---------------------------------------------------------------------------------------
// HACK 2-bit homomorphic decode attention (the `hack2` codec), layout as `HackRows` on the
// CPU: keys row by row (HEAD_DIM/4 code bytes, per 64-dim partition an f16 minimum and
// scale and a u16 code sum), values in blocks of 64 rows as token quads (per quad HEAD_DIM
// bytes, byte c = channel c of four rows; per block and channel an f16 minimum and scale).
// Scores are `dp4a` products of the 8-bit query with the 2-bit key codes plus the
// correction terms; values are `dp4a` products of 7-bit probabilities (as on the CPU) with
// the value codes. Nothing is dequantized. Needs HEAD_DIM % 64 == 0.
// ---------------------------------------------------------------------------------------

#if HEAD_DIM % 64 == 0
#define HBLK 64
#define KP (HEAD_DIM / 64)
#define KWORDS (HEAD_DIM / 16)
#define HACK_THREADS 128
#define P_LEVELS 127.f

// One byte of four 2-bit codes → four bytes, one code each (code i in byte i), by two
// multiplies: codes 0 and 2 (x & 0x33) times 1 + 2^12 land in bytes 0 and 2, codes 1 and 3
// (x & 0xcc) times 2^6 + 2^18 in bytes 1 and 3; the partial products never overlap, so
// the sums carry nothing into the bits the mask keeps.
__device__ __forceinline__ unsigned spread4(unsigned x) {
  return ((x & 0x33u) * 0x1001u + (x & 0xccu) * 0x40040u) & 0x03030303u;
}

// Where the attention reads the 2-bit rows of one value block: `at(h, i)` moves to the
// i-th listed block of KV head h and returns the mask of its rows to attend; then `kword`
// (word w of key row r's codes), `kmeta` (row r's partition k: scale, minimum, code sum),
// `vbyte` (quad qi's byte of channel ch) and `vmeta` (channel ch's scale and minimum).

// Every head's rows in the arrays of `upload_hack`, one after another; all blocks, or a
// sparse plan's listed blocks and row masks.
struct HackArraysSrc {
  static constexpr bool SYNC_AFTER_AT = false;
  const unsigned* kc; const unsigned short* kmin; const unsigned short* kscale;
  const unsigned short* ksum; const unsigned char* vc; const unsigned short* vmin;
  const unsigned short* vscale; int rows;
  const int* sel_blocks; const unsigned long long* sel_masks; int n_sel;
  long long row0, vblock;
  __device__ unsigned long long at(int h, int i) {
    const int blocks = (rows + HBLK - 1) / HBLK;
    const int b = sel_blocks ? sel_blocks[(long long)h * n_sel + i] : i;
    unsigned long long mask = sel_blocks ? sel_masks[(long long)h * n_sel + i] : ~0ull;
    const int n = min(HBLK, rows - b * HBLK);
    if (n < HBLK) mask &= (1ull << n) - 1ull;
    row0 = (long long)h * rows + (long long)b * HBLK;
    vblock = (long long)h * blocks + b;
    return mask;
  }
  __device__ unsigned kword(int r, int w) const { return kc[(row0 + r) * KWORDS + w]; }
  __device__ void kmeta(int r, int k, float& sk, float& mk, float& ks) const {
    const long long i = (row0 + r) * KP + k;
    sk = h2f(kscale[i]); mk = h2f(kmin[i]); ks = (float)ksum[i];
  }
  __device__ unsigned vbyte(int qi, int ch) const { return vc[(vblock * (HBLK / 4) + qi) * HEAD_DIM + ch]; }
  __device__ void vmeta(int ch, float& sv, float& mv) const {
    sv = h2f(vscale[vblock * HEAD_DIM + ch]); mv = h2f(vmin[vblock * HEAD_DIM + ch]);
  }
};

// Value blocks in the group layout of `HackRows::group_bytes` (key codes of its n rows,
// value codes, key minima, key scales, key code sums, value minima, value scales), each
// spread over pages of `page_bytes` that need not be adjacent: the buffer manager's blocks,
// read in the pinned Host arena or the Gpu tier. Listed block i of head h has its page
// addresses at pages[(h·n_sel + i)·MAX_PAGES…], its row count and its mask.
#define MAX_PAGES 8
// The byte offsets of the group layout's parts for a value block of n rows.
struct HackGroupLayout {
  int vc, kmin, kscale, ksum, vmin, vscale;
  HackGroupLayout() = default;
  __device__ explicit HackGroupLayout(int n)
      : vc(n * (HEAD_DIM / 4)), kmin(vc + (HBLK / 4) * HEAD_DIM), kscale(kmin + 2 * n * KP),
        ksum(kscale + 2 * n * KP), vmin(ksum + 2 * n * KP), vscale(vmin + 2 * HEAD_DIM) {}
};
// The page addresses of the block a CTA is at, loaded once per block by `at` (a load of
// the address from global memory on every byte access cost the paged kernel ~50%).
__shared__ unsigned long long hack_pages_s[MAX_PAGES];
struct HackPagedSrc {
  // `at` writes shared memory that every thread then reads: a barrier must follow it.
  static constexpr bool SYNC_AFTER_AT = true;
  const unsigned long long* pages; const unsigned long long* masks; const int* rows_of;
  int n_sel; int page_bytes; int page_shift;
  // The current block's layout.
  HackGroupLayout lay;
  __device__ unsigned long long at(int h, int i) {
    const long long g = (long long)h * n_sel + i;
    if (threadIdx.x < MAX_PAGES) hack_pages_s[threadIdx.x] = pages[g * MAX_PAGES + threadIdx.x];
    lay = HackGroupLayout(rows_of[g]);
    return masks[g];
  }
  // With pages of a power of two bytes (the buffer manager's 2 KiB), a shift and a mask;
  // otherwise a division.
  __device__ const unsigned char* byte(int off) const {
    const int p = page_shift >= 0 ? off >> page_shift : off / page_bytes;
    return reinterpret_cast<const unsigned char*>(hack_pages_s[p]) + (off - p * page_bytes);
  }
  __device__ unsigned short half_at(int off) const { return *reinterpret_cast<const unsigned short*>(byte(off)); }
  __device__ unsigned kword(int r, int w) const {
    return *reinterpret_cast<const unsigned*>(byte(r * (HEAD_DIM / 4) + 4 * w));
  }
  __device__ void kmeta(int r, int k, float& sk, float& mk, float& ks) const {
    const int i = 2 * (r * KP + k);
    sk = h2f(half_at(lay.kscale + i)); mk = h2f(half_at(lay.kmin + i)); ks = (float)half_at(lay.ksum + i);
  }
  __device__ unsigned vbyte(int qi, int ch) const { return *byte(lay.vc + qi * HEAD_DIM + ch); }
  __device__ void vmeta(int ch, float& sv, float& mv) const {
    sv = h2f(half_at(lay.vscale + 2 * ch)); mv = h2f(half_at(lay.vmin + 2 * ch));
  }
};

// Quantizes one 64-dim partition `x` of a query (f32) to 8 bits, as `Quantized8::encode`
// does on the CPU (same IEEE operations, no contraction: the same codes), one warp: writes
// the partition's 16 words in the score loop's order (hack_attend) to `words` and its
// scale, minimum and scale·Σcodes + 64·minimum to `meta`. `codes` is 64 bytes of the
// warp's own shared memory. Every lane of the warp calls it.
__device__ void hack_quantize_partition(const float* __restrict__ x, unsigned char* codes, unsigned* __restrict__ words,
                                        float* __restrict__ meta) {
  const int lane = threadIdx.x % 32;
  const float a = x[lane], b = x[lane + 32];
  float lo = fminf(a, b), hi = fmaxf(a, b);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, off));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, off));
  }
  const float sc = __fdiv_rn(fmaxf(__fsub_rn(hi, lo), 0.f), 255.f);
  const float inv = sc > 0.f ? __fdiv_rn(1.f, sc) : 0.f;
  const unsigned ca = (unsigned)fminf(__fadd_rn(__fmul_rn(__fsub_rn(a, lo), inv), 0.5f), 255.f);
  const unsigned cb = (unsigned)fminf(__fadd_rn(__fmul_rn(__fsub_rn(b, lo), inv), 0.5f), 255.f);
  unsigned sum = ca + cb;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  codes[lane] = (unsigned char)ca;
  codes[lane + 32] = (unsigned char)cb;
  __syncwarp();
  // Word s of dims 16j.. holds dims 16j+s, 16j+4+s, 16j+8+s, 16j+12+s.
  if (lane < 16) {
    const unsigned char* c = codes + 16 * (lane / 4) + lane % 4;
    words[lane] = (unsigned)c[0] | (unsigned)c[4] << 8 | (unsigned)c[8] << 16 | (unsigned)c[12] << 24;
  }
  if (lane == 0) {
    meta[0] = sc;
    meta[1] = lo;
    meta[2] = __fadd_rn(__fmul_rn(sc, (float)sum), __fmul_rn(64.f, lo));
  }
  __syncwarp();
}

// KV head h's G query heads in 8 bits (q8, qmeta in hack_attend's layout) into a CTA's
// shared memory; every thread of the CTA (HACK_THREADS) calls it, a barrier must follow.
template <int G>
__device__ void hack_load_queries(const unsigned* __restrict__ q8, const float* __restrict__ qmeta, int h,
                                  unsigned (*q_s)[HEAD_DIM / 4], float (*qm_s)[KP][3]) {
  for (int i = threadIdx.x; i < G * (HEAD_DIM / 4); i += HACK_THREADS)
    q_s[i / (HEAD_DIM / 4)][i % (HEAD_DIM / 4)] = q8[(h * G) * (HEAD_DIM / 4) + i];
  for (int i = threadIdx.x; i < G * KP * 3; i += HACK_THREADS)
    qm_s[i / (KP * 3)][(i / 3) % KP][i % 3] = qmeta[(h * G) * KP * 3 + i];
}

// One CTA per (chunk of `chunk_blocks` listed value blocks, KV head), templated on the GQA
// group G (one kernel per group size: every loop over the group is unrolled and no lane
// issues work for heads past it); partials in the layout of attn_partial
// ([kv_head][chunk][g][PART]) so attn_merge folds them. Only the rows set in a block's mask
// count (the others score −∞: probability 0, no value read changes the sums), as
// `HackRows::attend` over row runs does on the CPU.
// q8: [q_heads][HEAD_DIM/4] words of 8-bit query codes, each 16 dimensions as four words
// in the order the score loop isolates the key codes: word s of dims 16w.. holds dims
// 16w+s, 16w+4+s, 16w+8+s, 16w+12+s (so `(key word >> 2s) & 0x03030303` pairs with it);
// qmeta: [q_heads][KP][3] = scale, minimum, scale·Σcodes + 64·minimum.
template <int G, class Src>
__device__ void hack_attend(Src src, int listed, const unsigned* __restrict__ q8,
                            const float* __restrict__ qmeta, float scale, int chunk_blocks, float* __restrict__ part) {
  const int h = blockIdx.y, chunk = blockIdx.x, t = threadIdx.x;
  const int warp = t / 32, lane = t % 32;
  __shared__ __align__(16) unsigned q_s[G][HEAD_DIM / 4];
  __shared__ float qm_s[G][KP][3];
  __shared__ float score_s[G][HBLK];
  __shared__ __align__(16) unsigned p8_s[G][HBLK / 4];
  __shared__ float m_s[G], l_s[G], corr_s[G], step_s[G], psum_s[G];
  // Bit r: some head gives row r of the current block a nonzero 7-bit weight.
  __shared__ unsigned long long live_s;
  hack_load_queries<G>(q8, qmeta, h, q_s, qm_s);
  if (t < G) { m_s[t] = NEG_INF; l_s[t] = 0.f; }
  // Each thread owns channels t and t + 128 of every head's output.
  float o[G][(HEAD_DIM + HACK_THREADS - 1) / HACK_THREADS];
#pragma unroll
  for (int g = 0; g < G; g++)
#pragma unroll
    for (int j = 0; j < (HEAD_DIM + HACK_THREADS - 1) / HACK_THREADS; j++) o[g][j] = 0.f;
  __syncthreads();
  const int b0 = chunk * chunk_blocks, b1 = min(listed, b0 + chunk_blocks);
  for (int i = b0; i < b1; i++) {
    const unsigned long long mask = src.at(h, i);
    if (Src::SYNC_AFTER_AT) __syncthreads();
    // No row to attend (a padding entry): nothing read, the softmax state is unchanged.
    // The mask is the same for the whole CTA, so every thread skips the barriers alike.
    if (mask == 0ull) continue;
    // Cleared before the barrier after the scores; set by the softmax warps after it.
    if (t == 0) live_s = 0ull;
    // Scores: KWORDS lanes per row, 16 codes (4 bytes) per lane, PASSES rows per thread.
    // Every pass's loads are issued before any is used: one memory round trip, not PASSES.
    constexpr int per_pass = HACK_THREADS / KWORDS, PASSES = HBLK / per_pass;
    const int w = t % KWORDS, k = w / 4;  // this lane's word and 64-dim partition
    unsigned words[PASSES];
    float skp[PASSES], mkp[PASSES], ksp[PASSES];
#pragma unroll
    for (int pass = 0; pass < PASSES; pass++) {
      const int r = pass * per_pass + t / KWORDS;
      const bool live = mask >> r & 1ull;
      words[pass] = live ? src.kword(r, w) : 0u;
      skp[pass] = mkp[pass] = ksp[pass] = 0.f;
      if (live) src.kmeta(r, k, skp[pass], mkp[pass], ksp[pass]);
    }
#pragma unroll
    for (int pass = 0; pass < PASSES; pass++) {
      const int r = pass * per_pass + t / KWORDS;
      const bool live = mask >> r & 1ull;
      const unsigned word = words[pass];
      const float sk = skp[pass], mk = mkp[pass], ks = ksp[pass];
      // Code s of each byte in that byte's lane: two instructions per four codes.
      unsigned c4[4];
#pragma unroll
      for (int s = 0; s < 4; s++) c4[s] = word >> (2 * s) & 0x03030303u;
#pragma unroll
      for (int g = 0; g < G; g++) {
        // This lane's four query words in one 16-byte shared load.
        const uint4 qw = reinterpret_cast<const uint4*>(q_s[g])[w];
        unsigned acc = __dp4a(c4[0], qw.x, 0u);
        acc = __dp4a(c4[1], qw.y, acc);
        acc = __dp4a(c4[2], qw.z, acc);
        acc = __dp4a(c4[3], qw.w, acc);
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        const float sq = qm_s[g][k][0], mq = qm_s[g][k][1], cq = qm_s[g][k][2];
        float sc = (w % 4 == 0) ? sk * (sq * (float)acc + mq * ks) + mk * cq : 0.f;
#pragma unroll
        for (int off = 4; off < KWORDS; off <<= 1) sc += __shfl_xor_sync(0xffffffffu, sc, off);
        if (w == 0) score_s[g][r] = live ? sc * scale : NEG_INF;
      }
    }
    __syncthreads();
    // Softmax bookkeeping and 7-bit probabilities, one warp per head.
    for (int g = warp; g < G; g += HACK_THREADS / 32) {
      const float a = score_s[g][lane], c = score_s[g][lane + 32];
      float bm = fmaxf(a, c);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, off));
      const float m_old = m_s[g], m_new = fmaxf(m_old, bm);
      const float step = m_new == NEG_INF ? 0.f : __expf(bm - m_new) / P_LEVELS;
      unsigned ca = 0, cc = 0;
      if (step > 0.f) {
        ca = (unsigned)fminf(__expf(a - m_new) / step + 0.5f, P_LEVELS);
        cc = (unsigned)fminf(__expf(c - m_new) / step + 0.5f, P_LEVELS);
      }
      unsigned sum = ca + cc;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      reinterpret_cast<unsigned char*>(p8_s[g])[lane] = (unsigned char)ca;
      reinterpret_cast<unsigned char*>(p8_s[g])[lane + 32] = (unsigned char)cc;
      const unsigned lo_live = __ballot_sync(0xffffffffu, ca != 0), hi_live = __ballot_sync(0xffffffffu, cc != 0);
      if (lane == 0 && (lo_live | hi_live) != 0) atomicOr(&live_s, (unsigned long long)hi_live << 32 | lo_live);
      if (lane == 0) {
        const float corr = m_old == NEG_INF ? 0.f : __expf(m_old - m_new);
        corr_s[g] = corr;
        l_s[g] = l_s[g] * corr + step * (float)sum;
        m_s[g] = m_new;
        step_s[g] = step;
        psum_s[g] = (float)sum;
      }
    }
    __syncthreads();
    // Values: one thread per channel, dp4a over each quad's four rows. A quad whose four
    // rows weigh zero for every head adds nothing: its codes are not read (with peaked
    // attention most are not; the test is the same for the whole CTA, so nothing diverges).
    const unsigned long long live = live_s;
#pragma unroll
    for (int j = 0; j < (HEAD_DIM + HACK_THREADS - 1) / HACK_THREADS; j++) {
      const int ch = t + j * HACK_THREADS;
      if (ch < HEAD_DIM) {
        unsigned acc[G];
#pragma unroll
        for (int g = 0; g < G; g++) acc[g] = 0;
        // Four quads a step: each head's four probability words in one 16-byte shared load.
#pragma unroll
        for (int q4 = 0; q4 < HBLK / 16; q4++) {
          unsigned sp[4];
#pragma unroll
          for (int u = 0; u < 4; u++)
            sp[u] = (live >> (4 * (4 * q4 + u)) & 0xfull) != 0ull ? spread4(src.vbyte(4 * q4 + u, ch)) : 0u;
#pragma unroll
          for (int g = 0; g < G; g++) {
            const uint4 pw = reinterpret_cast<const uint4*>(p8_s[g])[q4];
            acc[g] = __dp4a(sp[0], pw.x, acc[g]);
            acc[g] = __dp4a(sp[1], pw.y, acc[g]);
            acc[g] = __dp4a(sp[2], pw.z, acc[g]);
            acc[g] = __dp4a(sp[3], pw.w, acc[g]);
          }
        }
        float sv, mv;
        src.vmeta(ch, sv, mv);
#pragma unroll
        for (int g = 0; g < G; g++)
          o[g][j] = o[g][j] * corr_s[g] + step_s[g] * (sv * (float)acc[g] + mv * psum_s[g]);
      }
    }
    __syncthreads();
  }
  float* out = part + ((long long)(h * gridDim.x + chunk) * G) * PART;
#pragma unroll
  for (int g = 0; g < G; g++) {
#pragma unroll
    for (int j = 0; j < (HEAD_DIM + HACK_THREADS - 1) / HACK_THREADS; j++) {
      const int ch = t + j * HACK_THREADS;
      if (ch < HEAD_DIM) out[g * PART + ch] = o[g][j];
    }
    if (t == 0) { out[g * PART + HEAD_DIM] = m_s[g]; out[g * PART + HEAD_DIM + 1] = l_s[g]; }
  }
}

// Per group size G: hack_partial_g{G}, homomorphic decode over the arrays of `upload_hack`
// (every value block, or with `sel_blocks` a sparse plan's n_sel listed blocks per head and
// their 64-bit row masks); hack_paged_g{G}, over n_sel value blocks per head in the group
// layout spread over pages (see HackPagedSrc).
#define HACK_KERNELS(G)                                                                                      \
  extern "C" __global__ void hack_partial_g##G(                                                             \
      const unsigned* __restrict__ kc, const unsigned short* __restrict__ kmin,                              \
      const unsigned short* __restrict__ kscale, const unsigned short* __restrict__ ksum,                    \
      const unsigned char* __restrict__ vc, const unsigned short* __restrict__ vmin,                         \
      const unsigned short* __restrict__ vscale, int rows, const unsigned* __restrict__ q8,                  \
      const float* __restrict__ qmeta, float scale, int chunk_blocks, float* __restrict__ part,               \
      const int* __restrict__ sel_blocks, const unsigned long long* __restrict__ sel_masks, int n_sel) {      \
    HackArraysSrc src;                                                                                       \
    src.kc = kc; src.kmin = kmin; src.kscale = kscale; src.ksum = ksum;                                      \
    src.vc = vc; src.vmin = vmin; src.vscale = vscale; src.rows = rows;                                      \
    src.sel_blocks = sel_blocks; src.sel_masks = sel_masks; src.n_sel = n_sel;                               \
    src.row0 = 0; src.vblock = 0;                                                                            \
    const int listed = sel_blocks ? n_sel : (rows + HBLK - 1) / HBLK;                                        \
    hack_attend<G>(src, listed, q8, qmeta, scale, chunk_blocks, part);                                                \
  }                                                                                                          \
  extern "C" __global__ void hack_paged_g##G(                                                               \
      const unsigned long long* __restrict__ pages, const unsigned long long* __restrict__ masks,             \
      const int* __restrict__ rows_of, int n_sel, int page_bytes, const unsigned* __restrict__ q8,           \
      const float* __restrict__ qmeta, float scale, int chunk_blocks, float* __restrict__ part) {             \
    HackPagedSrc src;                                                                                        \
    src.pages = pages; src.masks = masks; src.rows_of = rows_of; src.n_sel = n_sel;                          \
    src.page_bytes = page_bytes; src.page_shift = page_bytes & (page_bytes - 1) ? -1 : __ffs(page_bytes) - 1; \
    src.lay = HackGroupLayout(0);                                                                            \
    hack_attend<G>(src, n_sel, q8, qmeta, scale, chunk_blocks, part);                                                 \
  }
HACK_KERNELS(1)
HACK_KERNELS(2)
HACK_KERNELS(3)
HACK_KERNELS(4)
HACK_KERNELS(5)
HACK_KERNELS(6)
HACK_KERNELS(7)
HACK_KERNELS(8)

// Dequantize-then-attend's first half: writes the f16 keys and values of every row
// ([kv_head][rows][HEAD_DIM]) from the 2-bit form, one CTA per (value block, KV head).
extern "C" __global__ void hack_dequant(
    const unsigned char* __restrict__ kc, const unsigned short* __restrict__ kmin,
    const unsigned short* __restrict__ kscale, const unsigned char* __restrict__ vc,
    const unsigned short* __restrict__ vmin, const unsigned short* __restrict__ vscale, int rows,
    unsigned short* __restrict__ k, unsigned short* __restrict__ v) {
  const int b = blockIdx.x, h = blockIdx.y;
  const int blocks = (rows + HBLK - 1) / HBLK;
  const long long vblock = (long long)h * blocks + b;
  for (int i = threadIdx.x; i < HBLK * HEAD_DIM; i += blockDim.x) {
    const int r = i / HEAD_DIM, j = i % HEAD_DIM, row = b * HBLK + r;
    if (row >= rows) break;
    const long long at = (long long)h * rows + row;
    const unsigned kcode = kc[at * (HEAD_DIM / 4) + j / 4] >> (2 * (j % 4)) & 3u;
    const long long km = at * KP + j / 64;
    k[at * HEAD_DIM + j] = f2h(h2f(kscale[km]) * (float)kcode + h2f(kmin[km]));
    const unsigned vcode = vc[(vblock * (HBLK / 4) + r / 4) * HEAD_DIM + j] >> (2 * (r % 4)) & 3u;
    v[at * HEAD_DIM + j] =
        f2h(h2f(vscale[vblock * HEAD_DIM + j]) * (float)vcode + h2f(vmin[vblock * HEAD_DIM + j]));
  }
}
#endif  // HEAD_DIM % 64 == 0
