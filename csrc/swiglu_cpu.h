// SwiGLU of the expert FFN in one pass each way, on rows [R, 2H] = [gate | up] (included by routing_cpu.cpp).
//   forward:  act[r, j] = silu(gate[r, j]) * up[r, j]
//   backward: from grad_act and the pre-activations, grad_pre = [grad_act * up * silu'(gate) | grad_act * silu(gate)]
//             and act again (for the w2 weight gradient).
// Torch's composite form takes five passes forward+backward plus a cat; here each direction reads its inputs once.
// float rows run a polynomial exp that the compiler vectorizes (built for AVX-512, AVX2 and baseline, chosen at
// run time); other dtypes convert a row at a time to float; double uses std::exp.
//
// The clamped form (namespace swiglu, *_clamped; GLM-5-Next / DeepSeek-V4 and gpt-oss), with g = min(gate, L),
// u = clamp(up, -L, L), s = sigmoid(alpha * g):
//   forward:  act = (u + beta) * g * s                      (SwiGLU clamped: alpha 1, beta 0; gpt-oss: beta 1)
//   backward: grad_gate = grad * (u + beta) * (s + alpha * g * s * (1 - s)) where gate <= L, else 0
//             grad_up   = grad * g * s                                       where -L <= up <= L, else 0
// (a clamp passes the gradient at its bounds, as torch.clamp).
//
// In place (backward_inplace, swiglu_backward_ / clamped_swiglu_backward_ in Python): the backward writing grad_pre
// over pre and act over a given [R, H] buffer, which may be grad_act itself (each element is read before it is
// written): the expert FFN's backward then needs no new [R, 2H] or [R, H] buffer once pre is dead.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
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

struct Clamp {
  double limit, alpha, beta;   // float rows compute with them rounded to float
};

SWIGLU_CLONES
void forward_row_clamped(const float* __restrict__ gate, const float* __restrict__ up, float* __restrict__ act,
                         int64_t H, Clamp c) {
  const float L = static_cast<float>(c.limit), alpha = static_cast<float>(c.alpha), beta = static_cast<float>(c.beta);
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) {
    const float g = gate[j] < L ? gate[j] : L;
    const float u = up[j] < -L ? -L : (up[j] > L ? L : up[j]);
    act[j] = (u + beta) * g / (1.0f + exp_neg(alpha * g));
  }
}

SWIGLU_CLONES
void backward_row_clamped(const float* __restrict__ gate, const float* __restrict__ up,
                          const float* __restrict__ grad_act, float* __restrict__ act, float* __restrict__ grad_gate,
                          float* __restrict__ grad_up, int64_t H, Clamp c) {
  const float L = static_cast<float>(c.limit), alpha = static_cast<float>(c.alpha), beta = static_cast<float>(c.beta);
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) {
    const float g = gate[j] < L ? gate[j] : L;
    const float u = up[j] < -L ? -L : (up[j] > L ? L : up[j]);
    const float grad = grad_act[j], s = 1.0f / (1.0f + exp_neg(alpha * g)), glu = g * s;
    grad_gate[j] = gate[j] <= L ? grad * (u + beta) * (s + alpha * glu * (1.0f - s)) : 0.0f;
    grad_up[j] = (up[j] >= -L && up[j] <= L) ? grad * glu : 0.0f;
    act[j] = (u + beta) * glu;
  }
}

inline void forward_row_clamped(const double* gate, const double* up, double* act, int64_t H, Clamp c) {
  const double L = c.limit;
  for (int64_t j = 0; j < H; ++j) {
    const double g = std::min(gate[j], L), u = std::min(std::max(up[j], -L), L);
    act[j] = (u + c.beta) * g / (1.0 + std::exp(-c.alpha * g));
  }
}

