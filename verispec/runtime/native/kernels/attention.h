// verispec's C++ kernels (see kernels.cpp): attention in short passes (decode, verification,
// token trees), for the queries that share a KV head (AVX512-BF16, or AMX for up to 16).

#pragma once

#include "common.h"

namespace {

// Attention. attend_queries: the queries of one KV head with AVX512-BF16 (without AMX, and for
// head widths that are not a multiple of 32); attend_group (below): the AMX path.

// Softmax numerators of scores [n] in place (exp(score - max)), also rounded to bf16 into
// weights [n] when given; returns 1 / their sum (16 lanes, then a fixed tree). The max is exact
// in any order; every other sum runs in the same order for the same n.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) float softmax_in_place(
    float* scores, int64_t n, bf16* weights) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = lanes(n - j);
    top = _mm512_mask_max_ps(top, mask, top, _mm512_maskz_loadu_ps(mask, scores + j));
  }
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = lanes(n - j);
    const __m512 e = _mm512_maskz_mov_ps(
        mask, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, scores + j), shift)));
    _mm512_mask_storeu_ps(scores + j, mask, e);
    if (weights)
      _mm256_mask_storeu_epi16(weights + j, mask, (__m256i)_mm512_cvtneps_pbh(e));
    total = _mm512_add_ps(total, e);
  }
  return 1.0f / _mm512_reduce_add_ps(total);
}

// Lane r of the result: the sum of v[r]'s 16 lanes, by a fixed tree (128-bit halves, then
// pairs, then within lanes), so every key's score is summed the same way wherever it sits.
__attribute__((target("avx512f"))) inline __m512 sum_lanes16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; i++)  // [v2i: 0+2, 1+3 | v2i+1: 0+2, 1+3] (128-bit quarters)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; i++)  // quarter k: 4 partial sums of v[4i + k]
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; i++)  // quarter k: 2 partials of v[8i + k], then of v[8i + 4 + k]
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
  // lane 4k + m: the sum of v[4m + k]
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88),
                                    _mm512_shuffle_ps(z[0], z[1], 0xDD));
  const __m512i row_at = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(row_at, sums);
}

// Dimensions 32 c .. 32 c + 31 of a key or value row (CHUNKS > 0: all there; else masked).
template <int CHUNKS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline __m512i load_chunk(
    const bf16* row, int64_t c, __mmask32 mask) {
  return CHUNKS > 0 ? _mm512_loadu_si512(row + 32 * c)
                    : _mm512_maskz_loadu_epi16(mask, row + 32 * c);
}

struct Query {
  const bf16* q;  // [d]
  int64_t count;  // attends over keys 0..count-1
  bf16* out;      // [d]
  // Its keys and values from the kernel's `tail_start` on, in position order, zero past
  // `count` (`tail_rows` of them): a tree node's path (see forward_layers); null: the cache's.
  const bf16* tail_keys = nullptr;
  const bf16* tail_values = nullptr;
  int64_t tail_rows = 0;
};

// 16 x 16 32-bit elements transposed in place: r[i] lane j <- r[j] lane i.
__attribute__((target("avx512f"))) inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // t[i], t[i+1]: rows i, i+1 interleaved by elements
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + e]: element 4L + e of rows i..i+3 in 128-bit lane L
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int g = 0; g < 16; g += 8)  // lanes 0, 2 (0x88) and 1, 3 (0xDD) of row groups g, g + 4
    for (int e = 0; e < 4; e++) {
      t[g + e] = _mm512_shuffle_i32x4(r[g + e], r[g + 4 + e], 0x88);
      t[g + 4 + e] = _mm512_shuffle_i32x4(r[g + e], r[g + 4 + e], 0xDD);
    }
  for (int e = 0; e < 4; e++) {  // element e, 4 + e, 8 + e, 12 + e of all 16 rows
    r[e] = _mm512_shuffle_i32x4(t[e], t[8 + e], 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(t[4 + e], t[12 + e], 0x88);
    r[8 + e] = _mm512_shuffle_i32x4(t[e], t[8 + e], 0xDD);
    r[12 + e] = _mm512_shuffle_i32x4(t[4 + e], t[12 + e], 0xDD);
  }
}

