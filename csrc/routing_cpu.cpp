// CPU kernels for the routing data path: slots, scatter of token rows to routed rows, and the
// weighted gather back. Semantics: moe_plugin/ops/torch_ops.py (the reference they are tested against).
// Legend: T tokens, D model dim, E experts, K top-k, R routed rows; pos_TK[t, k] = row or -1 (dropped).
#include <torch/extension.h>

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/native/GroupedMMUtils.h>

#include "swiglu_cpu.h"

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <optional>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include <dlfcn.h>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace {

using at::Tensor;

// Large outputs come from a pool of huge-page-backed blocks that are handed back on free: on CPU a
// fresh 100 MB buffer costs more in page faults and kernel zeroing than the copy that fills it.
// Blocks are kept by size, up to MOE_PLUGIN_POOL_MB (default 1024; 0 turns the pool off).
class BlockPool {
 public:
  static constexpr size_t kAlign = size_t{2} << 20;
  static constexpr size_t kMinBytes = size_t{1} << 20;

  static BlockPool& instance() {
    static BlockPool* pool = new BlockPool();  // never destroyed: tensors may outlive static teardown
    return *pool;
  }

  Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    Tensor out = allocate(sizes, options);
    if (poison_) {  // tests: an element the kernel forgets to write shows up as NaN / INT64_MIN
      if (out.is_floating_point()) out.fill_(std::numeric_limits<double>::quiet_NaN());
      else out.fill_(std::numeric_limits<int64_t>::min());
    }
    return out;
  }

  void set_poison(bool on) { poison_ = on; }

  std::tuple<int64_t, int64_t, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {static_cast<int64_t>(free_bytes_), static_cast<int64_t>(free_.size()), static_cast<int64_t>(limit_bytes_)};
  }

  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [block, ptr] : free_) std::free(ptr);
    free_.clear();
    free_bytes_ = 0;
  }

 private:
  Tensor allocate(at::IntArrayRef sizes, const at::TensorOptions& options) {
    const size_t bytes = c10::multiply_integers(sizes) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
    if (limit_bytes_ == 0 || bytes < kMinBytes) return at::empty(sizes, options);
    const size_t block = (bytes + kAlign - 1) / kAlign * kAlign;
    void* ptr = take(block);
    if (ptr == nullptr) {
      ptr = std::aligned_alloc(kAlign, block);
      TORCH_CHECK(ptr != nullptr, "moe_plugin: out of memory allocating ", block, " bytes");
#ifdef __linux__
      madvise(ptr, block, MADV_HUGEPAGE);
#endif
    }
    return at::from_blob(ptr, sizes, [block](void* p) { BlockPool::instance().give(p, block); }, options);
  }

  BlockPool() {
    const char* mb = std::getenv("MOE_PLUGIN_POOL_MB");
    limit_bytes_ = static_cast<size_t>(mb ? std::max(0L, std::atol(mb)) : 1024L) << 20;
  }

  void* take(size_t block) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.find(block);
    if (it == free_.end()) return nullptr;
    void* ptr = it->second;
    free_.erase(it);
    free_bytes_ -= block;
    return ptr;
  }

  void give(void* ptr, size_t block) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (free_bytes_ + block <= limit_bytes_) {
        free_.emplace(block, ptr);
        free_bytes_ += block;
        return;
      }
    }
    std::free(ptr);
  }

  std::mutex mutex_;
  std::unordered_multimap<size_t, void*> free_;
  size_t free_bytes_ = 0;
  size_t limit_bytes_ = 0;
  std::atomic<bool> poison_{false};
};

Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return BlockPool::instance().empty(sizes, options);
}

// rows per parallel task: about 64 KiB of row data each, so small inputs stay on one thread
int64_t grain_for(int64_t row_bytes) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, row_bytes));
}

void check_pos(const Tensor& pos_TK) {
  TORCH_CHECK(pos_TK.dim() == 2 && pos_TK.scalar_type() == at::kLong,
              "pos_TK must be an int64 [tokens, top_k] tensor, got ", pos_TK.scalar_type(), " ", pos_TK.sizes());
}

void check_rows(const char* name, const Tensor& t, int64_t rows, int64_t dim, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == dim,
              name, " must have shape [", rows, ", ", dim, "], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ", t.scalar_type());
}

void check_scale(const std::optional<Tensor>& scale_TK, const Tensor& pos_TK, at::ScalarType dtype) {
  if (!scale_TK) return;
  TORCH_CHECK(scale_TK->sizes() == pos_TK.sizes(), "scale_TK must have the shape of pos_TK ", pos_TK.sizes(),
              ", got ", scale_TK->sizes());
  TORCH_CHECK(scale_TK->scalar_type() == dtype, "scale_TK must have dtype ", dtype, ", got ",
              scale_TK->scalar_type());
}

