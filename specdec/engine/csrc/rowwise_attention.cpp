// Attention for decode-sized queries in bfloat16, each row over exactly its own keys.
//
// Row r of the query sees the keys 0 .. prefixes[r] - 1 of the cache, then the keys
// extras[r, 0 .. extra_counts[r] - 1] (a token-tree row's ancestors and itself). Each
// (row, head) is computed by one thread, alone, in float32:
//   score_j = (q . k_j) * scale, the dot summed over 16 lanes (input d to lane d % 16,
//             in order of d), then the lanes folded in halves;
//   p_j = exp(score_j - max score), sum = p_0 + p_1 + ... in key order;
//   out = (p_0 v_0 + p_1 v_1 + ...) / sum, in key order, rounded once to bfloat16.
// Every sum runs over the row's visible keys in the order they are listed, so a row gets
// the same bits whatever else the call holds: in a one-row decode, a k-row verification,
// a token tree whose keys sit at other slots, a batch of sessions, on any thread count
// (row-invariant by construction).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define SPECDEC_AVX512 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define SPECDEC_AVX2 1
#endif

namespace {

constexpr int64_t LANES = 16;

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

inline void widen(const uint16_t* source, int64_t count, float* target) {
  for (int64_t d = 0; d < count; ++d) target[d] = bf16_to_float(source[d]);
}

inline float dot(const float* a, const float* b, int64_t count) {
  float lanes[LANES] = {0};
  int64_t d = 0;
  for (; d + LANES <= count; d += LANES)
    for (int64_t lane = 0; lane < LANES; ++lane) lanes[lane] += a[d + lane] * b[d + lane];
  for (; d < count; ++d) lanes[d % LANES] += a[d] * b[d];
  for (int64_t width = LANES / 2; width > 0; width /= 2)
    for (int64_t lane = 0; lane < width; ++lane) lanes[lane] += lanes[lane + width];
  return lanes[0];
}

// One sequence's part of a call: its rows of the query, its keys and values, its plan
// (checked), and where its rows' outputs go.
struct Sequence {
  const uint16_t *query, *key, *value;
  int64_t query_head_stride, query_row_stride, key_head_stride, key_row_stride,
      value_head_stride, value_row_stride;
  at::Tensor prefixes, extras, extra_counts;  // int64, contiguous
  int64_t rows, extra_width;
  uint16_t* out;  // [rows, H, D]
};

// query [H, q, D] (any strides, unit last), key and value [H_kv, L, D] (unit last),
// prefixes [q], extras [q, E], extra_counts [q]; out: [q, H, D] bfloat16, contiguous.
Sequence checked_sequence(const at::Tensor& query, const at::Tensor& key,
                          const at::Tensor& value, const at::Tensor& prefixes,
                          const at::Tensor& extras, const at::Tensor& extra_counts,
                          int64_t heads, int64_t dim, uint16_t* out) {
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                  value.scalar_type() == at::kBFloat16,
              "rowwise_attention: query, key and value must be bfloat16");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3,
              "rowwise_attention: query [H, q, D], key and value [H_kv, L, D]");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1,
              "rowwise_attention: the head dimension must be contiguous");
  const int64_t rows = query.size(1), kv_heads = key.size(0), keys = key.size(1);
  TORCH_CHECK(query.size(0) == heads && query.size(2) == dim && kv_heads > 0 &&
                  heads % kv_heads == 0 && value.size(0) == kv_heads && key.size(2) == dim &&
                  value.size(1) == keys && value.size(2) == dim,
              "rowwise_attention: query heads must be a multiple of the key/value heads, "
              "and key and value must agree");
  Sequence sequence{
      reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>()),
      reinterpret_cast<const uint16_t*>(key.data_ptr<at::BFloat16>()),
      reinterpret_cast<const uint16_t*>(value.data_ptr<at::BFloat16>()),
      query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0),
      value.stride(1), prefixes.to(at::kLong).contiguous(), extras.to(at::kLong).contiguous(),
      extra_counts.to(at::kLong).contiguous(), rows, 0, out};
  const at::Tensor& ext = sequence.extras;
  TORCH_CHECK(sequence.prefixes.numel() == rows && sequence.extra_counts.numel() == rows &&
                  ext.dim() == 2 && ext.size(0) == rows,
              "rowwise_attention: prefixes, extras and extra_counts need one entry per row");
  sequence.extra_width = ext.size(1);
  const int64_t* pp = sequence.prefixes.data_ptr<int64_t>();
  const int64_t* ep = ext.data_ptr<int64_t>();
  const int64_t* cp = sequence.extra_counts.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(pp[r] >= 0 && pp[r] <= keys && cp[r] >= 0 && cp[r] <= sequence.extra_width &&
                    pp[r] + cp[r] > 0,
                "rowwise_attention: row ", r, " sees no key or keys past the cache");
    for (int64_t e = 0; e < cp[r]; ++e)
      TORCH_CHECK(ep[r * sequence.extra_width + e] >= 0 &&
                      ep[r * sequence.extra_width + e] < keys,
                  "rowwise_attention: row ", r, " names a key past the cache");
  }
  return sequence;
}