// The permutations that interleave two value rows a, b in pairs of keys: with low, lane i of
// the first 16 dimensions gets (a[i], b[i]); with high, of the next 16.
__attribute__((target("avx512f"))) inline void pair_indices(__m512i& low, __m512i& high) {
  alignas(64) uint16_t index[64];
  for (int i = 0; i < 16; i++) {
    index[2 * i] = uint16_t(i), index[2 * i + 1] = uint16_t(32 + i);
    index[32 + 2 * i] = uint16_t(16 + i), index[32 + 2 * i + 1] = uint16_t(48 + i);
  }
  low = _mm512_load_si512(index);
  high = _mm512_load_si512(index + 32);
}

// The scores row of a query among queries over up to `longest` keys: whole blocks of 16.
inline int64_t score_stride(int64_t longest) { return (longest + 15) / 16 * 16; }

// Pair p (dimensions 2p, 2p + 1) of a bf16 vector in every lane.
__attribute__((target("avx512f,avx512bf16"))) inline __m512bh broadcast_pair(const bf16* v,
                                                                         int64_t p) {
  int32_t both;
  std::memcpy(&both, v + 2 * p, 4);
  return (__m512bh)_mm512_set1_epi32(both);
}

// sums[c] += both's two bf16 weights times rows[c]'s pairs (interleaved value rows), c < width.
__attribute__((target("avx512f,avx512bf16"), always_inline)) inline void add_pairs(
    __m512* sums, const __m512i* rows, int64_t width, uint32_t both) {
  const __m512bh weight = (__m512bh)_mm512_set1_epi32(int32_t(both));
  for (int64_t c = 0; c < width; c++)
    sums[c] = _mm512_dpbf16_ps(sums[c], (__m512bh)rows[c], weight);
}

// Attention for the queries of one KV head on the AVX512-BF16 path (and for head widths the
// AMX path does not take): out = softmax(q . K^T * scale) V over each query's own keys
// 0..count-1, in cache order; from key tail_start on, a query with a tail reads its keys and
// values there (a tree node's path). Scores: bf16 products summed in fp32 with VDPBF16PS; the
// softmax's numerators rounded to bf16 as the weights (as the AMX path does); the weighted sum
// of values over pairs of keys in key order. d even. CHUNKS > 0: d is exactly 32 CHUNKS, known
// when compiling (loops over d unrolled, their vectors kept in registers; attend_queries picks
// it); 0: any even d, masked.
//
// A query gets the same bits whichever queries share the call: per key, lane i of a vector sums
// pair i of the dimensions (and pair 16 + i, ... in later chunks), then a fixed tree sums the 16
// lanes; the values' sums run in key order. Two ways give those bits. One query at a time: 16
// keys' vectors, then a transposing tree (sum_lanes16). Several queries: the block of 16 keys
// transposed once (lane = key), so a query's 16 lane sums are 16 vectors added elementwise by
// the same tree, and each pair of value rows interleaved once for all queries, whose sums then
// run side by side instead of as one chain of dependent products. The kernel picks by how many
// queries share a block; tests/test_kernels.py checks that every pass shape gives the same bits.
template <int CHUNKS>
struct QueryKernel {
  static constexpr int64_t MAX_CHUNKS = MAX_HEAD_DIM / 32;
  static constexpr int64_t FIXED = CHUNKS > 0 ? CHUNKS : MAX_CHUNKS;
  // Queries whose value sums run side by side: their sums and one pair of value rows fit in
  // the 32 vector registers.
  static constexpr int64_t SIDE_BY_SIDE = CHUNKS == 1 ? 8 : CHUNKS == 2 ? 6
                                          : CHUNKS == 3 || CHUNKS == 4 ? 2 : 1;
  static constexpr int64_t TRANSPOSE_FROM = 3;  // queries in a block of keys worth transposing