std::tuple<Tensor, Tensor> route_slots(const Tensor& expert_TK_in, const std::optional<Tensor>& order_T_in,
                                       const Tensor& row_start_E_in, int64_t capacity, int64_t num_rows) {
  TORCH_CHECK(expert_TK_in.dim() == 2, "expert_TK must be [tokens, top_k], got ", expert_TK_in.sizes());
  const Tensor expert_TK = expert_TK_in.to(at::kLong).contiguous();
  const Tensor row_start_E = row_start_E_in.to(at::kLong).contiguous();
  const int64_t T = expert_TK.size(0), K = expert_TK.size(1), E = row_start_E.numel(), A = T * K;
  Tensor order_T;
  if (order_T_in) {
    order_T = order_T_in->to(at::kLong).contiguous();
    TORCH_CHECK(order_T.numel() == T, "order_T must hold ", T, " token indices, got ", order_T.numel());
  }
  Tensor pos_TK = pooled_empty({T, K}, expert_TK.options());
  Tensor token_R = pooled_empty({num_rows}, expert_TK.options());
  const int64_t* expert = expert_TK.data_ptr<int64_t>();
  const int64_t* order = order_T.defined() ? order_T.data_ptr<int64_t>() : nullptr;
  const int64_t* row_start = row_start_E.data_ptr<int64_t>();
  int64_t* pos = pos_TK.data_ptr<int64_t>();
  int64_t* token = token_R.data_ptr<int64_t>();

  // choices a = k * T + i in visiting order; each chunk counts its choices per expert, a prefix over
  // the chunks gives each chunk its first slot per expert, then the chunks assign slots in parallel
  const int64_t chunk = std::max<int64_t>(4096, (A + 4 * at::get_num_threads() - 1) / std::max(1, 4 * at::get_num_threads()));
  const int64_t num_chunks = A == 0 ? 0 : (A + chunk - 1) / chunk;
  std::vector<int64_t> count_PE(num_chunks * E, 0);
  std::atomic<bool> bad_expert{false};
  auto token_of = [&](int64_t a) {  // choice a is token_of(a)'s choice k = a / T
    const int64_t i = a % T;
    return order ? order[i] : i;
  };
  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      int64_t* count_E = count_PE.data() + p * E;
      for (int64_t a = p * chunk; a < std::min(A, (p + 1) * chunk); ++a) {
        const int64_t e = expert[token_of(a) * K + a / T];
        if (e < 0 || e >= E) { bad_expert = true; continue; }
        ++count_E[e];
      }
    }
  });
  TORCH_CHECK(!bad_expert, "expert_TK holds an expert index outside [0, ", E, ")");
  for (int64_t e = 0; e < E; ++e) {
    int64_t running = 0;
    for (int64_t p = 0; p < num_chunks; ++p) {
      const int64_t c = count_PE[p * E + e];
      count_PE[p * E + e] = running;
      running += c;
    }
  }
  std::atomic<bool> bad_row{false};
  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      int64_t* slot_E = count_PE.data() + p * E;
      for (int64_t a = p * chunk; a < std::min(A, (p + 1) * chunk); ++a) {
        const int64_t t = token_of(a), choice = t * K + a / T, e = expert[choice];
        const int64_t slot = slot_E[e]++;
        if (slot < capacity) {
          const int64_t row = row_start[e] + slot;
          if (row < 0 || row >= num_rows) { bad_row = true; pos[choice] = -1; continue; }
          pos[choice] = row;
          token[row] = t;
        } else {
          pos[choice] = -1;
        }
      }
    }
  });
  TORCH_CHECK(!bad_row, "row_start_E and capacity place a row outside [0, num_rows=", num_rows, ")");
  return {pos_TK, token_R};
}

// <a_D, b_D>, accumulated in the op math type (fp32 for the half types)
template <typename scalar_t>
at::opmath_type<scalar_t> row_dot(const scalar_t* __restrict__ a_D, const scalar_t* __restrict__ b_D, int64_t D) {
  using acc_t = at::opmath_type<scalar_t>;
  acc_t sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < D; ++d) sum += acc_t(a_D[d]) * acc_t(b_D[d]);
  return sum;
}

template <typename scalar_t>
bool scatter_rows_kernel(const Tensor& src_TD, const Tensor& pos_TK, const Tensor* scale_TK, const Tensor* other_RD,
                         Tensor& out_RD, Tensor& dot_TK) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t T = pos_TK.size(0), K = pos_TK.size(1), D = src_TD.size(1), R = out_RD.size(0);
  const scalar_t* src = src_TD.data_ptr<scalar_t>();
  const int64_t* pos = pos_TK.data_ptr<int64_t>();
  const scalar_t* scale = scale_TK ? scale_TK->data_ptr<scalar_t>() : nullptr;  // null only when absent or T == 0
  const scalar_t* other = other_RD ? other_RD->data_ptr<scalar_t>() : nullptr;
  scalar_t* out = out_RD.data_ptr<scalar_t>();
  // decided by the tensor's presence, not its data pointer: an empty tensor may have none
  scalar_t* dot = other_RD ? dot_TK.data_ptr<scalar_t>() : nullptr;
  std::atomic<bool> bad_row{false};
  at::parallel_for(0, T, grain_for(K * D * sizeof(scalar_t)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* __restrict__ src_D = src + t * D;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = pos[t * K + k];
        if (r < 0 || r >= R) {
          if (r >= R) bad_row = true;
          if (dot) dot[t * K + k] = scalar_t(0);
          continue;
        }
        scalar_t* __restrict__ out_D = out + r * D;
        if (scale) {
          const acc_t s = acc_t(scale[t * K + k]);
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) out_D[d] = scalar_t(s * acc_t(src_D[d]));
        } else {
          std::copy(src_D, src_D + D, out_D);
        }
        if (dot) dot[t * K + k] = scalar_t(row_dot(src_D, other + r * D, D));
      }
    }
  });
  return !bad_row;
}

