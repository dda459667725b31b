// A Llama decoder layer's work before and after its attention, for the fused step
// (specdec/engine/fused_step.py), as two operators, and the whole layer as a third:
//   llama_attention_inputs: RMSNorm, the fused q/k/v int8 product, the heads' views and
//     the rotary embedding -> (query, key, value);
//   llama_layer_output: the output projection and residual, RMSNorm, the fused gate/up
//     product, SiLU times up, the down projection and residual -> the layer's output.
// Each one computes what transformers' LlamaDecoderLayer (LlamaRMSNorm.forward,
// apply_rotary_pos_emb, LlamaMLP with SiLU) computes in Python, in the same order and
// dtypes: the int8 products are specdec::int8_linear, SiLU is ATen's, and on bfloat16 rows
// the norms, the rotary embedding, the residual adds and SiLU times up are loops that round
// each value as ATen's operations do (the norm's sum of squares in at::sum's order, found
// on the running CPU). A whole layer writes its rotated keys and its values straight into
// each sequence's cache buffers. Every tensor gets the bits it gets in Python. What goes
// away is the interpreter and some fifty operator calls per layer.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

using Int8Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const std::optional<at::Tensor>&);

// specdec.engine.int8.int8_product: the operator takes bfloat16 and answers in it.
at::Tensor int8_product(const at::Tensor& input, const at::Tensor& codes,
                        const at::Tensor& scales, const at::Tensor& offsets,
                        const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("specdec::int8_linear", "")
                             .typed<Int8Linear>();
  if (input.scalar_type() == at::kBFloat16) return op.call(input, codes, scales, offsets, bias);
  return op.call(input.to(at::kBFloat16), codes, scales, offsets, bias)
      .to(input.scalar_type());
}

// LlamaRMSNorm.forward as ATen's operations compute it.
at::Tensor rms_norm_aten(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  at::Tensor wide = hidden.to(at::kFloat);
  const at::Tensor variance = wide.pow(2).mean(-1, /*keepdim=*/true);
  wide = wide * at::rsqrt(variance + eps);
  return weight * wide.to(hidden.scalar_type());
}

constexpr int64_t kMaxLanes = 16;

int64_t ceil_log2(int64_t value) {
  if (value <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t rest = static_cast<uint64_t>(value) - 1; rest != 0; rest >>= 1) ++bits;
  return bits;
}

// The sum of a contiguous float row as ATen's CPU sum adds it (SumKernel.cpp's
// cascade_sum on a contiguous inner reduction) when its vectors hold `lanes` floats:
// each lane sums the row's vectors in four interleaved streams (vector 4i + k goes to
// stream k), each stream a cascade of partial sums whose levels hold runs of 16 or more;
// the leftover vectors go to stream 0 and streams 1..3 join it in turn; then, from
// zero, the leftover scalars and the lanes in order. width >= lanes.
float cascade_row_sum(const float* values, int64_t width, int64_t lanes) {
  constexpr int64_t levels = 4, streams = 4;
  const int64_t vectors = width / lanes, groups = vectors / streams;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(groups) / levels);
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  float acc[levels][streams][kMaxLanes] = {};
  auto add_group = [&](int64_t group) {
    for (int64_t k = 0; k < streams; ++k) {
      const float* vector = values + (group * streams + k) * lanes;
      for (int64_t l = 0; l < lanes; ++l) acc[0][k][l] += vector[l];
    }
  };
  int64_t group = 0;
  while (group + level_step <= groups) {
    for (int64_t j = 0; j < level_step; ++j, ++group) add_group(group);
    for (int64_t level = 1; level < levels; ++level) {
      for (int64_t k = 0; k < streams; ++k)
        for (int64_t l = 0; l < lanes; ++l) {
          acc[level][k][l] += acc[level - 1][k][l];
          acc[level - 1][k][l] = 0.0f;
        }
      if ((group & (level_mask << (level * level_power))) != 0) break;
    }
  }
  for (; group < groups; ++group) add_group(group);
  for (int64_t level = 1; level < levels; ++level)
    for (int64_t k = 0; k < streams; ++k)
      for (int64_t l = 0; l < lanes; ++l) acc[0][k][l] += acc[level][k][l];
  for (int64_t vector = groups * streams; vector < vectors; ++vector)
    for (int64_t l = 0; l < lanes; ++l) acc[0][0][l] += values[vector * lanes + l];
  for (int64_t k = 1; k < streams; ++k)
    for (int64_t l = 0; l < lanes; ++l) acc[0][0][l] += acc[0][k][l];
  float total = 0.0f;
  for (int64_t i = vectors * lanes; i < width; ++i) total += values[i];
  for (int64_t l = 0; l < lanes; ++l) total += acc[0][0][l];
  return total;
}