  const Query* queries;
  int64_t count, d, chunks, tail_start;
  const bf16 *keys, *values;
  __mmask32 masks[MAX_CHUNKS];

  __attribute__((target("avx512f"))) const bf16* key_of(int64_t m, int64_t j) const {
    return j < tail_start || !queries[m].tail_keys ? keys + j * d
                                                   : queries[m].tail_keys + (j - tail_start) * d;
  }
  __attribute__((target("avx512f"))) const bf16* value_of(int64_t m, int64_t j) const {
    return j < tail_start || !queries[m].tail_values
               ? values + j * d : queries[m].tail_values + (j - tail_start) * d;
  }

  // Scores of query m for keys first..first+n-1 (n <= 16) one key at a time, into scores.
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void score_keys(
      int64_t m, int64_t first, int64_t n, float scale, float* scores) const {
    __m512bh query[MAX_CHUNKS];
    for (int64_t c = 0; c < chunks; c++)
      query[c] = (__m512bh)_mm512_maskz_loadu_epi16(masks[c], queries[m].q + 32 * c);
    __m512 partial[16];
    for (int64_t r = 0; r < 16; r++) {
      partial[r] = _mm512_setzero_ps();
      if (r >= n) continue;
      const bf16* key = key_of(m, first + r);
      for (int64_t c = 0; c < chunks; c++)
        partial[r] = _mm512_dpbf16_ps(partial[r], (__m512bh)load_chunk<CHUNKS>(key, c, masks[c]),
                                      query[c]);
    }
    _mm512_mask_storeu_ps(scores + first, lanes(n),
                          _mm512_mul_ps(sum_lanes16(partial), _mm512_set1_ps(scale)));
  }