template <typename scalar_t>
bool gather_sum_kernel(const Tensor& src_RD, const Tensor& pos_TK, const Tensor* scale_TK, const Tensor* other_TD,
                       Tensor& out_TD, Tensor& dot_TK) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool kSameType = std::is_same_v<acc_t, scalar_t>;
  const int64_t T = pos_TK.size(0), K = pos_TK.size(1), D = src_RD.size(1), R = src_RD.size(0);
  const scalar_t* src = src_RD.data_ptr<scalar_t>();
  const int64_t* pos = pos_TK.data_ptr<int64_t>();
  const scalar_t* scale = scale_TK ? scale_TK->data_ptr<scalar_t>() : nullptr;  // null only when absent or T == 0
  const scalar_t* other = other_TD ? other_TD->data_ptr<scalar_t>() : nullptr;
  scalar_t* out = out_TD.data_ptr<scalar_t>();
  scalar_t* dot = other_TD ? dot_TK.data_ptr<scalar_t>() : nullptr;
  std::atomic<bool> bad_row{false};
  at::parallel_for(0, T, grain_for(K * D * sizeof(scalar_t)), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> scratch_D(kSameType ? 0 : D);
    for (int64_t t = begin; t < end; ++t) {
      acc_t* __restrict__ acc_D = kSameType ? reinterpret_cast<acc_t*>(out + t * D) : scratch_D.data();
      const scalar_t* __restrict__ other_D = other ? other + t * D : nullptr;
      bool first = true;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = pos[t * K + k];
        if (r < 0 || r >= R) {
          if (r >= R) bad_row = true;
          if (dot) dot[t * K + k] = scalar_t(0);
          continue;
        }
        const scalar_t* __restrict__ src_D = src + r * D;
        const acc_t s = scale ? acc_t(scale[t * K + k]) : acc_t(1);
        if (first) {
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc_D[d] = s * acc_t(src_D[d]);
        } else {
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc_D[d] += s * acc_t(src_D[d]);
        }
        first = false;
        if (dot) dot[t * K + k] = scalar_t(row_dot(other_D, src_D, D));
      }
      if (first) std::fill(acc_D, acc_D + D, acc_t(0));
      if constexpr (!kSameType) {
        scalar_t* __restrict__ out_D = out + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) out_D[d] = scalar_t(acc_D[d]);
      }
    }
  });
  return !bad_row;
}

std::tuple<Tensor, Tensor> scatter_rows(const Tensor& src_TD_in, const Tensor& pos_TK_in,
                                        const std::optional<Tensor>& scale_TK_in,
                                        const std::optional<Tensor>& other_RD_in, int64_t num_rows) {
  TORCH_CHECK(src_TD_in.dim() == 2, "src_TD must be [tokens, dim], got ", src_TD_in.sizes());
  const Tensor src_TD = src_TD_in.contiguous(), pos_TK = pos_TK_in.contiguous();
  check_pos(pos_TK);
  TORCH_CHECK(pos_TK.size(0) == src_TD.size(0), "pos_TK has ", pos_TK.size(0), " tokens, src_TD has ", src_TD.size(0));
  check_scale(scale_TK_in, pos_TK, src_TD.scalar_type());
  const Tensor scale_TK = scale_TK_in ? scale_TK_in->contiguous() : Tensor();
  const Tensor other_RD = other_RD_in ? other_RD_in->contiguous() : Tensor();
  if (other_RD.defined()) check_rows("other_RD", other_RD, num_rows, src_TD.size(1), src_TD.scalar_type());
  Tensor out_RD = pooled_empty({num_rows, src_TD.size(1)}, src_TD.options());
  Tensor dot_TK = pooled_empty(other_RD.defined() ? pos_TK.sizes() : at::IntArrayRef{0}, src_TD.options());
  bool rows_ok = true;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src_TD.scalar_type(), "scatter_rows", [&] {
    rows_ok = scatter_rows_kernel<scalar_t>(src_TD, pos_TK, scale_TK.defined() ? &scale_TK : nullptr,
                                  other_RD.defined() ? &other_RD : nullptr, out_RD, dot_TK);
  });
  TORCH_CHECK(rows_ok, "pos_TK holds a row outside [0, num_rows=", num_rows, ")");
  return {out_RD, dot_TK};
}