inline void backward_row_clamped(const double* gate, const double* up, const double* grad_act, double* act,
                                 double* grad_gate, double* grad_up, int64_t H, Clamp c) {
  const double L = c.limit;
  for (int64_t j = 0; j < H; ++j) {
    const double g = std::min(gate[j], L), u = std::min(std::max(up[j], -L), L);
    const double s = 1.0 / (1.0 + std::exp(-c.alpha * g)), glu = g * s;
    grad_gate[j] = gate[j] <= L ? grad_act[j] * (u + c.beta) * (s + c.alpha * glu * (1.0 - s)) : 0.0;
    grad_up[j] = (up[j] >= -L && up[j] <= L) ? grad_act[j] * glu : 0.0;
    act[j] = (u + c.beta) * glu;
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

// the clamped form of forward_rows / backward_rows
template <typename T>
void forward_rows_clamped(const T* pre, T* act, int64_t H, int64_t begin, int64_t end, Clamp c) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    for (int64_t r = begin; r < end; ++r) forward_row_clamped(pre + r * 2 * H, pre + r * 2 * H + H, act + r * H, H, c);
  } else {
    c.limit = static_cast<float>(static_cast<T>(c.limit));   // the limit in the rows' dtype, as torch.clamp has it
    std::vector<float> pre_f(2 * H), act_f(H);
    for (int64_t r = begin; r < end; ++r) {
      to_float(pre + r * 2 * H, pre_f.data(), 2 * H);
      forward_row_clamped(pre_f.data(), pre_f.data() + H, act_f.data(), H, c);
      from_float(act_f.data(), act + r * H, H);
    }
  }
}

template <typename T>
void backward_rows_clamped(const T* pre, const T* grad_act, T* act, T* grad_pre, int64_t H, int64_t begin,
                           int64_t end, Clamp c) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    for (int64_t r = begin; r < end; ++r) {
      backward_row_clamped(pre + r * 2 * H, pre + r * 2 * H + H, grad_act + r * H, act + r * H,
                           grad_pre + r * 2 * H, grad_pre + r * 2 * H + H, H, c);
    }
  } else {
    c.limit = static_cast<float>(static_cast<T>(c.limit));
    std::vector<float> pre_f(2 * H), grad_f(H), act_f(H), grad_pre_f(2 * H);
    for (int64_t r = begin; r < end; ++r) {
      to_float(pre + r * 2 * H, pre_f.data(), 2 * H);
      to_float(grad_act + r * H, grad_f.data(), H);
      backward_row_clamped(pre_f.data(), pre_f.data() + H, grad_f.data(), act_f.data(), grad_pre_f.data(),
                           grad_pre_f.data() + H, H, c);
      from_float(act_f.data(), act + r * H, H);
      from_float(grad_pre_f.data(), grad_pre + r * 2 * H, 2 * H);
    }
  }
}

// In place, one element at a time (no __restrict__: act may be grad_act; every element is read before it is written):
// gate becomes grad_gate, up grad_up, act the activations; the clamped form when c is given.
SWIGLU_CLONES
void backward_row_inplace(float* gate, float* up, const float* grad_act, float* act, int64_t H) {
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) {
    const float g = gate[j], u = up[j], grad = grad_act[j];
    const float s = 1.0f / (1.0f + exp_neg(g));
    const float silu = g * s;
    gate[j] = grad * u * (s + silu * (1.0f - s));
    up[j] = grad * silu;
    act[j] = silu * u;
  }
}

SWIGLU_CLONES
void backward_row_inplace_clamped(float* gate, float* up, const float* grad_act, float* act, int64_t H, Clamp c) {
  const float L = static_cast<float>(c.limit), alpha = static_cast<float>(c.alpha), beta = static_cast<float>(c.beta);
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) {
    const float gate_in = gate[j], up_in = up[j], grad = grad_act[j];
    const float g = gate_in < L ? gate_in : L;
    const float u = up_in < -L ? -L : (up_in > L ? L : up_in);
    const float s = 1.0f / (1.0f + exp_neg(alpha * g)), glu = g * s;
    gate[j] = gate_in <= L ? grad * (u + beta) * (s + alpha * glu * (1.0f - s)) : 0.0f;
    up[j] = (up_in >= -L && up_in <= L) ? grad * glu : 0.0f;
    act[j] = (u + beta) * glu;
  }
}

inline void backward_row_inplace(double* gate, double* up, const double* grad_act, double* act, int64_t H) {
  for (int64_t j = 0; j < H; ++j) {
    const double g = gate[j], u = up[j], grad = grad_act[j];
    const double s = 1.0 / (1.0 + std::exp(-g)), silu = g * s;
    gate[j] = grad * u * (s + silu * (1.0 - s));
    up[j] = grad * silu;
    act[j] = silu * u;
  }
}

inline void backward_row_inplace_clamped(double* gate, double* up, const double* grad_act, double* act, int64_t H,
                                         Clamp c) {
  const double L = c.limit;
  for (int64_t j = 0; j < H; ++j) {
    const double gate_in = gate[j], up_in = up[j], grad = grad_act[j];
    const double g = std::min(gate_in, L), u = std::min(std::max(up_in, -L), L);
    const double s = 1.0 / (1.0 + std::exp(-c.alpha * g)), glu = g * s;
    gate[j] = gate_in <= L ? grad * (u + c.beta) * (s + c.alpha * glu * (1.0 - s)) : 0.0;
    up[j] = (up_in >= -L && up_in <= L) ? grad * glu : 0.0;
    act[j] = (u + c.beta) * glu;
  }
}