  // Scores of query m for a transposed block (pairs[p] lane j: pair p of key j), the same
  // sums as score_keys: lane i of key j's vector is chain i here, and sum_lanes16's tree adds
  // lanes e, e + 8, e + 4, e + 12 first, then those sums 0 + 2 and 1 + 3.
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) __m512 score_block(
      int64_t m, const __m512i* pairs) const {
    const bf16* q = queries[m].q;
    __m512 chain[16];
    for (int i = 0; i < 16; i++)
      chain[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)pairs[i], broadcast_pair(q, i));
    for (int64_t c = 1; c < FIXED; c++)
      for (int i = 0; i < 16; i++)
        chain[i] = _mm512_dpbf16_ps(chain[i], (__m512bh)pairs[16 * c + i],
                                    broadcast_pair(q, 16 * c + i));
    __m512 fours[4];
    for (int e = 0; e < 4; e++)
      fours[e] = _mm512_add_ps(_mm512_add_ps(chain[e], chain[e + 8]),
                               _mm512_add_ps(chain[e + 4], chain[e + 12]));
    return _mm512_add_ps(_mm512_add_ps(fours[0], fours[2]), _mm512_add_ps(fours[1], fours[3]));
  }

  // 1. Scores of every query, 16 keys at a time, into scores [count, stride].
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void score_all(
      int64_t longest, int64_t stride, float scale, float* scores) const {
    for (int64_t first = 0; first < longest; first += 16) {
      int64_t members = 0;
      for (int64_t m = 0; m < count; m++) members += queries[m].count > first;
      const bool shared = first + 16 <= tail_start;  // every member reads the cache's keys
      if (CHUNKS == 0 || !shared || members < TRANSPOSE_FROM) {
        for (int64_t m = 0; m < count; m++)
          if (queries[m].count > first)
            score_keys(m, first, std::min<int64_t>(16, queries[m].count - first), scale,
                       scores + m * stride);
        continue;
      }
      const int64_t rows = std::min<int64_t>(16, longest - first);
      alignas(64) __m512i pairs[16 * FIXED];
      for (int64_t c = 0; c < FIXED; c++) {
        __m512i block[16];
        for (int64_t r = 0; r < 16; r++)
          block[r] = r < rows ? _mm512_loadu_si512(keys + (first + r) * d + 32 * c)
                              : _mm512_setzero_si512();
        transpose16(block);
        for (int i = 0; i < 16; i++) pairs[16 * c + i] = block[i];
      }
      for (int64_t m = 0; m < count; m++)
        if (queries[m].count > first)
          _mm512_mask_storeu_ps(scores + m * stride + first, lanes(queries[m].count - first),
                                _mm512_mul_ps(score_block(m, pairs), _mm512_set1_ps(scale)));
    }
  }

  // Value rows j and j + 1 (b null: zeros) interleaved in pairs of keys: lane i of a 16-dim
  // half gets a[i], b[i] (VDPBF16PS then adds w_j a[i] + w_j+1 b[i]).
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void interleave(
      const bf16* a, const bf16* b, __m512i low, __m512i high, __m512i* out) const {
    for (int64_t c = 0; c < (CHUNKS > 0 ? CHUNKS : chunks); c++) {
      const __m512i x = load_chunk<CHUNKS>(a, c, masks[c]);
      const __m512i y = b ? load_chunk<CHUNKS>(b, c, masks[c]) : _mm512_setzero_si512();
      out[2 * c] = _mm512_permutex2var_epi16(x, low, y);
      out[2 * c + 1] = _mm512_permutex2var_epi16(x, high, y);
    }
  }

  // 3. The weighted sums of values of queries first..first+SIDE_BY_SIDE-1 (those below
  // count), scaled by their norms, into their outputs.
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void sum_values(
      int64_t first, const bf16* weights, int64_t padded, const float* norms) const {
    constexpr int64_t S = SIDE_BY_SIDE;
    const int64_t width = CHUNKS > 0 ? 2 * CHUNKS : 2 * chunks;
    __m512i low, high;
    pair_indices(low, high);
    int64_t counts[S], fewest = INT64_MAX, most = 0;
    for (int64_t s = 0; s < S; s++) {
      counts[s] = first + s < count ? queries[first + s].count : 0;
      if (first + s < count) fewest = std::min(fewest, counts[s]);
      most = std::max(most, counts[s]);
    }
    __m512 acc[S][2 * FIXED];
    for (int64_t s = 0; s < S; s++)
      for (int64_t c = 0; c < width; c++) acc[s][c] = _mm512_setzero_ps();
    const auto pair_weights = [&](int64_t s, int64_t j) {
      const bf16* w = weights + (first + s) * padded;
      return uint32_t(w[j]) | (j + 1 < counts[s] ? uint32_t(w[j + 1]) << 16 : 0u);
    };
    // Pairs every query has whole, from the cache: interleaved once.
    const int64_t shared = std::min(fewest, tail_start) / 2 * 2;
    __m512i rows[2 * FIXED];
    for (int64_t j = 0; j < shared; j += 2) {
      interleave(values + j * d, values + (j + 1) * d, low, high, rows);
      for (int64_t s = 0; s < S; s++)
        if (first + s < count) add_pairs(acc[s], rows, width, pair_weights(s, j));
    }
    // The rest query by query: its last odd key (paired with zeros), a tree node's tail.
    for (int64_t j = shared; j < most; j += 2)
      for (int64_t s = 0; s < S; s++) {
        if (j >= counts[s]) continue;
        const int64_t m = first + s;
        interleave(value_of(m, j), j + 1 < counts[s] ? value_of(m, j + 1) : nullptr, low,
                   high, rows);
        add_pairs(acc[s], rows, width, pair_weights(s, j));
      }
    for (int64_t s = 0; s < S && first + s < count; s++) {
      alignas(64) float result[MAX_HEAD_DIM + 32];
      for (int64_t c = 0; c < width; c++)
        _mm512_store_ps(result + 16 * c, _mm512_mul_ps(acc[s][c], _mm512_set1_ps(norms[s])));
      for (int64_t i = 0; i < d; i++) queries[first + s].out[i] = round_bf16(result[i]);
    }
  }

  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void run(
      float scale, std::vector<float>& scores, std::vector<bf16>& weights) {
    for (int64_t c = 0; c < chunks; c++) {
      const int64_t width = CHUNKS > 0 ? 32 : std::min<int64_t>(32, d - 32 * c);
      masks[c] = __mmask32(width == 32 ? ~0u : (1u << width) - 1u);
    }
    int64_t longest = 0;
    for (int64_t m = 0; m < count; m++) longest = std::max(longest, queries[m].count);
    const int64_t stride = score_stride(longest), padded = stride + 16;
    if (int64_t(scores.size()) < count * stride) scores.resize(count * stride);
    if (int64_t(weights.size()) < count * padded) weights.resize(count * padded);
    score_all(longest, stride, scale, scores.data());
    // 2. Exponentials, their bf16 roundings as weights, 1 / their fp32 sum.
    float norms[TILE_M];
    for (int64_t first = 0; first < count; first += SIDE_BY_SIDE) {
      const int64_t last = std::min(count, first + SIDE_BY_SIDE);
      for (int64_t m = first; m < last; m++)
        norms[m - first] = softmax_in_place(scores.data() + m * stride, queries[m].count,
                                            weights.data() + m * padded);
      sum_values(first, weights.data(), padded, norms);
    }
  }
};

