// Weights in one byte each, bfloat16 activations: y = x @ w^T (+ bias), for decoding.
// Three paths, chosen when the operator is compiled for the CPU at hand: AVX-512 BF16
// (below), AVX2 (integer products on 16-bit activations, int8_linear_avx2) and portable C++.
//
// Each weight row is cut into groups of GROUP = 32 inputs, each group with a float32
// scale s and offset o, and each weight a code c in 0..127: w = s * (128 + c) + o.
// 128 + c is an integer in [128, 255], which bfloat16 holds exactly and whose bits are
// 0x4300 | c: decoding 32 weights takes a zero-extension and an OR.
//
// The inputs are reordered once per layer (int8_pack) into "super-blocks" of up to 16
// groups in which each of the 16 lanes of a vector holds the inputs of one group only:
// a super-block of n groups gives each group 16 / n lanes and takes n vector steps. A
// lane's dot products (vdpbf16ps) then sum inputs of one group, so the group scales
// apply once per super-block as a vector of per-lane scales, and the offsets likewise
// against per-lane sums of the inputs. The scales and offsets are kept once per group
// and spread over a super-block's lanes as they load (a permute where n < 16), so the
// bytes a token reads are the codes and one scale and offset per 32 of them. Per row and
// 32 weights that is one vdpbf16ps and a sixteenth of a multiply-add. The weights are
// decoded in registers as they are used, once for up to 4 rows, so a verification's
// extra rows cost little. The AVX2 path packs super-blocks of 8 groups for its 8 lanes
// (avx2_source_index).
//
// A layer whose codes are all multiples of 8 (16 levels a group, as a 4-bit GGUF block
// holds) keeps them in 4 bits (int8_nibbles): two outputs share a byte, code / 8 of the
// even output in the low nibble and of the odd one in the high nibble. They decode to the
// same bfloat16 weights, so the product is the same bits, from half the code bytes.
//
// Each output element is one sum whose order depends on the layer's width alone: never
// on how many rows share the call, where a row sits among them, or how outputs are
// split across threads. A row gets the same bits in a one-row decode, a k-row
// verification and a batch of sessions (row-invariant by construction).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SPECDEC_AVX512BF16 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPECDEC_AVX2 1
#endif

namespace {

constexpr int64_t GROUP = 32;    // inputs per scale and offset; one vector step
constexpr int64_t LANES = 16;    // float32 lanes of a vector
constexpr int64_t BLOCK_N = 4;   // outputs decoded and computed together
constexpr int64_t BLOCK_M = 4;   // rows computed together: more accumulators spill registers
// Decoding asks for the codes this far ahead (prefetches): the codes stream through once,
// and the hardware prefetchers stop at every 4 KiB page.
constexpr int64_t PREFETCH_BYTES = 2048;

struct SuperBlock {
  int64_t first_step;  // = first group
  int64_t groups;      // 16, 8, 4, 2 or 1: as many vector steps
};

// Groups in super-blocks of `lanes` (a vector's lanes), then the rest in powers of two,
// largest first.
std::vector<SuperBlock> super_blocks(int64_t groups, int64_t lanes = LANES) {
  std::vector<SuperBlock> blocks;
  int64_t step = 0;
  for (int64_t size = lanes; size >= 1; size /= 2)
    while (groups - step >= size) {
      blocks.push_back({step, size});
      step += size;
    }
  return blocks;
}

// Where the input at packed position (step, lane, pair) comes from.
inline int64_t source_index(const SuperBlock& block, int64_t step, int64_t lane, int64_t pair) {
  const int64_t lanes_per_group = LANES / block.groups;
  const int64_t group = block.first_step + lane / lanes_per_group;
  const int64_t t = step - block.first_step;
  return group * GROUP + 2 * (t * lanes_per_group + lane % lanes_per_group) + pair;
}

#ifdef SPECDEC_AVX2
constexpr int64_t AVX2_LANES = 8;  // int32 lanes of an AVX2 vector

// The AVX2 path's packed order: super-blocks of up to 8 groups, a group's 32 positions
// two int16 steps of 8 lanes x 2 inputs, and lane l of a super-block of n groups summing
// inputs of group first + l / (8 / n) only (as source_index does with 16 lanes).
inline int64_t avx2_source_index(const SuperBlock& block, int64_t slot, int64_t position) {
  const int64_t lanes_per_group = AVX2_LANES / block.groups;
  const int64_t t = 2 * (slot - block.first_step) + position / 16;  // int16 step
  const int64_t lane = (position % 16) / 2;
  const int64_t group = block.first_step + lane / lanes_per_group;
  return group * GROUP + 2 * (t * lanes_per_group + lane % lanes_per_group) + position % 2;
}
#endif

// For each packed position (step * GROUP + position in the step) the input it holds: the
// vector path's order (avx2_source_index or source_index; the portable path shares
// AVX-512's).
std::vector<int64_t> packed_sources(int64_t groups) {
  std::vector<int64_t> sources(groups * GROUP);
#ifdef SPECDEC_AVX2
  for (const SuperBlock& block : super_blocks(groups, AVX2_LANES))
    for (int64_t slot = block.first_step; slot < block.first_step + block.groups; ++slot)
      for (int64_t position = 0; position < GROUP; ++position)
        sources[slot * GROUP + position] = avx2_source_index(block, slot, position);
#else
  for (const SuperBlock& block : super_blocks(groups))
    for (int64_t step = block.first_step; step < block.first_step + block.groups; ++step)
      for (int64_t lane = 0; lane < LANES; ++lane)
        for (int64_t pair = 0; pair < 2; ++pair)
          sources[step * GROUP + 2 * lane + pair] = source_index(block, step, lane, pair);
#endif
  return sources;
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

// (codes [N, K] in input order, scales and offsets [N, K / 32]) -> (codes [N / 4, K / 32,
// 4, 32] in packed order, scales and offsets [N, K / 32] as float32).
std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_pack(const at::Tensor& codes,
                                                         const at::Tensor& scales,
                                                         const at::Tensor& offsets) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2, "int8_pack: codes uint8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1), groups = K / GROUP;
  TORCH_CHECK(K % GROUP == 0 && N % BLOCK_N == 0,
              "int8_pack: input features must be a multiple of 32, outputs of 4");
  const at::Tensor c = codes.contiguous(), s = scales.to(at::kFloat).contiguous(),
                   o = offsets.to(at::kFloat).contiguous();
  const auto sources = packed_sources(groups);
  at::Tensor packed = at::empty({N / BLOCK_N, groups, BLOCK_N, GROUP}, codes.options());
  TORCH_CHECK(s.numel() == N * groups && o.numel() == N * groups,
              "int8_pack: scales and offsets need one value per group of 32 inputs");
  const uint8_t* cp = c.data_ptr<uint8_t>();
  uint8_t* pp = packed.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t step = 0; step < groups; ++step)
      for (int64_t position = 0; position < GROUP; ++position)
        pp[(((n / BLOCK_N) * groups + step) * BLOCK_N + n % BLOCK_N) * GROUP + position] =
            cp[n * K + sources[step * GROUP + position]];
  return {packed, s.clone().view({N, groups}), o.clone().view({N, groups})};
}

