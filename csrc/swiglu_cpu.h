// SwiGLU of the expert FFN in one pass each way, on rows [R, 2H] = [gate | up] (included by routing_cpu.cpp).
//   forward:  act[r, j] = silu(gate[r, j]) * up[r, j]
//   backward: from grad_act and the pre-activations, grad_pre = [grad_act * up * silu'(gate) | grad_act * silu(gate)]
//             and act again (for the w2 weight gradient).
// Torch's composite form takes five passes forward+backward plus a cat; here each direction reads its inputs once.
// float rows run a polynomial exp that the compiler vectorizes (built for AVX-512, AVX2 and baseline, chosen at
// run time); other dtypes convert a row at a time to float; double uses std::exp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace swiglu {

// exp(-x) clamped to a normal float range (error about 1 ulp): 2^n * p(r), r = -x - n ln2, |r| <= ln2 / 2
inline float exp_neg(float x) {
  float y = -x;
  y = y < -87.0f ? -87.0f : (y > 88.0f ? 88.0f : y);
  const float shifter = 12582912.0f;                 // 1.5 * 2^23: adding it rounds to an integer
  const float n = (y * 1.44269504088896341f + shifter) - shifter;
  const float r = (y - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SWIGLU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SWIGLU_CLONES
#endif

SWIGLU_CLONES
void forward_row(const float* __restrict__ gate, const float* __restrict__ up, float* __restrict__ act, int64_t H) {
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) {
    const float g = gate[j];
    act[j] = g / (1.0f + exp_neg(g)) * up[j];
  }
}

SWIGLU_CLONES
void backward_row(const float* __restrict__ gate, const float* __restrict__ up, const float* __restrict__ grad_act,
                  float* __restrict__ act, float* __restrict__ grad_gate, float* __restrict__ grad_up, int64_t H) {
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) {
    const float g = gate[j], u = up[j], grad = grad_act[j];
    const float s = 1.0f / (1.0f + exp_neg(g));
    const float silu = g * s;
    grad_gate[j] = grad * u * (s + silu * (1.0f - s));
    grad_up[j] = grad * silu;
    act[j] = silu * u;
  }
}

inline void forward_row(const double* gate, const double* up, double* act, int64_t H) {
  for (int64_t j = 0; j < H; ++j) act[j] = gate[j] / (1.0 + std::exp(-gate[j])) * up[j];
}

inline void backward_row(const double* gate, const double* up, const double* grad_act, double* act,
                         double* grad_gate, double* grad_up, int64_t H) {
  for (int64_t j = 0; j < H; ++j) {
    const double g = gate[j], u = up[j], grad = grad_act[j];
    const double s = 1.0 / (1.0 + std::exp(-g)), silu = g * s;
    grad_gate[j] = grad * u * (s + silu * (1.0 - s));
    grad_up[j] = grad * silu;
    act[j] = silu * u;
  }
}

template <typename T>
void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
void from_float(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// rows [begin, end) of pre [R, 2H] -> act [R, H]
template <typename T>
void forward_rows(const T* pre, T* act, int64_t H, int64_t begin, int64_t end) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    for (int64_t r = begin; r < end; ++r) forward_row(pre + r * 2 * H, pre + r * 2 * H + H, act + r * H, H);
  } else {
    std::vector<float> pre_f(2 * H), act_f(H);
    for (int64_t r = begin; r < end; ++r) {
      to_float(pre + r * 2 * H, pre_f.data(), 2 * H);
      forward_row(pre_f.data(), pre_f.data() + H, act_f.data(), H);
      from_float(act_f.data(), act + r * H, H);
    }
  }
}

// rows [begin, end): grad_act [R, H], pre [R, 2H] -> act [R, H], grad_pre [R, 2H]
template <typename T>
void backward_rows(const T* pre, const T* grad_act, T* act, T* grad_pre, int64_t H, int64_t begin, int64_t end) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    for (int64_t r = begin; r < end; ++r) {
      backward_row(pre + r * 2 * H, pre + r * 2 * H + H, grad_act + r * H, act + r * H, grad_pre + r * 2 * H,
                   grad_pre + r * 2 * H + H, H);
    }
  } else {
    std::vector<float> pre_f(2 * H), grad_f(H), act_f(H), grad_pre_f(2 * H);
    for (int64_t r = begin; r < end; ++r) {
      to_float(pre + r * 2 * H, pre_f.data(), 2 * H);
      to_float(grad_act + r * H, grad_f.data(), H);
      backward_row(pre_f.data(), pre_f.data() + H, grad_f.data(), act_f.data(), grad_pre_f.data(),
                   grad_pre_f.data() + H, H);
      from_float(act_f.data(), act + r * H, H);
      from_float(grad_pre_f.data(), grad_pre + r * 2 * H, 2 * H);
    }
  }
}

}  // namespace swiglu