// rows [begin, end) in place: pre [R, 2H] -> grad_pre, act [R, H] (may be grad_act) -> the activations
template <typename T>
void backward_rows_inplace(T* pre, const T* grad_act, T* act, int64_t H, int64_t begin, int64_t end,
                           std::optional<Clamp> c) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    for (int64_t r = begin; r < end; ++r) {
      T *gate = pre + r * 2 * H, *up = gate + H;
      if (c) backward_row_inplace_clamped(gate, up, grad_act + r * H, act + r * H, H, *c);
      else backward_row_inplace(gate, up, grad_act + r * H, act + r * H, H);
    }
  } else {
    if (c) c->limit = static_cast<float>(static_cast<T>(c->limit));   // the limit in the rows' dtype (torch.clamp)
    std::vector<float> pre_f(2 * H), grad_f(H);
    for (int64_t r = begin; r < end; ++r) {
      to_float(pre + r * 2 * H, pre_f.data(), 2 * H);
      to_float(grad_act + r * H, grad_f.data(), H);
      if (c) backward_row_inplace_clamped(pre_f.data(), pre_f.data() + H, grad_f.data(), grad_f.data(), H, *c);
      else backward_row_inplace(pre_f.data(), pre_f.data() + H, grad_f.data(), grad_f.data(), H);
      from_float(pre_f.data(), pre + r * 2 * H, 2 * H);
      from_float(grad_f.data(), act + r * H, H);
    }
  }
}

// Whether the bytes of a and b overlap.
inline bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const char *a0 = static_cast<const char*>(a.data_ptr()), *b0 = static_cast<const char*>(b.data_ptr());
  return a.numel() && b.numel() && a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// The backward in place: grad_act [R, H] and pre [R, 2H] in; pre becomes grad_pre and act [R, H] the activations
// (act may be grad_act itself, or must not overlap it); every tensor contiguous, one dtype. Bumps the version of
// what it writes (autograd then refuses a saved pre it overwrote).
inline void backward_inplace(const at::Tensor& grad_act, const at::Tensor& pre, const at::Tensor& act,
                             std::optional<Clamp> c) {
  TORCH_CHECK(pre.dim() == 2 && pre.size(1) % 2 == 0, "pre must be [rows, 2 * hidden], got ", pre.sizes());
  const int64_t R = pre.size(0), H = pre.size(1) / 2;
  for (const auto* t : {&grad_act, &act}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == R && t->size(1) == H, t == &act ? "act" : "grad_act",
                " must have shape [", R, ", ", H, "], got ", t->sizes());
  }
  for (const auto* t : {&pre, &grad_act, &act}) {
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu() && t->scalar_type() == pre.scalar_type(),
                "pre, grad_act and act must be contiguous CPU tensors of one dtype, got ", pre.scalar_type(), " ",
                grad_act.scalar_type(), " ", act.scalar_type());
  }
  TORCH_CHECK(!overlaps(pre, grad_act) && !overlaps(pre, act), "pre must not overlap grad_act or act");
  TORCH_CHECK(act.data_ptr() == grad_act.data_ptr() || !overlaps(act, grad_act),
              "act must be grad_act itself or not overlap it");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pre.scalar_type(), "swiglu_backward_", [&] {
    scalar_t* pre_p = pre.data_ptr<scalar_t>();
    const scalar_t* grad_act_p = grad_act.data_ptr<scalar_t>();
    scalar_t* act_p = act.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, 3 * H * pre.element_size()));
    at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
      backward_rows_inplace(pre_p, grad_act_p, act_p, H, begin, end, c);
    });
  });
  pre.unsafeGetTensorImpl()->bump_version();
  act.unsafeGetTensorImpl()->bump_version();
}

// The Python module's swiglu_backward_(grad_act, pre, act) and clamped_swiglu_backward_(..., limit, alpha, beta).
inline void swiglu_backward_(const at::Tensor& grad_act, const at::Tensor& pre, const at::Tensor& act) {
  backward_inplace(grad_act, pre, act, std::nullopt);
}

inline void clamped_swiglu_backward_(const at::Tensor& grad_act, const at::Tensor& pre, const at::Tensor& act,
                                     double limit, double alpha, double beta) {
  backward_inplace(grad_act, pre, act, Clamp{limit, alpha, beta});
}

}  // namespace swiglu