// int8_pack's codes [N / 4, K / 32, 4, 32], every one a multiple of 8 -> [N / 4, K / 32,
// 2, 32]: byte (p, i) = code(2p, i) / 8 | code(2p + 1, i) / 8 << 4.
at::Tensor int8_nibbles(const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 &&
                  packed.size(2) == BLOCK_N && packed.size(3) == GROUP,
              "int8_nibbles: codes must come from int8_pack");
  const at::Tensor c = packed.contiguous();
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const int64_t steps = c.size(0) * c.size(1);
  for (int64_t i = 0; i < c.numel(); ++i)
    TORCH_CHECK(cp[i] % 8 == 0, "int8_nibbles: a code is not a multiple of 8");
  at::Tensor out = at::empty({c.size(0), c.size(1), BLOCK_N / 2, GROUP}, c.options());
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t step = 0; step < steps; ++step)
    for (int64_t pair = 0; pair < BLOCK_N / 2; ++pair)
      for (int64_t i = 0; i < GROUP; ++i) {
        const uint8_t* src = cp + (step * BLOCK_N + 2 * pair) * GROUP + i;
        op[(step * (BLOCK_N / 2) + pair) * GROUP + i] =
            static_cast<uint8_t>((src[0] >> 3) | ((src[GROUP] >> 3) << 4));
      }
  return out;
}

// Output j's 32 bfloat16 weights of one step from either layout, as int8_linear decodes them.
inline uint16_t decoded_weight(const uint8_t* step_codes, bool nibbles, int64_t j, int64_t i) {
  if (!nibbles) return static_cast<uint16_t>(0x4300 | step_codes[j * GROUP + i]);
  const uint8_t byte = step_codes[(j / 2) * GROUP + i];
  return static_cast<uint16_t>(0x4300 | (j % 2 ? (byte >> 4) << 3 : (byte & 15) << 3));
}

// Output blocks per task: enough that each reads about 128 KiB of codes, but no more than
// an even share of the threads, so a small layer still splits evenly over them.
inline int64_t task_blocks(int64_t blocks, int64_t block_bytes) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  return std::max<int64_t>(
      1, std::min<int64_t>((1 << 17) / block_bytes, (blocks + threads - 1) / threads));
}

// A block's rows in passes of at most block_m, as even as they go: pass(first row, rows).
// Each row's sums run in the same order whichever pass computes it.
template <class Pass>
inline void for_each_pass(int64_t M, int64_t block_m, Pass&& pass) {
  for (int64_t m0 = 0; m0 < M;) {
    const int64_t left = M - m0;
    const int64_t passes = (left + block_m - 1) / block_m;
    const int64_t rows = (left + passes - 1) / passes;
    pass(m0, rows);
    m0 += rows;
  }
}