// The vector width (in floats) whose cascade_row_sum gives at::sum's bits on rows of
// `width` floats in this process (ATen picks its kernels by the CPU's capability), found
// once per width on pseudo-random rows of widely spread magnitudes; 0 where no width
// does, and the norm then runs ATen's operations.
int64_t norm_sum_lanes(int64_t width) {
  static std::mutex mutex;
  static std::unordered_map<int64_t, int64_t> found;
  std::lock_guard<std::mutex> lock(mutex);
  const auto known = found.find(width);
  if (known != found.end()) return known->second;
  constexpr int64_t probe_rows = 32;
  std::vector<float> probe(static_cast<size_t>(probe_rows * width));
  uint64_t state = 0x9E3779B97F4A7C15ull;
  for (float& value : probe) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const double unit = static_cast<double>(state >> 11) / static_cast<double>(1ull << 53);
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const double scale = std::ldexp(1.0, static_cast<int>(state >> 59) - 16);
    value = static_cast<float>(unit * scale);
  }
  const at::Tensor expected =
      at::from_blob(probe.data(), {probe_rows, width}, at::kFloat).sum(-1).contiguous();
  const float* sums = expected.data_ptr<float>();
  int64_t lanes = 0;
  for (const int64_t candidate : {int64_t{16}, int64_t{8}, int64_t{4}}) {
    if (width < candidate) continue;
    bool equal = true;
    for (int64_t row = 0; row < probe_rows && equal; ++row) {
      const float sum = cascade_row_sum(probe.data() + row * width, width, candidate);
      equal = std::memcmp(&sum, sums + row, sizeof sum) == 0;
    }
    if (equal) {
      lanes = candidate;
      break;
    }
  }
  found.emplace(width, lanes);
  return lanes;
}

inline float widen(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

// Rounded to bfloat16 as ATen rounds each bfloat16 operation's float result (to nearest,
// ties to even), and widened back.
inline float round_bf16(float value) { return widen(c10::BFloat16(value).x); }

inline const uint16_t* bf16_bits(const at::Tensor& tensor) {
  return reinterpret_cast<const uint16_t*>(tensor.data_ptr<at::BFloat16>());
}

inline uint16_t* bf16_bits_out(at::Tensor& tensor) {
  return reinterpret_cast<uint16_t*>(tensor.data_ptr<at::BFloat16>());
}

// LlamaRMSNorm.forward for contiguous bfloat16 rows in one pass, with the bits of ATen's
// operations: the squares in float, their sum in at::sum's order (cascade_row_sum), the
// mean a division by the width, the epsilon added in float, 1 / sqrt, each value times it
// rounded to bfloat16, then times the weight rounded to bfloat16. Other inputs (and a
// CPU whose sum order norm_sum_lanes does not find) take ATen's operations.
at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  const int64_t width = hidden.size(-1);
  const int64_t lanes =
      hidden.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
              hidden.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 &&
              weight.size(0) == width && width > 0
          ? norm_sum_lanes(width)
          : 0;
  if (lanes == 0) return rms_norm_aten(hidden, weight, eps);
  at::Tensor out = at::empty_like(hidden, at::MemoryFormat::Contiguous);
  const uint16_t* in = bf16_bits(hidden);
  const uint16_t* scale = bf16_bits(weight);
  uint16_t* target = bf16_bits_out(out);
  const int64_t rows = hidden.numel() / width;
  const float epsilon = static_cast<float>(eps), count = static_cast<float>(width);
  std::vector<float> squares(static_cast<size_t>(width));
  for (int64_t row = 0; row < rows; ++row) {
    const uint16_t* x = in + row * width;
    for (int64_t i = 0; i < width; ++i) {
      const float value = widen(x[i]);
      squares[i] = value * value;
    }
    const float inverse =
        1.0f / std::sqrt(cascade_row_sum(squares.data(), width, lanes) / count + epsilon);
    uint16_t* y = target + row * width;
    for (int64_t i = 0; i < width; ++i)
      y[i] = c10::BFloat16(widen(scale[i]) * round_bf16(widen(x[i]) * inverse)).x;
  }
  return out;
}