// Scratch for one thread's tasks.
struct Scratch {
  std::vector<float> q, kv, acc, sums, scores;
};

// Per head g of count: scores[g * keys + j] -> exp(score - the head's top score), and
// sums[g] their sum in key order.
inline void softmax_numerators(float* scores, int64_t count, int64_t keys, float* sums) {
  for (int64_t g = 0; g < count; ++g) {
    float* s = scores + g * keys;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < keys; ++j) top = std::max(top, s[j]);
    float sum = 0.0f;
    for (int64_t j = 0; j < keys; ++j) {
      s[j] = std::exp(s[j] - top);
      sum += s[j];
    }
    sums[g] = sum;
  }
}

// The weighted sums acc [count, dim] over their heads' sums, rounded once to bfloat16,
// into out [count, dim].
inline void write_rows(uint16_t* out, const float* acc, const float* sums, int64_t count,
                       int64_t dim) {
  for (int64_t g = 0; g < count; ++g)
    for (int64_t d = 0; d < dim; ++d)
      out[g * dim + d] = c10::BFloat16(acc[g * dim + d] / sums[g]).x;
}

#if defined(SPECDEC_AVX512) || defined(SPECDEC_AVX2)
// The same arithmetic as widen, dot and the loops of attend_row, 16 lanes at a time, for a
// head dimension that is a multiple of 16: each lane's products and sums are those of
// the scalar code, in its order (a multiply, then an add: no fused multiply-add), and
// the lanes fold in the same halves. Lanes16 is one AVX-512 vector, or on AVX2 two
// vectors of 8 (lanes 0-7 and 8-15).
#ifdef SPECDEC_AVX512
using Lanes16 = __m512;

inline Lanes16 widen16(const uint16_t* source) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(source));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline Lanes16 lanes_zero() { return _mm512_setzero_ps(); }
inline Lanes16 lanes_set1(float value) { return _mm512_set1_ps(value); }
inline Lanes16 lanes_load(const float* p) { return _mm512_loadu_ps(p); }
inline void lanes_store(float* p, Lanes16 v) { _mm512_storeu_ps(p, v); }
inline Lanes16 lanes_add(Lanes16 a, Lanes16 b) { return _mm512_add_ps(a, b); }
inline Lanes16 lanes_mul(Lanes16 a, Lanes16 b) { return _mm512_mul_ps(a, b); }
inline __m256 fold_to_eight(Lanes16 lanes) {
  return _mm256_add_ps(_mm512_castps512_ps256(lanes), _mm512_extractf32x8_ps(lanes, 1));
}
#else
struct Lanes16 {
  __m256 low, high;
};

inline __m256 widen8(const uint16_t* source) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline Lanes16 widen16(const uint16_t* source) { return {widen8(source), widen8(source + 8)}; }
inline Lanes16 lanes_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Lanes16 lanes_set1(float value) { return {_mm256_set1_ps(value), _mm256_set1_ps(value)}; }
inline Lanes16 lanes_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void lanes_store(float* p, Lanes16 v) {
  _mm256_storeu_ps(p, v.low);
  _mm256_storeu_ps(p + 8, v.high);
}
inline Lanes16 lanes_add(Lanes16 a, Lanes16 b) {
  return {_mm256_add_ps(a.low, b.low), _mm256_add_ps(a.high, b.high)};
}
inline Lanes16 lanes_mul(Lanes16 a, Lanes16 b) {
  return {_mm256_mul_ps(a.low, b.low), _mm256_mul_ps(a.high, b.high)};
}
inline __m256 fold_to_eight(Lanes16 lanes) { return _mm256_add_ps(lanes.low, lanes.high); }
#endif