// A pass's sums dots [rows, BLOCK_N] (+ bias) as bfloat16 into out [M, N] at (m0, n0).
inline void store_dots(const float* dots, int64_t rows, const float* bias, int64_t m0,
                       int64_t n0, int64_t N, uint16_t* out) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < BLOCK_N; ++j) {
      float value = dots[i * BLOCK_N + j];
      if (bias) value += bias[n0 + j];
      out[(m0 + i) * N + n0 + j] = c10::BFloat16(value).x;
    }
}

#ifdef SPECDEC_AVX512BF16
inline __m512bh decode32(const uint8_t* codes) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  return (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(bytes), _mm512_set1_epi16(0x4300));
}

inline __m512bh load_bf16(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// A super-block's per-lane values from one output's per-group values: lane l holds
// group first_step + l / (16 / groups) (lane_index).
inline __m512 lane_values(const float* per_group, const SuperBlock& block, __m512i lane_index) {
  const float* values = per_group + block.first_step;
  if (block.groups == LANES) return _mm512_loadu_ps(values);
  const __mmask16 held = static_cast<__mmask16>((1u << block.groups) - 1);
  return _mm512_permutexvar_ps(lane_index, _mm512_maskz_loadu_ps(held, values));
}

// Two outputs' 32 weights from 32 bytes of int8_nibbles' layout: (word << 3) & 0x78 is
// the low nibble times 8, (word >> 1) & 0x78 the high one; 0xEA is (a & b) | c.
inline void decode32_pair(const uint8_t* codes, __m512bh& even, __m512bh& odd) {
  const __m512i words = _mm512_cvtepu8_epi16(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
  const __m512i mask = _mm512_set1_epi16(0x0078), base = _mm512_set1_epi16(0x4300);
  even = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi16(words, 3), mask, base, 0xEA);
  odd = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 1), mask, base, 0xEA);
}

// A block's BLOCK_N weight vectors, decoded from the packed codes as dot_block reads
// them (into registers, never to memory), with the codes PREFETCH_BYTES ahead asked for.
// A step's codes are BLOCK_N * GROUP bytes (two cache lines), or half that in nibbles.
struct PackedCodes {
  const uint8_t* codes;  // every block's codes
  int64_t block_offset;  // this block's first code
  int64_t code_bytes;
  bool nibbles;
  void decode(int64_t step, __m512bh (&wv)[BLOCK_N]) const {
    if (nibbles) {
      const uint8_t* step_codes = codes + block_offset + step * (BLOCK_N / 2) * GROUP;
      for (int p = 0; p < BLOCK_N / 2; ++p)
        decode32_pair(step_codes + p * GROUP, wv[2 * p], wv[2 * p + 1]);
    } else {
      for (int j = 0; j < BLOCK_N; ++j)
        wv[j] = decode32(codes + block_offset + (step * BLOCK_N + j) * GROUP);
    }
  }
  void prefetch(int64_t step) const {
    const int64_t step_bytes = (nibbles ? BLOCK_N / 2 : BLOCK_N) * GROUP;
    const int64_t ahead = block_offset + step * step_bytes + PREFETCH_BYTES;
    if (ahead + step_bytes <= code_bytes)
      for (int64_t line = 0; line < step_bytes; line += 64)
        __builtin_prefetch(codes + ahead + line, 0, 3);
  }
};

using Weights = PackedCodes;
using LaneIndex = std::vector<__m512i>;  // per super-block (lane_values)