// a + b for bfloat16 tensors of one shape: each sum in float, rounded to bfloat16, as
// ATen's add rounds it; other inputs take ATen's add.
at::Tensor add_bf16(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != at::kBFloat16 || b.scalar_type() != at::kBFloat16 ||
      a.sizes() != b.sizes() || !a.is_contiguous() || !b.is_contiguous())
    return a + b;
  at::Tensor out = at::empty_like(a, at::MemoryFormat::Contiguous);
  const uint16_t* x = bf16_bits(a);
  const uint16_t* y = bf16_bits(b);
  uint16_t* target = bf16_bits_out(out);
  const int64_t count = a.numel();
  for (int64_t i = 0; i < count; ++i) target[i] = c10::BFloat16(widen(x[i]) + widen(y[i])).x;
  return out;
}

// a * b for a contiguous bfloat16 [..., width] and a bfloat16 b of its shape whose rows
// may be strided (a view of a wider product): each product in float, rounded to
// bfloat16, as ATen's mul rounds it; other inputs take ATen's mul.
at::Tensor mul_bf16_rows(const at::Tensor& a, const at::Tensor& b) {
  const int64_t width = a.size(-1);
  if (a.scalar_type() != at::kBFloat16 || b.scalar_type() != at::kBFloat16 ||
      a.sizes() != b.sizes() || !a.is_contiguous() || b.stride(-1) != 1 || a.dim() != 3 ||
      (b.size(0) != 1 && b.stride(0) != b.size(1) * b.stride(1)))
    return a * b;
  at::Tensor out = at::empty_like(a, at::MemoryFormat::Contiguous);
  const uint16_t* x = bf16_bits(a);
  const uint16_t* y = bf16_bits(b);
  uint16_t* target = bf16_bits_out(out);
  const int64_t rows = a.numel() / width, row_stride = b.stride(1);
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t i = 0; i < width; ++i)
      target[row * width + i] =
          c10::BFloat16(widen(x[row * width + i]) * widen(y[row * row_stride + i])).x;
  return out;
}

// transformers' rotate_half.
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({x.slice(-1, half).neg(), x.slice(-1, 0, half)}, -1);
}

// One head's row of apply_rotary_pos_emb's (x * cos) + (rotate_half(x) * sin) in
// bfloat16: each of ATen's three operations computes in float and rounds to bfloat16
// (the negation is exact), and so does this loop, value by value.
inline void rotate_row(const uint16_t* x, const uint16_t* cos, const uint16_t* sin,
                       uint16_t* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < dim; ++d) {
    const float rotated = d < half ? -widen(x[d + half]) : widen(x[d - half]);
    const float first = round_bf16(widen(x[d]) * widen(cos[d]));
    const float second = round_bf16(rotated * widen(sin[d]));
    out[d] = c10::BFloat16(first + second).x;
  }
}