inline float fold(Lanes16 lanes) {
  const __m256 eight = fold_to_eight(lanes);
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

void attend_row_vectors(const Sequence& sequence, int64_t r, int64_t first_head,
                        int64_t count, int64_t groups, int64_t heads, int64_t dim,
                        float scale, Scratch& scratch) {
  const int64_t h_kv = first_head / groups, blocks = dim / LANES;
  const int64_t prefix = sequence.prefixes.data_ptr<int64_t>()[r];
  const int64_t keys = prefix + sequence.extra_counts.data_ptr<int64_t>()[r];
  const int64_t* row_extras = sequence.extras.data_ptr<int64_t>() + r * sequence.extra_width;
  auto slot = [&](int64_t j) { return j < prefix ? j : row_extras[j - prefix]; };
  scratch.q.resize(count * dim);
  scratch.acc.assign(count * dim, 0.0f);
  scratch.sums.resize(count);
  float* q = scratch.q.data();
  for (int64_t g = 0; g < count; ++g)
    for (int64_t b = 0; b < blocks; ++b)
      lanes_store(q + g * dim + b * LANES,
                  widen16(sequence.query + (first_head + g) * sequence.query_head_stride +
                          r * sequence.query_row_stride + b * LANES));
  scratch.scores.resize(count * keys);
  float* scores = scratch.scores.data();
  for (int64_t j = 0; j < keys; ++j) {
    const uint16_t* key =
        sequence.key + h_kv * sequence.key_head_stride + slot(j) * sequence.key_row_stride;
    for (int64_t g = 0; g < count; ++g) {
      Lanes16 lanes = lanes_zero();
      for (int64_t b = 0; b < blocks; ++b)
        lanes = lanes_add(lanes, lanes_mul(lanes_load(q + g * dim + b * LANES),
                                           widen16(key + b * LANES)));
      scores[g * keys + j] = fold(lanes) * scale;
    }
  }
  softmax_numerators(scores, count, keys, scratch.sums.data());
  float* acc = scratch.acc.data();
  for (int64_t j = 0; j < keys; ++j) {
    const uint16_t* value =
        sequence.value + h_kv * sequence.value_head_stride + slot(j) * sequence.value_row_stride;
    for (int64_t b = 0; b < blocks; ++b) {
      const Lanes16 v = widen16(value + b * LANES);
      for (int64_t g = 0; g < count; ++g) {
        float* a = acc + g * dim + b * LANES;
        const Lanes16 p = lanes_set1(scores[g * keys + j]);
        lanes_store(a, lanes_add(lanes_load(a), lanes_mul(p, v)));
      }
    }
  }
  write_rows(sequence.out + (r * heads + first_head) * dim, acc, scratch.sums.data(), count,
             dim);
}
#endif

// Row r of a sequence for query heads first_head .. first_head + count - 1, which share
// one key/value head; each head's sums are its own, whichever heads share the call.
void attend_row(const Sequence& sequence, int64_t r, int64_t first_head, int64_t count,
                int64_t groups, int64_t heads, int64_t dim, float scale, Scratch& scratch) {
#if defined(SPECDEC_AVX512) || defined(SPECDEC_AVX2)
  if (dim % LANES == 0)
    return attend_row_vectors(sequence, r, first_head, count, groups, heads, dim, scale,
                              scratch);
#endif
  const int64_t h_kv = first_head / groups;
  const int64_t prefix = sequence.prefixes.data_ptr<int64_t>()[r];
  const int64_t keys = prefix + sequence.extra_counts.data_ptr<int64_t>()[r];
  const int64_t* row_extras = sequence.extras.data_ptr<int64_t>() + r * sequence.extra_width;
  auto slot = [&](int64_t j) { return j < prefix ? j : row_extras[j - prefix]; };
  scratch.q.resize(count * dim);
  scratch.kv.resize(dim);
  scratch.acc.assign(count * dim, 0.0f);
  scratch.sums.resize(count);
  float* q = scratch.q.data();
  float* kv = scratch.kv.data();
  for (int64_t g = 0; g < count; ++g)
    widen(sequence.query + (first_head + g) * sequence.query_head_stride +
              r * sequence.query_row_stride,
          dim, q + g * dim);
  scratch.scores.assign(count * keys, 0.0f);
  float* scores = scratch.scores.data();
  for (int64_t j = 0; j < keys; ++j) {
    widen(sequence.key + h_kv * sequence.key_head_stride + slot(j) * sequence.key_row_stride,
          dim, kv);
    for (int64_t g = 0; g < count; ++g) scores[g * keys + j] = dot(q + g * dim, kv, dim) * scale;
  }
  softmax_numerators(scores, count, keys, scratch.sums.data());
  float* acc = scratch.acc.data();
  for (int64_t j = 0; j < keys; ++j) {
    widen(sequence.value + h_kv * sequence.value_head_stride +
              slot(j) * sequence.value_row_stride,
          dim, kv);
    for (int64_t g = 0; g < count; ++g) {
      const float p = scores[g * keys + j];
      float* a = acc + g * dim;
      for (int64_t d = 0; d < dim; ++d) a[d] += p * kv[d];
    }
  }
  write_rows(sequence.out + (r * heads + first_head) * dim, acc, scratch.sums.data(), count,
             dim);
}

// Every row of every sequence, split over torch's threads: a task is one row and one
// key/value head, whose query heads share each widened key and value.
void attend(const std::vector<Sequence>& sequences, int64_t heads, int64_t kv_heads,
            int64_t dim, double scale) {
  const int64_t groups = heads / kv_heads;
  std::vector<std::pair<size_t, int64_t>> rows;  // (sequence, row) for each row
  for (size_t s = 0; s < sequences.size(); ++s)
    for (int64_t r = 0; r < sequences[s].rows; ++r) rows.emplace_back(s, r);
  const int64_t total = static_cast<int64_t>(rows.size());
  const float scale_f = static_cast<float>(scale);
  at::parallel_for(0, total * kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      const auto [s, r] = rows[task / kv_heads];
      attend_row(sequences[s], r, (task % kv_heads) * groups, groups, groups, heads, dim,
                 scale_f, scratch);
    }
  });
}