// RM rows x BLOCK_N outputs over every super-block; out[i * BLOCK_N + j]. A super-block's
// dot products stay in registers (RM * BLOCK_N of them); the running sums across
// super-blocks wait in L1 (acc), so up to BLOCK_M rows share each decoded weight vector
// (more rows take more passes, each decoding the block's codes again from L1).
// scales and offsets: the block's first output's per-group values (groups per output).
template <int RM>
void dot_block(const uint16_t* x, const float* x_lane_sums, int64_t K,
               const std::vector<SuperBlock>& blocks, const LaneIndex& lane_index,
               const Weights& weights, const float* scales, const float* offsets, float* out) {
  const int64_t groups = K / GROUP;
  const int64_t count = static_cast<int64_t>(blocks.size());
  alignas(64) float acc[RM][BLOCK_N][LANES] = {};
  for (int64_t b = 0; b < count; ++b) {
    __m512 part[RM][BLOCK_N];
    for (int i = 0; i < RM; ++i)
      for (int j = 0; j < BLOCK_N; ++j) part[i][j] = _mm512_setzero_ps();
    const int64_t end = blocks[b].first_step + blocks[b].groups;
    for (int64_t step = blocks[b].first_step; step < end; ++step) {
      weights.prefetch(step);
      __m512bh wv[BLOCK_N];
      weights.decode(step, wv);
      for (int i = 0; i < RM; ++i) {
        const __m512bh xv = load_bf16(x + i * K + step * GROUP);
        for (int j = 0; j < BLOCK_N; ++j) part[i][j] = _mm512_dpbf16_ps(part[i][j], xv, wv[j]);
      }
    }
    for (int j = 0; j < BLOCK_N; ++j) {
      const __m512 s = lane_values(scales + j * groups, blocks[b], lane_index[b]);
      const __m512 o = lane_values(offsets + j * groups, blocks[b], lane_index[b]);
      for (int i = 0; i < RM; ++i) {
        __m512 a = _mm512_fmadd_ps(part[i][j], s, _mm512_load_ps(acc[i][j]));
        a = _mm512_fmadd_ps(o, _mm512_loadu_ps(x_lane_sums + (i * count + b) * LANES), a);
        _mm512_store_ps(acc[i][j], a);
      }
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < BLOCK_N; ++j)
      out[i * BLOCK_N + j] = _mm512_reduce_add_ps(_mm512_load_ps(acc[i][j]));
}
#else
// Any other CPU: each lane's sums in the same order, in float32 (a pair's products round
// apart here, so the bits are this path's own, row-invariant as the vector path's).
using Weights = const uint16_t*;  // the block's weights decoded, [BLOCK_N, K]
struct LaneIndex {};  // lanes find their group by arithmetic here

template <int RM>
void dot_block(const uint16_t* x, const float* x_lane_sums, int64_t K,
               const std::vector<SuperBlock>& blocks, const LaneIndex& /*lane_index*/,
               const Weights& w, const float* scales, const float* offsets, float* out) {
  const int64_t count = static_cast<int64_t>(blocks.size());
  const int64_t groups = K / GROUP;
  for (int i = 0; i < RM; ++i)
    for (int64_t j = 0; j < BLOCK_N; ++j) {
      float acc[LANES] = {0};
      for (int64_t b = 0; b < count; ++b) {
        float part[LANES] = {0};
        const int64_t end = blocks[b].first_step + blocks[b].groups;
        for (int64_t step = blocks[b].first_step; step < end; ++step)
          for (int64_t lane = 0; lane < LANES; ++lane) {
            const int64_t k = step * GROUP + 2 * lane;
            part[lane] += bf16_to_float(x[i * K + k]) * bf16_to_float(w[j * K + k]) +
                          bf16_to_float(x[i * K + k + 1]) * bf16_to_float(w[j * K + k + 1]);
          }
        for (int64_t lane = 0; lane < LANES; ++lane) {
          const int64_t group = blocks[b].first_step + lane / (LANES / blocks[b].groups);
          acc[lane] += part[lane] * scales[j * groups + group];
          acc[lane] += offsets[j * groups + group] * x_lane_sums[(i * count + b) * LANES + lane];
        }
      }
      for (int width = LANES / 2; width > 0; width /= 2)
        for (int lane = 0; lane < width; ++lane) acc[lane] += acc[lane + width];
      out[i * BLOCK_N + j] = acc[0];
    }
}
#endif

#ifdef SPECDEC_AVX2
// AVX2 (no bfloat16 dot products): integer products. Each row enters as 16-bit integers
// q = x / a, a = 2^(e - 15) for the power of two 2^e just above the row's largest |x|:
// every bfloat16 input within 2^7 of that largest is held exactly, smaller ones to
// a / 2 (a is at least 2^-125, so a float; rows below 2^-110 hold less). vpmaddwd
// multiplies 16 inputs by their codes and adds pairs into 8 int32 lanes, lane l summing
// group first + l / (8 / n) of a super-block of n <= 8 groups (avx2_source_index),
// exactly. Per super-block each lane's sum enters a float32 sum as sum * scale + offset'
// * (the lane's sum of q), offset' = offset + 128 * scale (the codes enter as c, not
// 128 + c); the result is that sum's lanes in a fixed tree, times a. Nibbles enter as
// c / 8 with 8 * scale: the same bits. The order depends on the layer's width alone, so
// a row's result never depends on the other rows: row-invariant.
constexpr int64_t AVX2_BLOCK_M = 4;  // rows sharing a pass (a k = 3 verification in one)

inline float sum8(__m256 v) {  // ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// A super-block's per-lane values from one output's per-group values (lane l: group
// first + l / (8 / n)).
struct Avx2LaneIndex {
  __m256i mask;   // the super-block's groups
  __m256i index;  // lane -> group in the super-block
};

inline __m256 lane_values8(const float* per_group, const SuperBlock& block,
                           const Avx2LaneIndex& lanes) {
  const float* values = per_group + block.first_step;
  if (block.groups == AVX2_LANES) return _mm256_loadu_ps(values);
  return _mm256_permutevar8x32_ps(_mm256_maskload_ps(values, lanes.mask), lanes.index);
}

inline __m256 bf16x8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Rows in int16 (avx2_source_index order), each row's power of two a, and its lanes'
// sums of q per super-block.
struct QuantizedRows {
  std::vector<int16_t> q;        // [M, K]
  std::vector<float> scale;      // [M]: a
  std::vector<float> lane_sums;  // [M, super-blocks, 8]
};

// What the AVX2 path derives from a layer's width, built once per width: its
// super-blocks, their lanes' groups (lane_values8), and the packed order in units of two
// inputs (a vpmaddwd pair): unit u of a packed row holds inputs 2 * pair_sources[u] and
// 2 * pair_sources[u] + 1.
struct Avx2Layout {
  std::vector<SuperBlock> blocks;
  std::vector<Avx2LaneIndex> lanes;
  std::vector<int32_t> pair_sources;
};

const Avx2Layout& avx2_layout(int64_t K) {
  static std::mutex lock;
  static std::map<int64_t, Avx2Layout> layouts;
  const std::lock_guard<std::mutex> guard(lock);
  auto found = layouts.find(K);
  if (found == layouts.end()) {
    Avx2Layout layout{super_blocks(K / GROUP, AVX2_LANES), {}, std::vector<int32_t>(K / 2)};
    for (const SuperBlock& block : layout.blocks) {
      alignas(32) int32_t mask[AVX2_LANES], index[AVX2_LANES];
      for (int64_t lane = 0; lane < AVX2_LANES; ++lane) {
        mask[lane] = lane < block.groups ? -1 : 0;
        index[lane] = static_cast<int32_t>(lane / (AVX2_LANES / block.groups));
      }
      layout.lanes.push_back({_mm256_load_si256(reinterpret_cast<const __m256i*>(mask)),
                              _mm256_load_si256(reinterpret_cast<const __m256i*>(index))});
    }
    const std::vector<int64_t> sources = packed_sources(K / GROUP);
    for (int64_t unit = 0; unit < K / 2; ++unit)
      layout.pair_sources[unit] = static_cast<int32_t>(sources[2 * unit] / 2);
    found = layouts.emplace(K, std::move(layout)).first;
  }
  return found->second;
}

QuantizedRows quantize_rows(const uint16_t* x, int64_t M, int64_t K, const Avx2Layout& layout) {
  const std::vector<SuperBlock>& blocks = layout.blocks;
  const int64_t count = static_cast<int64_t>(blocks.size());
  const std::vector<int32_t>& pair_sources = layout.pair_sources;
  QuantizedRows rows{std::vector<int16_t>(M * K), std::vector<float>(M),
                     std::vector<float>(M * count * AVX2_LANES)};
  std::vector<int16_t> natural(K);  // a row's q in input order
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* row = x + m * K;
    __m256 largest8 = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t k = 0; k < K; k += 8) {  // K is a multiple of 32
      const __m256 v = bf16x8(row + k);
      largest8 = _mm256_max_ps(largest8, _mm256_and_ps(magnitude, v));
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    alignas(32) float lanes[AVX2_LANES];
    _mm256_store_ps(lanes, largest8);
    const float largest = *std::max_element(lanes, lanes + AVX2_LANES);
    int exponent = 0;
    std::frexp(std::isfinite(largest) ? largest : 1.0f, &exponent);  // largest < 2^exponent
    exponent = std::max(exponent, -110);  // 2^(15 - exponent) stays a float
    const __m256 inverse = _mm256_set1_ps(std::ldexp(1.0f, 15 - exponent));
    // A row holding an infinity or a NaN gives NaN outputs (bfloat16 products: no finite ones).
    const bool finite = std::isfinite(largest) && _mm256_movemask_ps(unordered) == 0;
    rows.scale[m] = finite ? std::ldexp(1.0f, exponent - 15) : std::nanf("");
    // Round to nearest, ties to even (the default rounding mode), into int16 (|q| < 2^15).
    for (int64_t k = 0; k < K; k += 16) {
      const __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(bf16x8(row + k), inverse));
      const __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(bf16x8(row + k + 8), inverse));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(natural.data() + k),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(low, high), 0xD8));
    }
    int32_t* q = reinterpret_cast<int32_t*>(rows.q.data() + m * K);
    const int32_t* natural_pairs = reinterpret_cast<const int32_t*>(natural.data());
    for (int64_t unit = 0; unit < K / 2; ++unit) q[unit] = natural_pairs[pair_sources[unit]];
    // Lane l of a step sums the step's pair l: what vpmaddwd with ones gives.
    const int16_t* packed = rows.q.data() + m * K;
    for (int64_t b = 0; b < count; ++b) {
      __m256i sums = _mm256_setzero_si256();
      for (int64_t k = blocks[b].first_step * GROUP;
           k < (blocks[b].first_step + blocks[b].groups) * GROUP; k += 16)
        sums = _mm256_add_epi32(sums, _mm256_madd_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + k)), ones));
      _mm256_storeu_ps(rows.lane_sums.data() + (m * count + b) * AVX2_LANES,
                       _mm256_cvtepi32_ps(sums));
    }
  }
  return rows;
}