std::tuple<Tensor, Tensor> gather_sum(const Tensor& src_RD_in, const Tensor& pos_TK_in,
                                      const std::optional<Tensor>& scale_TK_in,
                                      const std::optional<Tensor>& other_TD_in) {
  TORCH_CHECK(src_RD_in.dim() == 2, "src_RD must be [rows, dim], got ", src_RD_in.sizes());
  const Tensor src_RD = src_RD_in.contiguous(), pos_TK = pos_TK_in.contiguous();
  check_pos(pos_TK);
  check_scale(scale_TK_in, pos_TK, src_RD.scalar_type());
  const Tensor scale_TK = scale_TK_in ? scale_TK_in->contiguous() : Tensor();
  const Tensor other_TD = other_TD_in ? other_TD_in->contiguous() : Tensor();
  if (other_TD.defined()) check_rows("other_TD", other_TD, pos_TK.size(0), src_RD.size(1), src_RD.scalar_type());
  Tensor out_TD = pooled_empty({pos_TK.size(0), src_RD.size(1)}, src_RD.options());
  Tensor dot_TK = pooled_empty(other_TD.defined() ? pos_TK.sizes() : at::IntArrayRef{0}, src_RD.options());
  bool rows_ok = true;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src_RD.scalar_type(), "gather_sum", [&] {
    rows_ok = gather_sum_kernel<scalar_t>(src_RD, pos_TK, scale_TK.defined() ? &scale_TK : nullptr,
                                other_TD.defined() ? &other_TD : nullptr, out_TD, dot_TK);
  });
  TORCH_CHECK(rows_ok, "pos_TK holds a row outside [0, ", src_RD.size(0), ") of src_RD");
  return {out_TD, dot_TK};
}

// fp32 GEMMs straight into the BLAS torch links (MKL / OpenBLAS export the Fortran sgemm_), found at run time in
// torch's own library: torch's grouped-mm fallback spends ~4 us per group in dispatch (empty groups too), which
// is most of a decode step's expert time. Null when absent (then the fallback runs).
using SgemmFn = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                         const int*, const float*, const int*, const float*, float*, const int*);

SgemmFn find_sgemm() {
  if (void* global = dlsym(RTLD_DEFAULT, "sgemm_")) return reinterpret_cast<SgemmFn>(global);
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&at::native::_grouped_mm_fallback), &info) == 0 || info.dli_fname == nullptr) {
    return nullptr;
  }
  void* library = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  return library == nullptr ? nullptr : reinterpret_cast<SgemmFn>(dlsym(library, "sgemm_"));
}

SgemmFn blas_sgemm() {
  static SgemmFn fn = find_sgemm();
  return fn;
}

// A row-major matrix [rows, cols] with strides (s0, s1) as column-major BLAS sees its transpose: the op to apply to
// the stored matrix and its leading dimension; false when neither dimension has unit stride (or a stride is out of
// int range).
bool blas_transposed(int64_t s0, int64_t s1, int64_t rows, int64_t cols, char& op, int& ld) {
  if (s0 >= std::numeric_limits<int>::max() || s1 >= std::numeric_limits<int>::max()) return false;
  if (s1 == 1 && s0 >= std::max<int64_t>(cols, 1)) {
    op = 'N', ld = static_cast<int>(s0);
    return true;
  }
  if (s0 == 1 && s1 >= std::max<int64_t>(rows, 1)) {
    op = 'T', ld = static_cast<int>(s1);
    return true;
  }
  return false;
}

// One operand of a group's GEMM: its first element and its row and column strides.
struct Operand {
  const float* data;
  int64_t s0, s1;
};

// c [m, n] (row stride ldc) = a [m, k] @ b [k, n], row-major: column-major c^T = b^T @ a^T. No tensor is made per
// call (a view per group costs more host time than a small group's GEMM).
bool row_major_sgemm(SgemmFn sgemm, Operand a, Operand b, float* c, int64_t m, int64_t n, int64_t k, int64_t ldc) {
  char op_a, op_b;
  int ld_a, ld_b;
  if (!blas_transposed(a.s0, a.s1, m, k, op_a, ld_a) || !blas_transposed(b.s0, b.s1, k, n, op_b, ld_b)) return false;
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k), LDC = static_cast<int>(ldc);
  const float one = 1.0f, zero = 0.0f;
  sgemm(&op_b, &op_a, &M, &N, &K, &one, b.data, &ld_b, a.data, &ld_a, &zero, c, &LDC);
  return true;
}

// Group e's end row, from int32 or int64 offsets.
int64_t group_end(const Tensor& offs_E, int64_t e) {
  return offs_E.scalar_type() == at::kInt ? offs_E.const_data_ptr<int32_t>()[e] : offs_E.const_data_ptr<int64_t>()[e];
}