at::Tensor rowwise_attention(const at::Tensor& query, const at::Tensor& key,
                             const at::Tensor& value, const at::Tensor& prefixes,
                             const at::Tensor& extras, const at::Tensor& extra_counts,
                             double scale) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3,
              "rowwise_attention: query [H, q, D], key and value [H_kv, L, D]");
  const int64_t heads = query.size(0), rows = query.size(1), dim = query.size(2);
  at::Tensor out = at::empty({rows, heads, dim}, query.options().memory_format(
                                                     at::MemoryFormat::Contiguous));
  const std::vector<Sequence> sequences{checked_sequence(
      query, key, value, prefixes, extras, extra_counts, heads, dim,
      reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()))};
  attend(sequences, heads, key.size(0), dim, scale);
  return out;
}

// Several sequences' rows in one call: query [H, total rows, D], the rows of sequence s
// after those of s - 1 (rows[s] of them), each over its own keys and values with its own
// plan -> [total rows, H, D]. Each row gets the bits of rowwise_attention on its sequence
// alone.
at::Tensor rowwise_attention_packed(const at::Tensor& query, at::TensorList keys,
                                    at::TensorList values, at::TensorList prefixes,
                                    at::TensorList extras, at::TensorList extra_counts,
                                    at::IntArrayRef rows, double scale) {
  const size_t count = rows.size();
  TORCH_CHECK(query.dim() == 3 && count > 0 && keys.size() == count &&
                  values.size() == count && prefixes.size() == count &&
                  extras.size() == count && extra_counts.size() == count,
              "rowwise_attention_packed: query [H, rows, D], one key, value and plan per "
              "sequence");
  const int64_t heads = query.size(0), total = query.size(1), dim = query.size(2);
  at::Tensor out = at::empty({total, heads, dim}, query.options().memory_format(
                                                      at::MemoryFormat::Contiguous));
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  std::vector<Sequence> sequences;
  sequences.reserve(count);
  int64_t start = 0;
  for (size_t s = 0; s < count; ++s) {
    TORCH_CHECK(rows[s] > 0 && start + rows[s] <= total && keys[s].dim() == 3 &&
                    keys[s].size(0) == keys[0].size(0),
                "rowwise_attention_packed: sequence ", s, " does not fit the query");
    sequences.push_back(checked_sequence(query.narrow(1, start, rows[s]), keys[s], values[s],
                                         prefixes[s], extras[s], extra_counts[s], heads, dim,
                                         op + start * heads * dim));
    start += rows[s];
  }
  TORCH_CHECK(start == total, "rowwise_attention_packed: the sequences have ", start,
              " rows, the query ", total);
  attend(sequences, heads, keys[0].size(0), dim, scale);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("rowwise_attention(Tensor query, Tensor key, Tensor value, Tensor prefixes, "
        "Tensor extras, Tensor extra_counts, float scale) -> Tensor");
  m.def("rowwise_attention_packed(Tensor query, Tensor[] keys, Tensor[] values, "
        "Tensor[] prefixes, Tensor[] extras, Tensor[] extra_counts, int[] rows, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("rowwise_attention", &rowwise_attention);
  m.impl("rowwise_attention_packed", &rowwise_attention_packed);
}