// How a block's codes are held for the AVX2 path: bytes (int8_pack), nibbles
// (int8_nibbles), or nibbles' values one to a byte (expand_nibbles: a block's codes decoded
// once for a forward's several passes of rows).
enum class Codes { kBytes, kNibbles, kNibbleBytes };

// Output j's 16 codes of an int16 step as int16 (step_codes: the group slot's codes of
// the whole block; half: which 16 of its 32 positions).
template <Codes CODES>
inline __m256i codes16(const uint8_t* step_codes, int j, int half) {
  if (CODES != Codes::kNibbles)
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(step_codes + j * GROUP + 16 * half)));
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(step_codes + (j / 2) * GROUP + 16 * half)));
  return j % 2 ? _mm256_srli_epi16(bytes, 4) : _mm256_and_si256(bytes, _mm256_set1_epi16(15));
}

// A block's nibbles (groups slots of BLOCK_N / 2 x GROUP bytes) as one value a byte
// (slots of BLOCK_N x GROUP bytes, int8_pack's layout), asking for the next block's bytes
// (ahead; null for the last) as it goes, so that they arrive while the passes of rows
// read the expanded copy (whose prefetches would ask for nothing to come).
inline void expand_nibbles(const uint8_t* nibbles, int64_t groups, uint8_t* bytes,
                           const uint8_t* ahead) {
  const __m256i low = _mm256_set1_epi8(15);
  for (int64_t pair = 0; pair < groups * (BLOCK_N / 2); ++pair) {
    if (ahead != nullptr && pair % 2 == 0) __builtin_prefetch(ahead + pair * GROUP, 0, 3);
    const __m256i packed =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + pair * GROUP));
    __m256i* out = reinterpret_cast<__m256i*>(bytes + 2 * pair * GROUP);
    _mm256_storeu_si256(out, _mm256_and_si256(packed, low));
    _mm256_storeu_si256(out + 1, _mm256_and_si256(_mm256_srli_epi16(packed, 4), low));
  }
}

