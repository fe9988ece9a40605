
// ---------------------------------------------------------------------------------------
// kv43 homomorphic decode attention (the `kv43` codec), layout as `Kv43Rows` on the CPU:
// keys per channel over key groups, 4-bit codes in tiles of 8 rows (per octet of channels
// 32 bytes: word r = row r, byte i = channel 8o+i in the low nibble, 8o+4+i in the high),
// an optional fifth-bit plane (per tile and octet a byte per row), a u16 code sum per row
// and 64-dim partition (per tile partition-major), per key group and channel an f16
// minimum and scale; values as one word per 8 rows and channel (byte i: row i's 3- or
// 4-bit code in the low nibble, row i+4's in the high; `upload_kv43` moves the bits of the
// CPU's planes there), per value block and channel an f16 minimum and scale. Per key group each query head is scaled by the channel scales and
// coded to 8 bits per 64-dim partition (f16 minimum and step, as the CPU does); scores are
// `dp4a` products with the key codes plus `a·U + b·dot`; per 64 rows the probabilities are
// coded to 8 bits against the block's largest and the values weighed by `dp4a` on their
// codes. Nothing is dequantized. Needs HEAD_DIM % 64 == 0, key groups and value blocks that
// are multiples of 64 rows.
// ---------------------------------------------------------------------------------------

#if HEAD_DIM % 64 == 0
#define K43_ROWS 64
#define K43_KP (HEAD_DIM / 64)
#define K43_THREADS 128
#define K43_LEVELS 255.f

// Bits 0..3 of x, each to bit 0 of its own byte (bit i to byte i).
__device__ __forceinline__ unsigned k43_spread(unsigned x) { return ((x & 0xfu) * 0x00204081u) & 0x01010101u; }

struct Kv43Src {
  const unsigned char* kc; const unsigned char* khigh; const unsigned short* kmin; const unsigned short* kscale;
  const unsigned short* ksum; const unsigned* vw; const unsigned short* vmin; const unsigned short* vscale;
  int rows, key_group, value_block;
};

// The G query heads of KV head h coded against key group `grp` into shared memory: codes
// (`codes_s`, HEAD_DIM bytes per head: read as words, word j = channels 4j..4j+3), per
// partition minimum `a_s` and step `b_s`, and `qm_s` = Σ q·m. Every thread calls it; a
// barrier must follow.
template <int G>
__device__ void k43_queries(const Kv43Src& s, int h, int grp, const float (*q_s)[HEAD_DIM],
                            unsigned char (*codes_s)[HEAD_DIM], float (*a_s)[K43_KP], float (*b_s)[K43_KP],
                            float* qm_s) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long g0 = ((long long)h * (s.rows / s.key_group) + grp) * HEAD_DIM;
  for (int item = warp; item < G * K43_KP; item += K43_THREADS / 32) {
    const int g = item / K43_KP, k = item % K43_KP;
    const int c0 = k * 64 + lane, c1 = c0 + 32;
    const float x0 = __fmul_rn(q_s[g][c0], h2f(s.kscale[g0 + c0]));
    const float x1 = __fmul_rn(q_s[g][c1], h2f(s.kscale[g0 + c1]));
    float lo = fminf(x0, x1), hi = fmaxf(x0, x1);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, off));
      hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, off));
    }
    // As `quantize_query_into`: an f16 minimum and step, codes a product with the step's
    // inverse.
    const float m = h2f(f2h(lo));
    const float st = h2f(f2h(__fdiv_rn(fmaxf(__fsub_rn(hi, m), 0.f), K43_LEVELS)));
    unsigned char c0c = 0, c1c = 0;
    if (st > 0.f) {
      const float inv = __fdiv_rn(1.f, st);
      c0c = (unsigned char)fminf(roundf(fmaxf(__fmul_rn(__fsub_rn(x0, m), inv), 0.f)), K43_LEVELS);
      c1c = (unsigned char)fminf(roundf(fmaxf(__fmul_rn(__fsub_rn(x1, m), inv), 0.f)), K43_LEVELS);
    }
    codes_s[g][c0] = c0c;
    codes_s[g][c1] = c1c;
    if (lane == 0) { a_s[g][k] = m; b_s[g][k] = st; }
  }
  for (int g = warp; g < G; g += K43_THREADS / 32) {
    float acc = 0.f;
    for (int c = lane; c < HEAD_DIM; c += 32) acc = __fadd_rn(acc, __fmul_rn(q_s[g][c], h2f(s.kmin[g0 + c])));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) qm_s[g] = acc;
  }
}