// apply_rotary_pos_emb for bfloat16 x [B, H, R, D] and cos, sin [B, R, D], row by row
// (rotate_row); other dtypes take ATen's operations.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (x.scalar_type() != at::kBFloat16 || cos.scalar_type() != at::kBFloat16 ||
      sin.scalar_type() != at::kBFloat16 || x.dim() != 4 || cos.dim() != 3 ||
      cos.sizes() != sin.sizes() || cos.size(0) != x.size(0) || cos.size(1) != x.size(2) ||
      cos.size(2) != x.size(3) || x.size(3) % 2 != 0 || x.stride(3) != 1) {
    const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
    return (x * c) + (rotate_half(x) * s);
  }
  const int64_t batch = x.size(0), heads = x.size(1), rows = x.size(2), dim = x.size(3);
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = at::empty({batch, heads, rows, dim}, x.options().memory_format(
                                                           at::MemoryFormat::Contiguous));
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* cp = reinterpret_cast<const uint16_t*>(c.data_ptr<at::BFloat16>());
  const auto* sp = reinterpret_cast<const uint16_t*>(s.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* xr = xp + b * x.stride(0) + h * x.stride(1) + r * x.stride(2);
        const uint16_t* cr = cp + (b * rows + r) * dim;
        const uint16_t* sr = sp + (b * rows + r) * dim;
        uint16_t* target = op + ((b * heads + h) * rows + r) * dim;
        rotate_row(xr, cr, sr, target, dim);
      }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> llama_attention_inputs(
    const at::Tensor& hidden, const at::Tensor& norm_weight, double eps,
    const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
    const std::optional<at::Tensor>& bias, int64_t query_width, int64_t key_width,
    int64_t value_width, int64_t head_dim, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(hidden.dim() == 3, "llama_attention_inputs: hidden must be [batch, rows, width]");
  const int64_t batch = hidden.size(0), rows = hidden.size(1);
  const at::Tensor normed = rms_norm(hidden, norm_weight, eps);
  const auto parts = int8_product(normed, codes, scales, offsets, bias)
                         .split_with_sizes({query_width, key_width, value_width}, -1);
  const at::Tensor query = parts[0].view({batch, rows, -1, head_dim}).transpose(1, 2);
  const at::Tensor key = parts[1].view({batch, rows, -1, head_dim}).transpose(1, 2);
  const at::Tensor value = parts[2].view({batch, rows, -1, head_dim}).transpose(1, 2);
  // apply_rotary_pos_emb with unsqueeze_dim 1.
  return {rotary(query, cos, sin), rotary(key, cos, sin), value};
}

at::Tensor llama_layer_output(
    const at::Tensor& attended, const at::Tensor& residual, const at::Tensor& output_codes,
    const at::Tensor& output_scales, const at::Tensor& output_offsets,
    const std::optional<at::Tensor>& output_bias, const at::Tensor& norm_weight, double eps,
    const at::Tensor& gate_up_codes, const at::Tensor& gate_up_scales,
    const at::Tensor& gate_up_offsets, const std::optional<at::Tensor>& gate_up_bias,
    int64_t intermediate, const at::Tensor& down_codes, const at::Tensor& down_scales,
    const at::Tensor& down_offsets, const std::optional<at::Tensor>& down_bias) {
  TORCH_CHECK(residual.dim() == 3, "llama_layer_output: residual must be [batch, rows, width]");
  const at::Tensor flat = attended.reshape({residual.size(0), residual.size(1), -1}).contiguous();
  const at::Tensor hidden = add_bf16(
      residual, int8_product(flat, output_codes, output_scales, output_offsets, output_bias));
  const at::Tensor normed = rms_norm(hidden, norm_weight, eps);
  const auto gate_up = int8_product(normed, gate_up_codes, gate_up_scales, gate_up_offsets,
                                    gate_up_bias).split(intermediate, -1);
  // The gate made contiguous, as the gate layer's own output is: SiLU's kernel then takes
  // the same (vectorised) path.
  const at::Tensor product = mul_bf16_rows(at::silu(gate_up[0].contiguous()), gate_up[1]);
  return add_bf16(hidden,
                  int8_product(product, down_codes, down_scales, down_offsets, down_bias));
}