// RM rows x one block's BLOCK_N outputs, OUTPUTS at a time; out[i * BLOCK_N + j] before
// the rows' scales a.
template <int RM, Codes CODES>
void dot_block_avx2(const int16_t* q, const float* lane_sums, int64_t K,
                    const std::vector<SuperBlock>& blocks,
                    const std::vector<Avx2LaneIndex>& lanes, const uint8_t* codes,
                    const float* scales, const float* offsets, float* out) {
  const int64_t groups = K / GROUP;
  const int64_t count = static_cast<int64_t>(blocks.size());
  constexpr int64_t step_bytes = (CODES == Codes::kNibbles ? BLOCK_N / 2 : BLOCK_N) * GROUP;
  // RM * OUTPUTS int32 sums in registers; each row's vector loaded serves OUTPUTS outputs.
  constexpr int OUTPUTS = RM >= 3 ? 2 : 4;
  const __m256 code_scale = _mm256_set1_ps(CODES == Codes::kBytes ? 1.0f : 8.0f);
  for (int j0 = 0; j0 < BLOCK_N; j0 += OUTPUTS) {
    __m256 acc[RM][OUTPUTS];
    for (int i = 0; i < RM; ++i)
      for (int t = 0; t < OUTPUTS; ++t) acc[i][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < count; ++b) {
      __m256i part[RM][OUTPUTS];
      for (int i = 0; i < RM; ++i)
        for (int t = 0; t < OUTPUTS; ++t) part[i][t] = _mm256_setzero_si256();
      const int64_t end = blocks[b].first_step + blocks[b].groups;
      for (int64_t slot = blocks[b].first_step; slot < end; ++slot) {
        const uint8_t* step_codes = codes + slot * step_bytes;
        if (CODES != Codes::kNibbleBytes && j0 == 0)
          for (int64_t line = 0; line < step_bytes; line += 64)
            __builtin_prefetch(step_codes + PREFETCH_BYTES + line, 0, 3);
        for (int half = 0; half < 2; ++half)
          for (int t = 0; t < OUTPUTS; ++t) {
            const __m256i w = codes16<CODES>(step_codes, j0 + t, half);
            for (int i = 0; i < RM; ++i) {
              const __m256i xv = _mm256_loadu_si256(
                  reinterpret_cast<const __m256i*>(q + i * K + slot * GROUP + 16 * half));
              part[i][t] = _mm256_add_epi32(part[i][t], _mm256_madd_epi16(xv, w));
            }
          }
      }
      for (int t = 0; t < OUTPUTS; ++t) {
        const int j = j0 + t;
        const __m256 s = lane_values8(scales + j * groups, blocks[b], lanes[b]);
        const __m256 o = _mm256_fmadd_ps(
            _mm256_set1_ps(128.0f), s, lane_values8(offsets + j * groups, blocks[b], lanes[b]));
        const __m256 code_s = _mm256_mul_ps(s, code_scale);
        for (int i = 0; i < RM; ++i) {
          acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part[i][t]), code_s, acc[i][t]);
          acc[i][t] = _mm256_fmadd_ps(
              o, _mm256_loadu_ps(lane_sums + (i * count + b) * AVX2_LANES), acc[i][t]);
        }
      }
    }
    for (int i = 0; i < RM; ++i)
      for (int t = 0; t < OUTPUTS; ++t) out[i * BLOCK_N + j0 + t] = sum8(acc[i][t]);
  }
}