// Which 64-row blocks a decode attends: every block (`off` null), or per KV head h the
// entries off[h]..off[h+1] of `block` (ascending block numbers) with `mask` (bit r: the
// block's row r is attended; the others score −∞ and weigh nothing).
struct Kv43List {
  const int* off; const int* block; const unsigned long long* mask;
};

// One CTA per (chunk of `chunk_blocks` 64-row blocks or list entries, KV head), templated on
// the GQA group G; partials in attn_partial's layout ([kv_head][chunk][g][PART]) so
// attn_merge folds them (a CTA past its head's list writes m = −∞, which the merge skips).
// q: [q_heads][HEAD_DIM] f32 queries.
template <int G>
__device__ void kv43_attend(const Kv43Src s, const Kv43List list, const float* __restrict__ q, float scale,
                            int chunk_blocks, float* __restrict__ part) {
  const int h = blockIdx.y, chunk = blockIdx.x, t = threadIdx.x;
  const int warp = t / 32, lane = t % 32;
  __shared__ float q_s[G][HEAD_DIM];
  __shared__ __align__(16) unsigned char codes_s[G][HEAD_DIM];
  __shared__ float a_s[G][K43_KP], b_s[G][K43_KP], qm_s[G];
  __shared__ float sp_s[G][K43_KP][K43_ROWS];
  __shared__ float score_s[G][K43_ROWS];
  __shared__ __align__(16) unsigned p8_s[G][K43_ROWS / 4];
  __shared__ float m_s[G], l_s[G], corr_s[G], step_s[G], psum_s[G];
  for (int i = t; i < G * HEAD_DIM; i += K43_THREADS) q_s[i / HEAD_DIM][i % HEAD_DIM] = q[(long long)h * G * HEAD_DIM + i];
  if (t < G) { m_s[t] = NEG_INF; l_s[t] = 0.f; }
  constexpr int PER = (HEAD_DIM + K43_THREADS - 1) / K43_THREADS;
  float o[G][PER];
#pragma unroll
  for (int g = 0; g < G; g++)
#pragma unroll
    for (int j = 0; j < PER; j++) o[g][j] = 0.f;
  __syncthreads();
  const int first = list.off ? list.off[h] : 0;
  const int entries = list.off ? list.off[h + 1] - first : s.rows / K43_ROWS;
  const int e0 = chunk * chunk_blocks, e1 = min(entries, e0 + chunk_blocks);
  const long long tiles_h = (long long)h * (s.rows / 8);
  int group = -1;
  for (int e = e0; e < e1; e++) {
    const int b = list.off ? list.block[first + e] : e;
    const unsigned long long mask = list.off ? list.mask[first + e] : ~0ull;
    const int row0 = b * K43_ROWS;
    if (row0 / s.key_group != group) {
      group = row0 / s.key_group;
      k43_queries<G>(s, h, group, q_s, codes_s, a_s, b_s, qm_s);
      __syncthreads();
    }
    // Scores: per (row, partition) item eight octets, two dp4a each per head.
    for (int item = t; item < K43_ROWS * K43_KP; item += K43_THREADS) {
      const int r = item % K43_ROWS, k = item / K43_ROWS;
      const long long tile = tiles_h + (row0 + r) / 8;
      const int rr = r % 8;
      const unsigned char* base = s.kc + tile * (8 * HEAD_DIM / 2) + 4 * rr;
      unsigned dot[G], lo[8], hi[8];
#pragma unroll
      for (int g = 0; g < G; g++) dot[g] = 0u;
#pragma unroll
      for (int j = 0; j < 8; j++) {
        const unsigned word = *reinterpret_cast<const unsigned*>(base + (k * 8 + j) * 32);
        lo[j] = word & 0x0f0f0f0fu;
        hi[j] = (word >> 4) & 0x0f0f0f0fu;
      }
      if (s.khigh) {
#pragma unroll
        for (int j = 0; j < 8; j++) {
          const unsigned hb = s.khigh[tile * HEAD_DIM + (k * 8 + j) * 8 + rr];
          lo[j] |= k43_spread(hb) << 4;
          hi[j] |= k43_spread(hb >> 4) << 4;
        }
      }
      // The query words of partition k, four at a time (octets j and j + 1).
#pragma unroll
      for (int g = 0; g < G; g++) {
        const uint4* qv = reinterpret_cast<const uint4*>(codes_s[g]) + 4 * k;
#pragma unroll
        for (int jj = 0; jj < 4; jj++) {
          const uint4 w = qv[jj];
          dot[g] = __dp4a(lo[2 * jj], w.x, dot[g]);
          dot[g] = __dp4a(hi[2 * jj], w.y, dot[g]);
          dot[g] = __dp4a(lo[2 * jj + 1], w.z, dot[g]);
          dot[g] = __dp4a(hi[2 * jj + 1], w.w, dot[g]);
        }
      }
      const float u = (float)s.ksum[tile * (8 * K43_KP) + k * 8 + rr];
#pragma unroll
      for (int g = 0; g < G; g++) sp_s[g][k][r] = __fadd_rn(__fmul_rn(a_s[g][k], u), __fmul_rn(b_s[g][k], (float)dot[g]));
    }
    __syncthreads();
    for (int i = t; i < G * K43_ROWS; i += K43_THREADS) {
      const int g = i / K43_ROWS, r = i % K43_ROWS;
      float sc = qm_s[g];
#pragma unroll
      for (int k = 0; k < K43_KP; k++) sc = __fadd_rn(sc, sp_s[g][k][r]);
      score_s[g][r] = (mask >> r) & 1ull ? __fmul_rn(sc, scale) : NEG_INF;
    }
    __syncthreads();
    // Softmax bookkeeping and 8-bit probabilities, one warp per head.
    for (int g = warp; g < G; g += K43_THREADS / 32) {
      const float a = score_s[g][lane], c = score_s[g][lane + 32];
      float bm = fmaxf(a, c);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, off));
      const float m_old = m_s[g], m_new = fmaxf(m_old, bm);
      const float step = m_new == NEG_INF ? 0.f : __expf(bm - m_new) / K43_LEVELS;
      unsigned ca = 0, cc = 0;
      if (step > 0.f) {
        ca = (unsigned)fminf(__expf(a - m_new) / step + 0.5f, K43_LEVELS);
        cc = (unsigned)fminf(__expf(c - m_new) / step + 0.5f, K43_LEVELS);
      }
      unsigned sum = ca + cc;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      reinterpret_cast<unsigned char*>(p8_s[g])[lane] = (unsigned char)ca;
      reinterpret_cast<unsigned char*>(p8_s[g])[lane + 32] = (unsigned char)cc;
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
    // Values: one thread per channel; per 8 rows its word's low and high nibbles are the
    // codes of rows 0..3 and 4..7, each weighed by dp4a against four probability codes.
    const long long vgroup = ((long long)h * s.rows + row0) / 8;
    const long long vb = ((long long)h * s.rows + row0) / s.value_block;
#pragma unroll
    for (int j = 0; j < PER; j++) {
      const int ch = t + j * K43_THREADS;
      if (ch < HEAD_DIM) {
        unsigned acc[G], w[K43_ROWS / 8];
#pragma unroll
        for (int g = 0; g < G; g++) acc[g] = 0u;
#pragma unroll
        for (int i8 = 0; i8 < K43_ROWS / 8; i8++) w[i8] = s.vw[(vgroup + i8) * HEAD_DIM + ch];
#pragma unroll
        for (int g = 0; g < G; g++) {
          const uint4* pv = reinterpret_cast<const uint4*>(p8_s[g]);
#pragma unroll
          for (int i = 0; i < K43_ROWS / 16; i++) {
            const uint4 p = pv[i];
            acc[g] = __dp4a(w[2 * i] & 0x0f0f0f0fu, p.x, acc[g]);
            acc[g] = __dp4a((w[2 * i] >> 4) & 0x0f0f0f0fu, p.y, acc[g]);
            acc[g] = __dp4a(w[2 * i + 1] & 0x0f0f0f0fu, p.z, acc[g]);
            acc[g] = __dp4a((w[2 * i + 1] >> 4) & 0x0f0f0f0fu, p.w, acc[g]);
          }
        }
        const float sv = h2f(s.vscale[vb * HEAD_DIM + ch]), mv = h2f(s.vmin[vb * HEAD_DIM + ch]);
#pragma unroll
        for (int g = 0; g < G; g++) o[g][j] = o[g][j] * corr_s[g] + step_s[g] * (sv * (float)acc[g] + mv * psum_s[g]);
      }
    }
    __syncthreads();
  }
  float* out = part + ((long long)(h * gridDim.x + chunk) * G) * PART;