// The grouped GEMM with one BLAS call per non-empty group: fp32, operands BLAS takes as they are, sizes in int
// range; false (nothing written) otherwise.
bool grouped_sgemm(const Tensor& a, const Tensor& b, const Tensor& offs_E, Tensor& out) {
  SgemmFn sgemm = blas_sgemm();
  const bool rows_form = b.dim() == 3;
  if (sgemm == nullptr || a.scalar_type() != at::kFloat || b.scalar_type() != at::kFloat ||
      std::max({a.numel(), b.numel(), out.numel()}) >= std::numeric_limits<int>::max() ||
      (rows_form && b.size(0) == 0)) {
    return false;
  }
  char op;
  int ld;
  if (!blas_transposed(a.stride(0), a.stride(1), a.size(0), a.size(1), op, ld) ||
      !(rows_form ? blas_transposed(b.stride(1), b.stride(2), b.size(1), b.size(2), op, ld)
                  : blas_transposed(b.stride(0), b.stride(1), b.size(0), b.size(1), op, ld))) {
    return false;
  }
  const Tensor offs = offs_E.scalar_type() == at::kInt || offs_E.scalar_type() == at::kLong
      ? offs_E.contiguous() : offs_E.to(at::kLong).contiguous();
  const float* a_ptr = a.const_data_ptr<float>();
  const float* b_ptr = b.const_data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  for (int64_t e = 0, start = 0, end = 0; e < offs.size(0); start = end, ++e) {
    end = group_end(offs, e);
    const int64_t rows = end - start;
    if (rows <= 0) continue;
    const bool ok = rows_form   // out[start:end] = a[start:end] @ b[e]; else out[e] = a[:, start:end] @ b[start:end]
        ? row_major_sgemm(sgemm, {a_ptr + start * a.stride(0), a.stride(0), a.stride(1)},
                          {b_ptr + e * b.stride(0), b.stride(1), b.stride(2)}, out_ptr + start * out.stride(0), rows,
                          b.size(2), a.size(1), out.stride(0))
        : row_major_sgemm(sgemm, {a_ptr + start * a.stride(1), a.stride(0), a.stride(1)},
                          {b_ptr + start * b.stride(0), b.stride(0), b.stride(1)}, out_ptr + e * out.stride(0),
                          a.size(0), b.size(1), rows, out.stride(1));
    TORCH_INTERNAL_ASSERT(ok, "grouped_sgemm: an operand BLAS cannot take");
  }
  return true;
}

// The expert GEMMs (forms in moe_plugin/ops/grouped.py): fp32 straight into BLAS (grouped_sgemm), else torch's
// own CPU grouped-mm kernel, the one F.grouped_mm runs on CPU; both write into a pooled output instead of fresh
// memory. Rows past the last offset are left to the caller; groups with no rows get zero weight gradients.
Tensor grouped_mm(const Tensor& a, const Tensor& b, const Tensor& offs_E) {
  at::native::_grouped_mm_validate_inputs(a, b, offs_E, std::nullopt, std::nullopt);
  TORCH_CHECK(a.dim() == 2 && offs_E.dim() == 1, "grouped_mm takes a 2-d a and 1-d offsets");
  const bool rows_form = b.dim() == 3;
  Tensor out = rows_form ? pooled_empty({a.size(0), b.size(2)}, a.options())
                         : pooled_empty({offs_E.size(0), a.size(0), b.size(1)}, a.options());
  if (!grouped_sgemm(a, b, offs_E, out)) {
    at::native::_grouped_mm_fallback(a, b, offs_E, std::nullopt, std::nullopt, out);
  }
  if (!rows_form) {
    const Tensor offs = offs_E.to(at::kLong);
    const int64_t* end = offs.data_ptr<int64_t>();
    for (int64_t e = 0, start = 0; e < offs.size(0); start = end[e], ++e) {
      if (end[e] == start) out[e].zero_();
    }
  }
  return out;
}