template <Codes CODES>
void dot_pass_avx2(int64_t rows, const int16_t* q, const float* lane_sums, int64_t K,
                   const std::vector<SuperBlock>& blocks, const std::vector<Avx2LaneIndex>& lanes,
                   const uint8_t* codes, const float* scales, const float* offsets, float* out) {
  switch (rows) {
    case 4: dot_block_avx2<4, CODES>(q, lane_sums, K, blocks, lanes, codes, scales, offsets, out); break;
    case 3: dot_block_avx2<3, CODES>(q, lane_sums, K, blocks, lanes, codes, scales, offsets, out); break;
    case 2: dot_block_avx2<2, CODES>(q, lane_sums, K, blocks, lanes, codes, scales, offsets, out); break;
    default: dot_block_avx2<1, CODES>(q, lane_sums, K, blocks, lanes, codes, scales, offsets, out); break;
  }
}

at::Tensor int8_linear_avx2(const at::Tensor& x, const at::Tensor& codes,
                            const at::Tensor& scales, const at::Tensor& offsets,
                            const float* bias, bool nibbles, at::Tensor out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), groups = K / GROUP;
  const Avx2Layout& layout = avx2_layout(K);
  const std::vector<SuperBlock>& blocks = layout.blocks;
  const std::vector<Avx2LaneIndex>& lanes = layout.lanes;
  const int64_t count = static_cast<int64_t>(blocks.size());
  const QuantizedRows rows = quantize_rows(
      reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, layout);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t block_bytes = groups * codes.size(2) * GROUP;
  const int64_t grain = task_blocks(N / BLOCK_N, block_bytes);
  at::parallel_for(0, N / BLOCK_N, grain, [&](int64_t begin, int64_t end) {
    float dots[AVX2_BLOCK_M * BLOCK_N];
    // Several rows: nibbles are decoded once per block, not once per pass and output.
    const bool expand = nibbles && M > 1;
    std::vector<uint8_t> expanded(expand ? 2 * block_bytes : 0);
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * BLOCK_N;
      const uint8_t* block = cp + nb * block_bytes;
      if (expand)
        expand_nibbles(block, groups, expanded.data(),
                       nb + 1 < N / BLOCK_N ? block + block_bytes : nullptr);
      const float* bs = sp + n0 * groups;
      const float* bo = op + n0 * groups;
      for_each_pass(M, AVX2_BLOCK_M, [&](int64_t m0, int64_t rows_in_pass) {
        const int16_t* q = rows.q.data() + m0 * K;
        const float* sums = rows.lane_sums.data() + m0 * count * AVX2_LANES;
        if (expand)
          dot_pass_avx2<Codes::kNibbleBytes>(rows_in_pass, q, sums, K, blocks, lanes,
                                             expanded.data(), bs, bo, dots);
        else if (nibbles)
          dot_pass_avx2<Codes::kNibbles>(rows_in_pass, q, sums, K, blocks, lanes, block, bs, bo,
                                         dots);
        else
          dot_pass_avx2<Codes::kBytes>(rows_in_pass, q, sums, K, blocks, lanes, block, bs, bo,
                                       dots);
        for (int64_t i = 0; i < rows_in_pass; ++i)
          for (int64_t j = 0; j < BLOCK_N; ++j) dots[i * BLOCK_N + j] *= rows.scale[m0 + i];
        store_dots(dots, rows_in_pass, bias, m0, n0, N, yp);
      });
    }
  });
  return out;
}
#endif

void dot_rows(int64_t rows, const uint16_t* x, const float* x_lane_sums, int64_t K,
              const std::vector<SuperBlock>& blocks, const LaneIndex& lane_index,
              const Weights& weights, const float* scales, const float* offsets, float* out) {
  switch (rows) {
    case 4: dot_block<4>(x, x_lane_sums, K, blocks, lane_index, weights, scales, offsets, out); break;
    case 3: dot_block<3>(x, x_lane_sums, K, blocks, lane_index, weights, scales, offsets, out); break;
    case 2: dot_block<2>(x, x_lane_sums, K, blocks, lane_index, weights, scales, offsets, out); break;
    default: dot_block<1>(x, x_lane_sums, K, blocks, lane_index, weights, scales, offsets, out); break;
  }
}