template <int CHUNKS>
void attend_with(const Query* queries, int64_t count, const bf16* keys, const bf16* values,
                 int64_t d, float scale, std::vector<float>& scores, std::vector<bf16>& weights,
                 int64_t tail_start) {
  QueryKernel<CHUNKS> kernel{queries, count, d, CHUNKS > 0 ? CHUNKS : (d + 31) / 32,
                             tail_start, keys, values, {}};
  kernel.run(scale, scores, weights);
}

// The AVX512-BF16 path's attention for queries that share one KV head (see QueryKernel).
void attend_queries(const Query* queries, int64_t count, const bf16* keys, const bf16* values,
                    int64_t d, float scale, std::vector<float>& scores,
                    std::vector<bf16>& weights, int64_t tail_start = INT64_MAX) {
  switch (d) {
    case 32:
      return attend_with<1>(queries, count, keys, values, d, scale, scores, weights, tail_start);
    case 64:
      return attend_with<2>(queries, count, keys, values, d, scale, scores, weights, tail_start);
    case 128:
      return attend_with<4>(queries, count, keys, values, d, scale, scores, weights, tail_start);
    default:
      return attend_with<0>(queries, count, keys, values, d, scale, scores, weights, tail_start);
  }
}

// Attention for up to 16 queries that share one KV head (the heads of a GQA group, the
// positions of a verification pass): scores on AMX as K Q^T (a tile of 16 keys straight from
// the cache times a tile of the queries, transposed once), softmax and the weighted sum of
// values in fp32 with AVX-512, one query at a time over exactly its own keys. A score depends
// only on its query and key, and each query's sums run in key order, so a query gets the same
// bits whichever queries share its call. Needs head_dim % 32 == 0.

// Tile numbers must be compile-time constants: C tiles 0-3 by a run-time index.
__attribute__((target("amx-tile"))) inline void tile_zero(int64_t t) {
  switch (t) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3); break;
  }
}

__attribute__((target("amx-tile,amx-bf16"))) inline void tile_product(int64_t t) {  // C += A B
  switch (t) {
    case 0: _tile_dpbf16ps(0, 4, 5); break;
    case 1: _tile_dpbf16ps(1, 4, 5); break;
    case 2: _tile_dpbf16ps(2, 4, 5); break;
    default: _tile_dpbf16ps(3, 4, 5); break;
  }
}