// The fused routing's CPU plan (moe_plugin/ops/torch_route.py: the same as its torch ops), fp32, from torch's own
// softmax probabilities [T, E] and top-k (gate_TK, expert_TK: best first), so the choices are the reference's bit for
// bit: the gates normalized before dropping when normalize == 1, loads, slots in visiting order (choice-major, tokens
// in order) below cap, the final gates (zeroed where dropped, renormalized when normalize == 2, times scale), and
// the balance loss (aux_kind 1 counts first choices, 2 all, 0 none) times aux_scale. Returns (final_TK, aux, pos_TK,
// kept_TK, load_E, kept_E, offs_E int32, gate_TK normalized, aux_grad_E).
std::vector<Tensor> route_plan(const Tensor& probs_in, const Tensor& gate_in, const Tensor& expert_in, int64_t normalize,
                               int64_t cap, int64_t aux_kind, double aux_scale, double scale) {
  TORCH_CHECK(probs_in.dim() == 2 && probs_in.scalar_type() == at::kFloat && gate_in.scalar_type() == at::kFloat &&
              expert_in.scalar_type() == at::kLong && gate_in.sizes() == expert_in.sizes() &&
              gate_in.size(0) == probs_in.size(0), "route_plan takes fp32 probs [T, E], fp32 gates and int64 experts [T, K]");
  const Tensor probs = probs_in.contiguous(), expert = expert_in.contiguous();
  const int64_t T = probs.size(0), E = probs.size(1), K = expert.size(1);
  auto f32 = probs.options(), i64 = probs.options().dtype(at::kLong);
  Tensor gate = gate_in.contiguous().clone(), pos = at::empty({T, K}, i64), final_gate = at::empty({T, K}, f32);
  Tensor kept_tk = at::empty({T, K}, probs.options().dtype(at::kBool));
  Tensor load = at::zeros({E}, i64), kept = at::empty({E}, i64), offs = at::empty({E}, probs.options().dtype(at::kInt));
  Tensor aux_grad = at::empty({E}, f32), aux = at::empty({}, f32);
  const float* p = probs.const_data_ptr<float>();
  const int64_t* ex = expert.const_data_ptr<int64_t>();
  float* g = gate.data_ptr<float>();
  int64_t* ld = load.data_ptr<int64_t>();
  std::vector<int64_t> counted(E, 0);
  for (int64_t t = 0; t < T; ++t) {
    float chosen_sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = ex[t * K + k];
      TORCH_CHECK(e >= 0 && e < E, "route_plan: an expert index outside [0, ", E, ")");
      chosen_sum += g[t * K + k];
      ++ld[e];
      if (aux_kind == 2 || (aux_kind == 1 && k == 0)) ++counted[e];
    }
    if (normalize == 1) {
      const float denom = std::max(chosen_sum, std::numeric_limits<float>::min());
      for (int64_t k = 0; k < K; ++k) g[t * K + k] /= denom;
    }
  }
  int64_t* kp = kept.data_ptr<int64_t>();
  int32_t* of = offs.data_ptr<int32_t>();
  std::vector<int64_t> start(E), taken(E, 0);
  for (int64_t e = 0, end = 0; e < E; ++e) {
    kp[e] = std::min(ld[e], cap);
    start[e] = end;
    end += kp[e];
    of[e] = static_cast<int32_t>(end);
  }
  int64_t* ps = pos.data_ptr<int64_t>();
  bool* kt = kept_tk.data_ptr<bool>();
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t e = ex[t * K + k], slot = taken[e]++;
      ps[t * K + k] = slot < cap ? start[e] + slot : -1;
      kt[t * K + k] = slot < cap;
    }
  }
  float* fg = final_gate.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    float kept_sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) kept_sum += (fg[t * K + k] = kt[t * K + k] ? g[t * K + k] : 0.0f);
    const float denom = normalize == 2 ? std::max(kept_sum, std::numeric_limits<float>::epsilon()) : 1.0f;
    for (int64_t k = 0; k < K; ++k) {
      if (normalize == 2) fg[t * K + k] /= denom;
      if (scale != 1.0) fg[t * K + k] *= static_cast<float>(scale);
    }
  }
  float* ag = aux_grad.data_ptr<float>();
  double loss = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    ag[e] = static_cast<float>(counted[e] * aux_scale);
    if (aux_kind == 0 || counted[e] == 0) continue;
    double psum = 0.0;
    for (int64_t t = 0; t < T; ++t) psum += p[t * E + e];
    loss += psum * ag[e];
  }
  aux.fill_(loss);
  return {final_gate, aux, pos, kept_tk, load, kept, offs, gate, aux_grad};
}