at::Tensor int8_linear(const at::Tensor& input, const at::Tensor& codes,
                       const at::Tensor& scales, const at::Tensor& offsets,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16, "int8_linear: input must be bfloat16");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 4 && codes.is_contiguous() &&
                  (codes.size(2) == BLOCK_N || codes.size(2) == BLOCK_N / 2) &&
                  codes.size(3) == GROUP,
              "int8_linear: codes must come from int8_pack (or int8_nibbles)");
  const bool nibbles = codes.size(2) == BLOCK_N / 2;
  const int64_t N = codes.size(0) * BLOCK_N, groups = codes.size(1), K = groups * GROUP;
  TORCH_CHECK(input.size(-1) == K, "int8_linear: input has ", input.size(-1),
              " features, the weight ", K);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && offsets.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && offsets.is_contiguous() &&
                  scales.numel() == N * groups && offsets.numel() == N * groups,
              "int8_linear: scales and offsets must come from int8_pack");
  const at::Tensor x = input.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  auto out_sizes = input.sizes().vec();
  out_sizes.back() = N;
  at::Tensor out = at::empty({M, N}, input.options());
  if (M == 0) return out.view(out_sizes);
  at::Tensor bias_f;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    bp = bias_f.data_ptr<float>();
  }
#ifdef SPECDEC_AVX2
  return int8_linear_avx2(x, codes, scales, offsets, bp, nibbles, out).view(out_sizes);
#else
  const auto blocks = super_blocks(groups);
  const int64_t count = static_cast<int64_t>(blocks.size());
#ifdef SPECDEC_AVX512BF16
  LaneIndex lane_index;
  for (const SuperBlock& block : blocks) {
    alignas(64) int32_t index[LANES];
    for (int64_t lane = 0; lane < LANES; ++lane)
      index[lane] = static_cast<int32_t>(lane / (LANES / block.groups));
    lane_index.push_back(_mm512_load_si512(index));
  }
#else
  const LaneIndex lane_index;
#endif
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  // Each row in packed order, and its inputs' sum per lane of every super-block.
  const std::vector<int64_t> source = packed_sources(groups);
  std::vector<uint16_t> packed_x(M * K);
  std::vector<float> lane_sums(M * count * LANES);
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* row = xp + m * K;
    uint16_t* packed_row = packed_x.data() + m * K;
    for (int64_t k = 0; k < K; ++k) packed_row[k] = row[source[k]];
    for (int64_t b = 0; b < count; ++b) {
      float sums[LANES] = {0};
      for (int64_t step = blocks[b].first_step; step < blocks[b].first_step + blocks[b].groups;
           ++step)
        for (int64_t lane = 0; lane < LANES; ++lane)
          sums[lane] += bf16_to_float(packed_row[step * GROUP + 2 * lane]) +
                        bf16_to_float(packed_row[step * GROUP + 2 * lane + 1]);
      std::memcpy(lane_sums.data() + (m * count + b) * LANES, sums, sizeof sums);
    }
  }
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const int64_t code_bytes = codes.numel();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t block_bytes = groups * codes.size(2) * GROUP;  // one block's codes
  const int64_t grain = task_blocks(N / BLOCK_N, block_bytes);
  at::parallel_for(0, N / BLOCK_N, grain, [&](int64_t begin, int64_t end) {
#ifndef SPECDEC_AVX512BF16
    std::vector<uint16_t> decoded(BLOCK_N * K);
#endif
    float dots[BLOCK_M * BLOCK_N];
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t block_offset = nb * block_bytes;
#ifdef SPECDEC_AVX512BF16
      const PackedCodes weights{cp, block_offset, code_bytes, nibbles};
#else
      for (int64_t step = 0; step < groups; ++step)
        for (int64_t j = 0; j < BLOCK_N; ++j) {
          const uint8_t* step_codes = cp + block_offset + step * codes.size(2) * GROUP;
          uint16_t* dst = decoded.data() + j * K + step * GROUP;
          for (int64_t i = 0; i < GROUP; ++i) dst[i] = decoded_weight(step_codes, nibbles, j, i);
        }
      const Weights weights = decoded.data();
#endif
      const int64_t n0 = nb * BLOCK_N;
      // Up to BLOCK_M rows share each decoded weight vector.
      for_each_pass(M, BLOCK_M, [&](int64_t m0, int64_t rows) {
        dot_rows(rows, packed_x.data() + m0 * K, lane_sums.data() + m0 * count * LANES, K,
                 blocks, lane_index, weights, sp + n0 * groups, op + n0 * groups, dots);
        store_dots(dots, rows, bp, m0, n0, N, yp);
      });
    }
  });
  return out.view(out_sizes);
#endif
}

}  // namespace

TORCH_LIBRARY(specdec, m) {
  m.def("int8_pack(Tensor codes, Tensor scales, Tensor offsets) -> (Tensor, Tensor, Tensor)");
  m.def("int8_nibbles(Tensor codes) -> Tensor");
  m.def("int8_linear(Tensor input, Tensor codes, Tensor scales, Tensor offsets, Tensor? bias)"
        " -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("int8_pack", &int8_pack);
  m.impl("int8_nibbles", &int8_nibbles);
  m.impl("int8_linear", &int8_linear);
}
