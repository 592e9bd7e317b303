// y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for a few rows of fp32 x, on a copy of w packed in panels.
//
// Compiled on the machine that runs it (kernels/few_rows_gemm.py), with HF_AVX512 (16 lanes) or without (AVX2 + FMA,
// 8 lanes). The weight is packed once (few_rows_gemm.pack_weight) as [N_pad / P, K, P] panels of P = 2 vectors of
// output features, zero-padded to a multiple of P: a panel is one contiguous stream. For each k the kernel loads the
// panel's two weight vectors once and multiplies them by x[m, k] broadcast for every row m of a chunk of up to
// kMaxRows rows, whose accumulators stay in registers, and no horizontal sums are needed. The chunks of one panel
// run one after the other, so the weights are read from memory once for all rows. Sums run in fp32 in k order: the
// same math as F.linear, other blocking of the sums.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>

namespace {

#if defined(HF_AVX512)
using vec = __m512;
constexpr int kLanes = 16;
constexpr int kMaxRows = 8;  // 2 x 8 accumulators + 2 weight vectors + 1 broadcast of 32 registers
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vbroadcast(float v) { return _mm512_set1_ps(v); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
#else
using vec = __m256;
constexpr int kLanes = 8;
constexpr int kMaxRows = 6;  // 2 x 6 accumulators + 2 weight vectors + 1 broadcast of 16 registers
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vbroadcast(float v) { return _mm256_set1_ps(v); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
#endif
constexpr int kPanel = 2 * kLanes;
// Software prefetch of the weight stream kAhead steps of k ahead (one step reads kPanel floats: 1 cache line with
// AVX2, 2 with AVX-512). Where the weights come from DRAM, as a whole model's do, the hardware prefetcher alone fell
// behind once a step had more than a few rows of FMAs to run: 90 AVX2 1536 x 576 products over 6 and 8 rows cost
// 28.2 and 35.8 ms without it, 23.8 and 31.0 ms with it (1 row: 24.8 and 24.0 ms).
constexpr int64_t kAhead = 16;
constexpr int kLineFloats = 64 / sizeof(float);

// Panel p of MR rows of x [MR, K] (row stride K) into y (row stride N), only the first N columns written.
// Not inlined: inlined into at::parallel_for's lambda, GCC 12 (AVX2) stored every accumulator to the stack on each k
// step, so a chunk's cost grew with its rows (a 4-row product of a 576 x 576 weight cost 2x a 2-row one).
template <int MR>
__attribute__((noinline)) void panel(const float* x, const float* packed, const float* b, float* y, int64_t K,
                                     int64_t N, int64_t p) {
  const float* w = packed + p * K * kPanel;
  vec lo[MR], hi[MR];
  for (int m = 0; m < MR; ++m) lo[m] = hi[m] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    // the cache lines kAhead steps on (hints only: past the buffer's end they are dropped, never a fault)
    for (int l = 0; l < kPanel; l += kLineFloats) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + kAhead) * kPanel + l), _MM_HINT_T0);
    }
    const vec w0 = vload(w + k * kPanel), w1 = vload(w + k * kPanel + kLanes);
    for (int m = 0; m < MR; ++m) {
      const vec xb = vbroadcast(x[m * K + k]);
      lo[m] = vfma(xb, w0, lo[m]);
      hi[m] = vfma(xb, w1, hi[m]);
    }
  }
  const int64_t n0 = p * kPanel;
  for (int m = 0; m < MR; ++m) {
    alignas(64) float out[kPanel];
    vstore(out, lo[m]);
    vstore(out + kLanes, hi[m]);
    const int64_t width = std::min<int64_t>(kPanel, N - n0);
    for (int64_t j = 0; j < width; ++j) y[m * N + n0 + j] = b ? out[j] + b[n0 + j] : out[j];
  }
}

using Panel = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t);
template <int... R>
constexpr std::array<Panel, sizeof...(R)> panel_kernels(std::integer_sequence<int, R...>) {
  return {&panel<R + 1>...};
}

}  // namespace

int64_t panel_width() { return kPanel; }

torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                              const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "few_rows_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "few_rows_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "few_rows_linear: a contiguous x [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(1) == K && packed.size(2) == kPanel &&
                  packed.size(0) * kPanel >= N && (packed.size(0) - 1) * kPanel < N,
              "few_rows_linear: the weight packed by pack_weight for these out_features and K");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "few_rows_linear: a contiguous float32 bias [N]");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  // Panel by panel, every chunk of kMaxRows rows: each panel is read from memory once, and the chunks after the first
  // find it in cache. (Chunk by chunk over all panels, AVX2's 8 rows read a weight too big for the cache twice: the
  // 49152 x 576 lm_head over 8 rows cost 1.8x 6 rows; now 1.3x.)
  static const auto table = panel_kernels(std::make_integer_sequence<int, kMaxRows>{});
  const float* xs = x.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, (N + kPanel - 1) / kPanel, 8, [&](int64_t s, int64_t e) {
    for (int64_t p = s; p < e; ++p) {
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, M - m0);
        table[rows - 1](xs + m0 * K, w, b, ys + m0 * N, K, N, p);
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("panel_width", &panel_width, "output features per packed panel");
  m.def("few_rows_linear", &few_rows_linear, "x @ w.T + b for a few fp32 rows, w packed by pack_weight");
}