// The logits' gradient [T, E] (fp32) of the fused routing (torch_route.route) from its final gates' gradient and its loss's (either may
// be undefined: 0): see triton_route.py's backward kernel.
Tensor route_backward(const std::optional<Tensor>& grad_final_in, const std::optional<Tensor>& grad_aux_in,
                      const Tensor& expert_in, const Tensor& gate_in, const Tensor& pos_in, const Tensor& probs_in,
                      const Tensor& lse_in, const Tensor& aux_grad_in, int64_t normalize, double scale, double z_scale) {
  const Tensor expert = expert_in.contiguous(), gate = gate_in.contiguous(), pos = pos_in.contiguous();
  const Tensor probs = probs_in.contiguous(), aux_grad = aux_grad_in.contiguous();
  const int64_t T = probs.size(0), E = probs.size(1), K = expert.size(1);
  Tensor grad = at::zeros({T, E}, probs.options());
  float* gr = grad.data_ptr<float>();
  const float* p = probs.const_data_ptr<float>();
  const int64_t* ex = expert.const_data_ptr<int64_t>();
  const int64_t* ps = pos.const_data_ptr<int64_t>();
  const float* g = gate.const_data_ptr<float>();
  if (grad_final_in.has_value() && grad_final_in->defined()) {
    const Tensor grad_final = grad_final_in->to(at::kFloat).contiguous();
    const float* up = grad_final.const_data_ptr<float>();
    std::vector<float> a(K), h(K), pk(K);
    for (int64_t t = 0; t < T; ++t) {
      float total = 0.0f, inner = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const bool kept = ps[t * K + k] >= 0;
        a[k] = up[t * K + k] * static_cast<float>(scale);
        h[k] = kept ? g[t * K + k] : 0.0f;
        total += h[k];
        inner += a[k] * h[k];
      }
      const float eps = std::numeric_limits<float>::epsilon();
      const float n = std::max(total, eps);
      for (int64_t k = 0; k < K; ++k) {
        const bool kept = ps[t * K + k] >= 0;
        float d = normalize == 2 ? a[k] / n - (total > eps ? inner / (n * n) : 0.0f) : a[k];
        a[k] = kept ? d : 0.0f;
      }
      if (normalize == 1) {
        float s = 0.0f, ap = 0.0f;
        for (int64_t k = 0; k < K; ++k) s += (pk[k] = p[t * E + ex[t * K + k]]);
        s = std::max(s, std::numeric_limits<float>::min());
        for (int64_t k = 0; k < K; ++k) ap += a[k] * pk[k];
        for (int64_t k = 0; k < K; ++k) a[k] = a[k] / s - ap / (s * s);
      }
      for (int64_t k = 0; k < K; ++k) gr[t * E + ex[t * K + k]] += a[k];
    }
  }
  const bool has_aux = grad_aux_in.has_value() && grad_aux_in->defined();
  const float grad_aux = has_aux ? grad_aux_in->to(at::kFloat).item<float>() : 0.0f;
  const float* ag = aux_grad.const_data_ptr<float>();
  const float* z = lse_in.numel() ? lse_in.contiguous().const_data_ptr<float>() : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    float* row = gr + t * E;
    const float* pt = p + t * E;
    float dot = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
      if (has_aux) row[e] += grad_aux * ag[e];
      dot += pt[e] * row[e];
    }
    const float zterm = has_aux && z != nullptr && z_scale != 0.0 ? grad_aux * static_cast<float>(2 * z_scale) * z[t] : 0.0f;
    for (int64_t e = 0; e < E; ++e) row[e] = pt[e] * (row[e] - dot) + zterm * pt[e];
  }
  return grad;
}

// SwiGLU forward: pre [R, 2H] = [gate | up] -> act [R, H] (swiglu_cpu.h)
Tensor swiglu_forward(const Tensor& pre_in) {
  TORCH_CHECK(pre_in.dim() == 2 && pre_in.size(1) % 2 == 0, "pre must be [rows, 2 * hidden], got ", pre_in.sizes());
  const Tensor pre = pre_in.contiguous();
  const int64_t R = pre.size(0), H = pre.size(1) / 2;
  Tensor act = pooled_empty({R, H}, pre.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pre.scalar_type(), "swiglu_forward", [&] {
    const scalar_t* pre_p = pre.data_ptr<scalar_t>();
    scalar_t* act_p = act.data_ptr<scalar_t>();
    at::parallel_for(0, R, grain_for(2 * H * pre.element_size()), [&](int64_t begin, int64_t end) {
      swiglu::forward_rows(pre_p, act_p, H, begin, end);
    });
  });
  return act;
}

// SwiGLU backward: grad_act [R, H], pre [R, 2H] -> (grad_pre [R, 2H], act [R, H])
std::tuple<Tensor, Tensor> swiglu_backward(const Tensor& grad_act_in, const Tensor& pre_in) {
  TORCH_CHECK(pre_in.dim() == 2 && pre_in.size(1) % 2 == 0, "pre must be [rows, 2 * hidden], got ", pre_in.sizes());
  const Tensor pre = pre_in.contiguous(), grad_act = grad_act_in.contiguous();
  const int64_t R = pre.size(0), H = pre.size(1) / 2;
  check_rows("grad_act", grad_act, R, H, pre.scalar_type());
  Tensor grad_pre = pooled_empty({R, 2 * H}, pre.options()), act = pooled_empty({R, H}, pre.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pre.scalar_type(), "swiglu_backward", [&] {
    const scalar_t* pre_p = pre.data_ptr<scalar_t>();
    const scalar_t* grad_act_p = grad_act.data_ptr<scalar_t>();
    scalar_t* act_p = act.data_ptr<scalar_t>();
    scalar_t* grad_pre_p = grad_pre.data_ptr<scalar_t>();
    at::parallel_for(0, R, grain_for(3 * H * pre.element_size()), [&](int64_t begin, int64_t end) {
      swiglu::backward_rows(pre_p, grad_act_p, act_p, grad_pre_p, H, begin, end);
    });
  });
  return {grad_pre, act};
}