__attribute__((target("amx-tile"))) inline void tile_store(int64_t t, float* out, int64_t stride) {
  switch (t) {
    case 0: _tile_stored(0, out, stride); break;
    case 1: _tile_stored(1, out, stride); break;
    case 2: _tile_stored(2, out, stride); break;
    default: _tile_stored(3, out, stride); break;
  }
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16"))) void
attend_group(const Query* queries, int64_t count, const bf16* keys, const bf16* values,
             int64_t capacity, int64_t d, float scale, std::vector<float>& scores,
             std::vector<bf16>& weights, int64_t tail_start = INT64_MAX) {
  // Where query c reads the keys (values) of block `first`: the cache, or from tail_start on
  // its own tail; blocks past a source's rows are staged, zero-padded.
  struct Source {
    const bf16* keys;
    const bf16* values;
    int64_t rows, first;  // rows of the source, the block's first row in it
  };
  const auto source = [&](int64_t c, int64_t first) -> Source {
    if (first < tail_start || queries[c].tail_keys == nullptr)
      return {keys, values, capacity, first};
    return {queries[c].tail_keys, queries[c].tail_values, queries[c].tail_rows,
            first - tail_start};
  };
  // Queries reading the same source as query c in block `first` (c's own bit included).
  const auto sharing = [&](int64_t c, int64_t first) {
    uint32_t members = 0;
    const bf16* own = source(c, first).keys;
    for (int64_t other = 0; other < count; other++)
      if (source(other, first).keys == own) members |= 1u << other;
    return members;
  };
  int64_t longest = 0;
  for (int64_t c = 0; c < count; c++) longest = std::max(longest, queries[c].count);
  const int64_t stride = score_stride(longest);  // scores row per query
  if (int64_t(scores.size()) < TILE_M * stride) scores.resize(TILE_M * stride);
  // 1. The queries as B tiles: [d/2 pairs][16 queries][2], zero columns past `count`.
  alignas(64) bf16 tiled[MAX_HEAD_DIM / 2 * TILE_M * 2] = {};
  for (int64_t c = 0; c < count; c++)
    for (int64_t i = 0; i < d; i++) tiled[(i / 2) * TILE_M * 2 + c * 2 + i % 2] = queries[c].q[i];
  TileConfig config;  // every tile 16 x 64 bytes; scores: 0 = C, 1 = A, 2 = B; sums: 0-3 = C,
  for (int tile = 0; tile < 6; tile++) {  // 4 = A, 5 = B
    config.rows[tile] = 16;
    config.colsb[tile] = 64;
  }
  load_tile_config(config);
  alignas(64) float block_scores[16 * 16];
  alignas(64) bf16 staged[16 * MAX_HEAD_DIM];
  // 2. Scores, 16 keys at a time, one tile per source of the block (the cache; in a tree's
  // tail, each node's path).
  const __m512i column = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(16));
  for (int64_t first = 0; first < longest; first += 16) {
    uint32_t done = 0;
    for (int64_t c = 0; c < count; c++) {
      if (done >> c & 1u) continue;
      const uint32_t members = first < tail_start ? (1u << count) - 1u : sharing(c, first);
      done |= members;
      const Source from = source(c, first);
      const bf16* block = from.keys + from.first * d;
      if (from.first + 16 > from.rows) {
        std::memset(staged, 0, sizeof(staged));
        std::memcpy(staged, block, std::max<int64_t>(0, from.rows - from.first) * d * 2);
        block = staged;
      }
      _tile_zero(0);
      for (int64_t kb = 0; kb < d / TILE_K; kb++) {
        _tile_loadd(1, block + kb * TILE_K, d * 2);
        _tile_loadd(2, tiled + kb * (TILE_K / 2) * TILE_M * 2, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, block_scores, 64);
      // The tile is [key][query]: each member's column, scaled, into its row of scores.
      for (int64_t m = 0; m < count; m++)
        if (members >> m & 1u)
          _mm512_storeu_ps(scores.data() + m * stride + first,
                           _mm512_mul_ps(_mm512_i32gather_ps(column, block_scores + m, 4),
                                         _mm512_set1_ps(scale)));
    }
  }
  // 3. Softmax per query, over its own keys: the exponentials rounded to bf16 as the weights
  // of step 4 (zero past the query's keys), 1 / their fp32 sum.
  const int64_t padded = (longest + 31) / 32 * 32;
  weights.assign(TILE_M * padded, 0);
  float norms[TILE_M];
  for (int64_t c = 0; c < count; c++)
    norms[c] = softmax_in_place(scores.data() + c * stride, queries[c].count,
                                weights.data() + c * padded);
  // 4. Weighted sums of values on AMX: P [16 queries x 32 keys] times values in pairs of
  // keys, 32 keys at a time; each query's sums over its own keys, the zeros past them adding
  // nothing.
  alignas(64) bf16 pairs[16 * MAX_HEAD_DIM * 2];  // [16 key pairs][d][2]
  alignas(64) float sums[TILE_M * MAX_HEAD_DIM];
  alignas(64) bf16 own_weights[TILE_M * 32];
  __m512i low, high;
  pair_indices(low, high);
  for (int64_t columns = 0; columns < d; columns += 64) {  // up to 4 C tiles at a time
    const int64_t tiles = std::min<int64_t>(4, (d - columns) / 16);
    load_tile_config(config);
    for (int64_t t = 0; t < tiles; t++) tile_zero(t);
    for (int64_t first = 0; first < padded; first += 32) {
      uint32_t done = 0;
      for (int64_t c = 0; c < count; c++) {  // one product per source of the block
        if (done >> c & 1u) continue;
        const uint32_t members = first < tail_start ? (1u << count) - 1u : sharing(c, first);
        done |= members;
        const Source from = source(c, first);
        for (int64_t r = 0; r < 16; r++) {  // interleave value rows first+2r, first+2r+1
          const int64_t j = from.first + 2 * r;
          for (int64_t dim = columns; dim < columns + tiles * 16; dim += 32) {
            const __m512i a = j < from.rows ? _mm512_loadu_si512(from.values + j * d + dim)
                                            : _mm512_setzero_si512();
            const __m512i b = j + 1 < from.rows
                                  ? _mm512_loadu_si512(from.values + (j + 1) * d + dim)
                                  : _mm512_setzero_si512();
            _mm512_store_si512(pairs + r * 128 + (dim - columns) * 2,
                               _mm512_permutex2var_epi16(a, low, b));
            _mm512_store_si512(pairs + r * 128 + (dim - columns) * 2 + 32,
                               _mm512_permutex2var_epi16(a, high, b));
          }
        }
        if (members == (1u << count) - 1u) {
          _tile_loadd(4, weights.data() + first, padded * 2);
        } else {  // the other sources' queries weigh these values zero: they add nothing
          for (int64_t m = 0; m < TILE_M; m++)
            for (int64_t j = 0; j < 32; j++)
              own_weights[m * 32 + j] =
                  m < count && (members >> m & 1u) ? weights[m * padded + first + j] : bf16(0);
          _tile_loadd(4, own_weights, 64);
        }
        for (int64_t t = 0; t < tiles; t++) {
          _tile_loadd(5, pairs + t * 32, 256);
          tile_product(t);
        }
      }
    }
    for (int64_t t = 0; t < tiles; t++) tile_store(t, sums + columns + t * 16, d * 4);
  }
  _tile_release();
  for (int64_t c = 0; c < count; c++)
    for (int64_t i = 0; i < d; i++) queries[c].out[i] = round_bf16(sums[c * d + i] * norms[c]);
}

}  // namespace
