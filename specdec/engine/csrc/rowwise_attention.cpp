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
#include <vector>

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

// query [H, q, D] (any strides, unit last), key and value [H_kv, L, D] (unit last),
// prefixes [q], extras [q, E], extra_counts [q] (int64) -> [q, H, D] bfloat16.
at::Tensor rowwise_attention(const at::Tensor& query, const at::Tensor& key,
                             const at::Tensor& value, const at::Tensor& prefixes,
                             const at::Tensor& extras, const at::Tensor& extra_counts,
                             double scale) {
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                  value.scalar_type() == at::kBFloat16,
              "rowwise_attention: query, key and value must be bfloat16");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3,
              "rowwise_attention: query [H, q, D], key and value [H_kv, L, D]");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1,
              "rowwise_attention: the head dimension must be contiguous");
  const int64_t heads = query.size(0), rows = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key.size(0), keys = key.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && value.size(0) == kv_heads &&
                  key.size(2) == dim && value.size(1) == keys,
              "rowwise_attention: query heads must be a multiple of the key/value heads, "
              "and key and value must agree");
  const at::Tensor pre = prefixes.to(at::kLong).contiguous();
  const at::Tensor ext = extras.to(at::kLong).contiguous();
  const at::Tensor cnt = extra_counts.to(at::kLong).contiguous();
  TORCH_CHECK(pre.numel() == rows && cnt.numel() == rows && ext.dim() == 2 &&
                  ext.size(0) == rows,
              "rowwise_attention: prefixes, extras and extra_counts need one entry per row");
  const int64_t extra_width = ext.size(1);
  const int64_t* pp = pre.data_ptr<int64_t>();
  const int64_t* ep = ext.data_ptr<int64_t>();
  const int64_t* cp = cnt.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(pp[r] >= 0 && pp[r] <= keys && cp[r] >= 0 && cp[r] <= extra_width &&
                    pp[r] + cp[r] > 0,
                "rowwise_attention: row ", r, " sees no key or keys past the cache");
    for (int64_t e = 0; e < cp[r]; ++e)
      TORCH_CHECK(ep[r * extra_width + e] >= 0 && ep[r * extra_width + e] < keys,
                  "rowwise_attention: row ", r, " names a key past the cache");
  }
  const int64_t groups = heads / kv_heads;
  at::Tensor out = at::empty({rows, heads, dim}, query.options().memory_format(
                                                     at::MemoryFormat::Contiguous));
  const auto* qp = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(key.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(value.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1);
  const int64_t vs0 = value.stride(0), vs1 = value.stride(1);
  const float scale_f = static_cast<float>(scale);
  // One task per (row, key/value head): its query heads share each widened key and value.
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(groups * dim), kv(dim), acc(groups * dim), sums(groups);
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, h_kv = task % kv_heads;
      const int64_t prefix = pp[r], count = prefix + cp[r];
      const int64_t* row_extras = ep + r * extra_width;
      auto slot = [&](int64_t j) { return j < prefix ? j : row_extras[j - prefix]; };
      for (int64_t g = 0; g < groups; ++g)
        widen(qp + (h_kv * groups + g) * qs0 + r * qs1, dim, q.data() + g * dim);
      scores.assign(groups * count, 0.0f);
      for (int64_t j = 0; j < count; ++j) {
        widen(kp + h_kv * ks0 + slot(j) * ks1, dim, kv.data());
        for (int64_t g = 0; g < groups; ++g)
          scores[g * count + j] = dot(q.data() + g * dim, kv.data(), dim) * scale_f;
      }
      for (int64_t g = 0; g < groups; ++g) {
        float* s = scores.data() + g * count;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < count; ++j) top = std::max(top, s[j]);
        float sum = 0.0f;
        for (int64_t j = 0; j < count; ++j) {
          s[j] = std::exp(s[j] - top);
          sum += s[j];
        }
        sums[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < count; ++j) {
        widen(vp + h_kv * vs0 + slot(j) * vs1, dim, kv.data());
        for (int64_t g = 0; g < groups; ++g) {
          const float p = scores[g * count + j];
          float* a = acc.data() + g * dim;
          for (int64_t d = 0; d < dim; ++d) a[d] += p * kv[d];
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        uint16_t* target = op + (r * heads + h_kv * groups + g) * dim;
        for (int64_t d = 0; d < dim; ++d)
          target[d] = c10::BFloat16(acc[g * dim + d] / sums[g]).x;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("rowwise_attention(Tensor query, Tensor key, Tensor value, Tensor prefixes, "
        "Tensor extras, Tensor extra_counts, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("rowwise_attention", &rowwise_attention);
}