// Clamped SwiGLU forward (swiglu_cpu.h): pre [R, 2H] -> act [R, H]
Tensor clamped_swiglu_forward(const Tensor& pre_in, double limit, double alpha, double beta) {
  TORCH_CHECK(pre_in.dim() == 2 && pre_in.size(1) % 2 == 0, "pre must be [rows, 2 * hidden], got ", pre_in.sizes());
  const Tensor pre = pre_in.contiguous();
  const int64_t R = pre.size(0), H = pre.size(1) / 2;
  const swiglu::Clamp c{limit, alpha, beta};
  Tensor act = pooled_empty({R, H}, pre.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pre.scalar_type(), "clamped_swiglu_forward", [&] {
    const scalar_t* pre_p = pre.data_ptr<scalar_t>();
    scalar_t* act_p = act.data_ptr<scalar_t>();
    at::parallel_for(0, R, grain_for(2 * H * pre.element_size()), [&](int64_t begin, int64_t end) {
      swiglu::forward_rows_clamped(pre_p, act_p, H, begin, end, c);
    });
  });
  return act;
}

// Clamped SwiGLU backward: grad_act [R, H], pre [R, 2H] -> (grad_pre [R, 2H], act [R, H])
std::tuple<Tensor, Tensor> clamped_swiglu_backward(const Tensor& grad_act_in, const Tensor& pre_in, double limit,
                                                   double alpha, double beta) {
  TORCH_CHECK(pre_in.dim() == 2 && pre_in.size(1) % 2 == 0, "pre must be [rows, 2 * hidden], got ", pre_in.sizes());
  const Tensor pre = pre_in.contiguous(), grad_act = grad_act_in.contiguous();
  const int64_t R = pre.size(0), H = pre.size(1) / 2;
  check_rows("grad_act", grad_act, R, H, pre.scalar_type());
  const swiglu::Clamp c{limit, alpha, beta};
  Tensor grad_pre = pooled_empty({R, 2 * H}, pre.options()), act = pooled_empty({R, H}, pre.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pre.scalar_type(), "clamped_swiglu_backward", [&] {
    const scalar_t* pre_p = pre.data_ptr<scalar_t>();
    const scalar_t* grad_act_p = grad_act.data_ptr<scalar_t>();
    scalar_t* act_p = act.data_ptr<scalar_t>();
    scalar_t* grad_pre_p = grad_pre.data_ptr<scalar_t>();
    at::parallel_for(0, R, grain_for(3 * H * pre.element_size()), [&](int64_t begin, int64_t end) {
      swiglu::backward_rows_clamped(pre_p, grad_act_p, act_p, grad_pre_p, H, begin, end, c);
    });
  });
  return {grad_pre, act};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("route_slots", &route_slots, "slots and routed rows of every choice (see moe_plugin/ops/torch_ops.py)");
  m.def("scatter_rows", &scatter_rows, "token rows to routed rows, optionally scaled, with optional dots");
  m.def("empty", [](std::vector<int64_t> sizes, at::ScalarType dtype) {
    return pooled_empty(sizes, at::TensorOptions().dtype(dtype));
  }, "an uninitialized CPU tensor, from the block pool when large");
  m.def("pool_stats", [] { return BlockPool::instance().stats(); }, "(free bytes, free blocks, limit bytes)");
  m.def("poison_outputs", [](bool on) { BlockPool::instance().set_poison(on); },
        "fill every output with NaN / INT64_MIN before the kernel writes it (for tests)");
  m.def("pool_clear", [] { BlockPool::instance().clear(); }, "free every pooled block");
  m.def("gather_sum", &gather_sum, "routed rows to tokens, weighted sum over top-k, with optional dots");
  m.def("swiglu_forward", &swiglu_forward, "silu(gate) * up of rows [gate | up], in one pass");
  m.def("swiglu_backward", &swiglu_backward, "(grad_pre, act) from grad_act and pre, in one pass");
  m.def("clamped_swiglu_forward", &clamped_swiglu_forward,
        "(clamp(up, -L, L) + beta) * g * sigmoid(alpha g), g = min(gate, L), of rows [gate | up], in one pass");
  m.def("clamped_swiglu_backward", &clamped_swiglu_backward, "(grad_pre, act) of the clamped form, in one pass");
  m.def("route_plan", &route_plan, "the fused routing's CPU plan from torch's softmax and top-k (see moe_plugin/ops/torch_route.py)");
  m.def("route_backward", &route_backward, "the logits' gradient of the fused routing (see moe_plugin/ops/torch_route.py)");
  m.def("has_blas_sgemm", [] { return blas_sgemm() != nullptr; }, "whether fp32 grouped GEMMs call BLAS directly");
  m.def("grouped_mm", &grouped_mm, "torch's CPU grouped GEMM into a pooled output (see moe_plugin/ops/grouped.py)");
  m.def("swiglu_backward_", &swiglu::swiglu_backward_, "swiglu_backward in place (swiglu_cpu.h)");
  m.def("clamped_swiglu_backward_", &swiglu::clamped_swiglu_backward_, "clamped_swiglu_backward in place");
}