// Whether llama_decode_layer can write the rotated keys and the values of bfloat16 rows
// straight into the sequences' buffers ([1, kv heads, positions, head dim], each head's
// rows contiguous) from one contiguous q/k/v row per new position, with cos and sin
// [1, rows, head dim].
bool rotates_into_buffers(const at::Tensor& hidden, at::TensorList key_buffers,
                          at::TensorList value_buffers, int64_t query_width,
                          int64_t key_width, int64_t value_width, int64_t head_dim,
                          const at::Tensor& cos, const at::Tensor& sin) {
  if (hidden.scalar_type() != at::kBFloat16 || head_dim <= 0 || head_dim % 2 != 0 ||
      query_width % head_dim != 0 || key_width % head_dim != 0 || key_width != value_width)
    return false;
  for (const at::Tensor* angle : {&cos, &sin})
    if (angle->scalar_type() != at::kBFloat16 || !angle->is_contiguous() ||
        angle->dim() != 3 || angle->size(0) != 1 || angle->size(1) != hidden.size(1) ||
        angle->size(2) != head_dim)
      return false;
  const int64_t kv_heads = key_width / head_dim;
  for (at::TensorList buffers : {key_buffers, value_buffers})
    for (const at::Tensor& buffer : buffers)
      if (buffer.scalar_type() != at::kBFloat16 || buffer.size(0) != 1 ||
          buffer.size(1) != kv_heads || buffer.size(3) != head_dim || buffer.stride(3) != 1)
        return false;
  return true;
}