#pragma unroll
  for (int g = 0; g < G; g++) {
#pragma unroll
    for (int j = 0; j < PER; j++) {
      const int ch = t + j * K43_THREADS;
      if (ch < HEAD_DIM) out[g * PART + ch] = o[g][j];
    }
    if (t == 0) { out[g * PART + HEAD_DIM] = m_s[g]; out[g * PART + HEAD_DIM + 1] = l_s[g]; }
  }
}

// Per group size G: kv43_partial_g{G}, homomorphic decode over the rows of the arrays of
// `upload_kv43` (kv_heads heads of `rows` rows each, one after another) that the list names
// (list_off null: every row); khigh null with 4-bit keys.
// Tuning only (`ATTNSTORE_KV43_MIN_BLOCKS=N` defines K43_MIN_BLOCKS): ask the compiler for
// registers that let N CTAs of 128 threads stay resident per SM (ncu, session 54: 61
// registers, so 8 CTAs and 50% occupancy). Without it the kernels compile as always.
#ifdef K43_MIN_BLOCKS
#define K43_BOUNDS __launch_bounds__(K43_THREADS, K43_MIN_BLOCKS)
#else
#define K43_BOUNDS
#endif
#define KV43_KERNELS(G)                                                                                      \
  extern "C" __global__ void K43_BOUNDS kv43_partial_g##G(                                                  \
      const unsigned char* __restrict__ kc, const unsigned char* __restrict__ khigh,                         \
      const unsigned short* __restrict__ kmin, const unsigned short* __restrict__ kscale,                    \
      const unsigned short* __restrict__ ksum, const unsigned* __restrict__ vw,                              \
      const unsigned short* __restrict__ vmin, const unsigned short* __restrict__ vscale, int rows,          \
      int key_group, int value_block, const float* __restrict__ q, float scale,                             \
      int chunk_blocks, float* __restrict__ part, const int* __restrict__ list_off,                         \
      const int* __restrict__ list_block, const unsigned long long* __restrict__ list_mask) {                \
    Kv43Src s;                                                                                               \
    s.kc = kc; s.khigh = khigh; s.kmin = kmin; s.kscale = kscale; s.ksum = ksum;                             \
    s.vw = vw; s.vmin = vmin; s.vscale = vscale; s.rows = rows;                                              \
    s.key_group = key_group; s.value_block = value_block;                                                    \
    Kv43List list;                                                                                           \
    list.off = list_off; list.block = list_block; list.mask = list_mask;                                     \
    kv43_attend<G>(s, list, q, scale, chunk_blocks, part);                                                   \
  }
KV43_KERNELS(1)
KV43_KERNELS(2)
KV43_KERNELS(3)
KV43_KERNELS(4)
KV43_KERNELS(5)
KV43_KERNELS(6)
KV43_KERNELS(7)
KV43_KERNELS(8)
#endif