// A whole decoder layer for the rows of one or more sequences, each over its own KV
// cache that grows in place (kv_cache.GrowingLayer): llama_attention_inputs for all
// rows; for each sequence, its rows' keys and values written into its buffers at
// positions lengths[s]..; specdec::rowwise_attention_packed, each sequence's rows over
// its visible keys (its attention.RowPlan); llama_layer_output for all rows. The rows
// of sequence s follow those of s - 1 (rows[s] of them), as attention.PackedBatch lays
// them out, and each row's attention has the bits of rowwise_attention on its sequence
// alone: a row gets the same bits whichever sequences share its forward. Returns the
// layer's output; the caller takes the written rows into each layer
// (GrowingLayer.advance).
at::Tensor llama_decode_layer(
    const at::Tensor& hidden, at::TensorList key_buffers, at::TensorList value_buffers,
    at::IntArrayRef lengths, at::IntArrayRef rows, at::TensorList prefixes,
    at::TensorList extras, at::TensorList extra_counts, const at::Tensor& input_norm_weight,
    double input_eps, const at::Tensor& qkv_codes, const at::Tensor& qkv_scales,
    const at::Tensor& qkv_offsets, const std::optional<at::Tensor>& qkv_bias,
    int64_t query_width, int64_t key_width, int64_t value_width, int64_t head_dim,
    const at::Tensor& cos, const at::Tensor& sin, double scale,
    const at::Tensor& output_codes, const at::Tensor& output_scales,
    const at::Tensor& output_offsets, const std::optional<at::Tensor>& output_bias,
    const at::Tensor& post_norm_weight, double post_eps, const at::Tensor& gate_up_codes,
    const at::Tensor& gate_up_scales, const at::Tensor& gate_up_offsets,
    const std::optional<at::Tensor>& gate_up_bias, int64_t intermediate,
    const at::Tensor& down_codes, const at::Tensor& down_scales,
    const at::Tensor& down_offsets, const std::optional<at::Tensor>& down_bias) {
  using PackedAttention = at::Tensor(const at::Tensor&, at::TensorList, at::TensorList,
                                     at::TensorList, at::TensorList, at::TensorList,
                                     at::IntArrayRef, double);
  static const auto attention = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("specdec::rowwise_attention_packed", "")
                                    .typed<PackedAttention>();
  const size_t sequences = rows.size();
  TORCH_CHECK(hidden.dim() == 3 && hidden.size(0) == 1,
              "llama_decode_layer: hidden must be [1, rows, width]");
  TORCH_CHECK(sequences > 0 && key_buffers.size() == sequences &&
                  value_buffers.size() == sequences && lengths.size() == sequences &&
                  prefixes.size() == sequences && extras.size() == sequences &&
                  extra_counts.size() == sequences,
              "llama_decode_layer: one buffer pair, length, row count and plan per sequence");
  int64_t total = 0;
  for (size_t s = 0; s < sequences; ++s) {
    const int64_t count = rows[s], length = lengths[s];
    TORCH_CHECK(key_buffers[s].dim() == 4 && value_buffers[s].dim() == 4 && length >= 0 &&
                    count > 0 && length + count <= key_buffers[s].size(2) &&
                    length + count <= value_buffers[s].size(2),
                "llama_decode_layer: sequence ", s, "'s buffers hold ", key_buffers[s].size(2),
                " positions, not ", length, " + ", count);
    total += count;
  }
  TORCH_CHECK(total == hidden.size(1), "llama_decode_layer: the sequences have ", total,
              " rows, hidden ", hidden.size(1));
  std::vector<at::Tensor> keys, values;
  keys.reserve(sequences);
  values.reserve(sequences);
  at::Tensor query;
  if (rotates_into_buffers(hidden, key_buffers, value_buffers, query_width, key_width,
                           value_width, head_dim, cos, sin)) {
    // The q/k/v product's rows rotated straight into the query and each sequence's
    // buffers, values copied: the bits of the path below, without its tensor views.
    const at::Tensor qkv = int8_product(rms_norm(hidden, input_norm_weight, input_eps),
                                        qkv_codes, qkv_scales, qkv_offsets, qkv_bias)
                               .contiguous();
    const int64_t query_heads = query_width / head_dim, kv_heads = key_width / head_dim;
    const int64_t width = query_width + key_width + value_width;
    query = at::empty({query_heads, total, head_dim}, hidden.options());
    const uint16_t* qkv_rows = bf16_bits(qkv);
    const uint16_t* cos_rows = bf16_bits(cos);
    const uint16_t* sin_rows = bf16_bits(sin);
    uint16_t* query_rows = bf16_bits_out(query);
    int64_t row = 0;
    for (size_t s = 0; s < sequences; ++s) {
      const at::Tensor& key_buffer = key_buffers[s];
      const at::Tensor& value_buffer = value_buffers[s];
      uint16_t* key_bits = reinterpret_cast<uint16_t*>(key_buffer.data_ptr<at::BFloat16>());
      uint16_t* value_bits =
          reinterpret_cast<uint16_t*>(value_buffer.data_ptr<at::BFloat16>());
      for (int64_t r = 0; r < rows[s]; ++r, ++row) {
        const uint16_t* source = qkv_rows + row * width;
        const uint16_t* cos_row = cos_rows + row * head_dim;
        const uint16_t* sin_row = sin_rows + row * head_dim;
        for (int64_t h = 0; h < query_heads; ++h)
          rotate_row(source + h * head_dim, cos_row, sin_row,
                     query_rows + (h * total + row) * head_dim, head_dim);
        const int64_t position = lengths[s] + r;
        for (int64_t h = 0; h < kv_heads; ++h) {
          rotate_row(source + query_width + h * head_dim, cos_row, sin_row,
                     key_bits + h * key_buffer.stride(1) + position * key_buffer.stride(2),
                     head_dim);
          std::memcpy(value_bits + h * value_buffer.stride(1) +
                          position * value_buffer.stride(2),
                      source + query_width + key_width + h * head_dim,
                      head_dim * sizeof(uint16_t));
        }
      }
      const int64_t held = lengths[s] + rows[s];
      keys.push_back(key_buffer.as_strided({kv_heads, held, head_dim},
                                           {key_buffer.stride(1), key_buffer.stride(2), 1}));
      values.push_back(value_buffer.as_strided(
          {kv_heads, held, head_dim}, {value_buffer.stride(1), value_buffer.stride(2), 1}));
    }
  } else {
    auto [all_queries, key, value] = llama_attention_inputs(
        hidden, input_norm_weight, input_eps, qkv_codes, qkv_scales, qkv_offsets, qkv_bias,
        query_width, key_width, value_width, head_dim, cos, sin);
    query = all_queries[0];
    int64_t start = 0;
    for (size_t s = 0; s < sequences; ++s) {
      const int64_t count = rows[s], length = lengths[s];
      key_buffers[s].narrow(2, length, count).copy_(key.narrow(2, start, count));
      value_buffers[s].narrow(2, length, count).copy_(value.narrow(2, start, count));
      keys.push_back(key_buffers[s].narrow(2, 0, length + count)[0]);
      values.push_back(value_buffers[s].narrow(2, 0, length + count)[0]);
      start += count;
    }
  }
  const at::Tensor attended =
      attention.call(query, keys, values, prefixes, extras, extra_counts, rows, scale);
  return llama_layer_output(
      attended.unsqueeze(0), hidden, output_codes, output_scales, output_offsets, output_bias,
      post_norm_weight, post_eps, gate_up_codes, gate_up_scales, gate_up_offsets, gate_up_bias,
      intermediate, down_codes, down_scales, down_offsets, down_bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("llama_attention_inputs(Tensor hidden, Tensor norm_weight, float eps, Tensor codes, "
        "Tensor scales, Tensor offsets, Tensor? bias, int query_width, int key_width, "
        "int value_width, int head_dim, Tensor cos, Tensor sin) -> (Tensor, Tensor, Tensor)");
  m.def("llama_layer_output(Tensor attended, Tensor residual, Tensor output_codes, "
        "Tensor output_scales, Tensor output_offsets, Tensor? output_bias, "
        "Tensor norm_weight, float eps, Tensor gate_up_codes, Tensor gate_up_scales, "
        "Tensor gate_up_offsets, Tensor? gate_up_bias, int intermediate, Tensor down_codes, "
        "Tensor down_scales, Tensor down_offsets, Tensor? down_bias) -> Tensor");
  m.def("rms_norm(Tensor hidden, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_sum_lanes(int width) -> int", &norm_sum_lanes);
  m.def("llama_decode_layer(Tensor hidden, Tensor(a!)[] key_buffers, "
        "Tensor(b!)[] value_buffers, int[] lengths, int[] rows, Tensor[] prefixes, "
        "Tensor[] extras, Tensor[] extra_counts, Tensor input_norm_weight, float input_eps, "
        "Tensor qkv_codes, Tensor qkv_scales, Tensor qkv_offsets, Tensor? qkv_bias, "
        "int query_width, int key_width, int value_width, int head_dim, Tensor cos, "
        "Tensor sin, float scale, Tensor output_codes, Tensor output_scales, "
        "Tensor output_offsets, Tensor? output_bias, Tensor post_norm_weight, "
        "float post_eps, Tensor gate_up_codes, Tensor gate_up_scales, "
        "Tensor gate_up_offsets, Tensor? gate_up_bias, int intermediate, Tensor down_codes, "
        "Tensor down_scales, Tensor down_offsets, Tensor? down_bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("llama_attention_inputs", &llama_attention_inputs);
  m.impl("llama_layer_output", &llama_layer_output);
  m.impl("llama_decode_layer", &llama_decode_layer);
  m.impl("rms_norm", &rms_norm);
}
