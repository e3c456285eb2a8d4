// Fused CPU kernels for TSSA and causal TSSA (ToST, Wu et al., ICLR 2025, Eqs. (11), (28),
// memberships Eqs. (32)-(34) and (39)), forward and hand-derived backward. The equations and
// the derivation of the backward are in whiteformer/ops/tssa_fused.py.
//
// Layout: w is (B, H, N, p) with a contiguous feature axis and arbitrary strides for b, h, n
// (so the (B, N, H, p) view a layer gets from its projection needs no copy). Work is split over
// (batch, chunk of tokens); an item handles all heads of its tokens, because the membership
// softmax couples the heads at each token. Sums over tokens are accumulated in T over blocks of
// BLK tokens, then in double per chunk, and reduced in chunk order: results do not depend on the
// number of threads. p in {32, 48, 64} is a compile-time constant (feature loops unrolled,
// accumulators in registers); other p use the generic instantiation. Large outputs are written
// with non-temporal stores (no read-for-ownership; the input stays cached for the next pass).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <unistd.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <string_view>
#include <type_traits>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t DEFAULT_CHUNK = 256;  // tokens per work item (and per causal checkpoint)
constexpr int BLK = 16;                 // tokens summed in T before adding to a double total
// The epsilons come from whiteformer/ops/constants.py, passed as -D flags by _kernels/build.py.
constexpr double NORM_EPS2 = double(WF_NORM_EPS) * double(WF_NORM_EPS);  // F.normalize eps, squared
constexpr double PI_EPS = WF_PI_EPS;        // added to the membership mass
constexpr double RATIO_EPS = WF_RATIO_EPS;  // clamp of the causal prefix energy
constexpr double SAFE_MAX2 = double(WF_SAFE_MAX) * double(WF_SAFE_MAX);  // largest sum of squares taken

// ------------------------------------------------------------------ exp for x <= 0 (vectorisable)
// exp(x) = 2^k exp(r), k = round(x / ln 2), |r| <= ln2 / 2; 2^k is built from the bits of the
// "shifter" sum, exp(r) is a Taylor polynomial (relative error < 1e-7 in float, 3e-16 in double).
template <typename T> struct ExpC;
template <> struct ExpC<float> {
  using U = uint32_t;
  static constexpr float lo = -87.0f, log2e = 1.44269504088896341f;
  static constexpr float shifter = 12582912.0f + 127.0f;  // 1.5 * 2^23 + exponent bias
  static constexpr float ln2hi = 0.693145751953125f, ln2lo = 1.428606765330187045e-06f;
  static constexpr int mbits = 23;
};
template <> struct ExpC<double> {
  using U = uint64_t;
  static constexpr double lo = -708.0, log2e = 1.4426950408889634074;
  static constexpr double shifter = 6755399441055744.0 + 1023.0;  // 1.5 * 2^52 + exponent bias
  static constexpr double ln2hi = 6.93147180369123816490e-01, ln2lo = 1.90821492927058770002e-10;
  static constexpr int mbits = 52;
};

inline float exp_poly(float r) {
  constexpr float c2 = 1.f / 2, c3 = 1.f / 6, c4 = 1.f / 24, c5 = 1.f / 120, c6 = 1.f / 720, c7 = 1.f / 5040;
  return 1.f + r * (1.f + r * (c2 + r * (c3 + r * (c4 + r * (c5 + r * (c6 + r * c7))))));
}
inline double exp_poly(double r) {
  constexpr double c2 = 1. / 2, c3 = 1. / 6, c4 = 1. / 24, c5 = 1. / 120, c6 = 1. / 720, c7 = 1. / 5040,
                   c8 = 1. / 40320, c9 = 1. / 362880, c10 = 1. / 3628800, c11 = 1. / 39916800,
                   c12 = 1. / 479001600, c13 = 1. / 6227020800.;
  const double hi = c7 + r * (c8 + r * (c9 + r * (c10 + r * (c11 + r * (c12 + r * c13)))));
  return 1. + r * (1. + r * (c2 + r * (c3 + r * (c4 + r * (c5 + r * (c6 + r * hi))))));
}

template <typename T>
inline T exp_nonpos(T x) {
  using C = ExpC<T>;
  using U = typename C::U;
  x = x < C::lo ? C::lo : x;
  const T t = x * C::log2e + C::shifter;
  const T k = t - C::shifter;
  const T r = (x - k * C::ln2hi) - k * C::ln2lo;
  const U bits = __builtin_bit_cast(U, t) << C::mbits;
  return exp_poly(r) * __builtin_bit_cast(T, bits);
}

// softmax over heads, in place: lg[h * ld + i] for h < H, i < cnt; tmp holds cnt values
template <typename T>
inline void softmax_heads(T* __restrict lg, int64_t H, int64_t ld, int64_t cnt, T* __restrict tmp) {
  for (int64_t i = 0; i < cnt; ++i) tmp[i] = lg[i];
  for (int64_t h = 1; h < H; ++h) {
    const T* row = lg + h * ld;
    for (int64_t i = 0; i < cnt; ++i) tmp[i] = row[i] > tmp[i] ? row[i] : tmp[i];
  }
  for (int64_t h = 0; h < H; ++h) {
    T* row = lg + h * ld;
#pragma omp simd
    for (int64_t i = 0; i < cnt; ++i) row[i] = exp_nonpos<T>(row[i] - tmp[i]);
  }
  for (int64_t i = 0; i < cnt; ++i) tmp[i] = lg[i];
  for (int64_t h = 1; h < H; ++h) {
    const T* row = lg + h * ld;
    for (int64_t i = 0; i < cnt; ++i) tmp[i] += row[i];
  }
  for (int64_t i = 0; i < cnt; ++i) tmp[i] = T(1) / tmp[i];
  for (int64_t h = 0; h < H; ++h) {
    T* row = lg + h * ld;
    for (int64_t i = 0; i < cnt; ++i) row[i] *= tmp[i];
  }
}

// ------------------------------------------------------------------ profiler ranges
// Names each pass of a kernel in torch.profiler's trace (what benchmarks/op_floor.py reports for
// a call that misses its target); next(name) ends the previous range. A no-op (one thread-local
// check) unless a profiler is recording.
class Phases {
  std::optional<at::RecordFunction> rf_;

 public:
  void next(const char* name) {
    rf_.reset();
    rf_.emplace(at::RecordScope::USER_SCOPE);
    rf_->before(std::string_view(name), c10::ArrayRef<const c10::IValue>{});
  }
};

// ------------------------------------------------------------------ tensor helpers
// (B, H, N, p) tensor with a contiguous feature axis
template <typename T>
struct Rows {
  T* ptr;
  int64_t sb, sh, sn;
  inline T* row(int64_t b, int64_t h, int64_t n) const { return ptr + b * sb + h * sh + n * sn; }
};

template <typename T>
Rows<T> rows_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, name, " must be 4-D (B, H, N, p)");
  TORCH_CHECK(t.size(3) == 1 || t.stride(3) == 1, name, " must have a contiguous last dimension");
  return {static_cast<T*>(t.data_ptr()), t.stride(0), t.stride(1), t.stride(2)};
}

void check_common(const at::Tensor& w, const at::Tensor& temp, const c10::optional<at::Tensor>& mask) {
  TORCH_CHECK(w.device().is_cpu(), "tssa_cpu: w must be a CPU tensor");
  TORCH_CHECK(w.dim() == 4, "tssa_cpu: w must be 4-D (B, H, N, p)");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kDouble,
              "tssa_cpu: w must be float32 or float64");
  TORCH_CHECK(temp.is_contiguous() && temp.numel() == w.size(1) && temp.scalar_type() == w.scalar_type(),
              "tssa_cpu: temp must be a contiguous (H,) / (H, 1) tensor of w's dtype");
  if (mask.has_value()) {
    const auto& m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.is_contiguous() && m.dim() == 2 && m.size(0) == w.size(0) &&
                    m.size(1) == w.size(2),
                "tssa_cpu: mask must be a contiguous (B, N) bool tensor");
  }
}

void check_like(const at::Tensor& t, const at::Tensor& w, const char* name) {
  TORCH_CHECK(t.sizes() == w.sizes() && t.scalar_type() == w.scalar_type(), "tssa_cpu: ", name,
              " must have w's shape and dtype");
}

void check_small(const at::Tensor& t, at::IntArrayRef shape, at::ScalarType dt, const char* name) {
  TORCH_CHECK(t.is_contiguous() && t.sizes() == shape && t.scalar_type() == dt, "tssa_cpu: ", name,
              " must be contiguous with shape ", shape, " and dtype ", dt);
}

const bool* mask_ptr(const c10::optional<at::Tensor>& mask) {
  return mask.has_value() ? mask->data_ptr<bool>() : nullptr;
}

inline int64_t nchunks(int64_t N, int64_t chunk) { return (N + chunk - 1) / chunk; }
inline int64_t pick_chunk(int64_t chunk) { return chunk > 0 ? chunk : DEFAULT_CHUNK; }

// dst[b * len + k] = sum over chunks c (in order) of part[(b * nc + c) * len + k], for the batch
// rows b in [b0, b1)
void reduce_chunks(const std::vector<double>& part, double* dst, int64_t b0, int64_t b1, int64_t nc, int64_t len) {
  for (int64_t b = b0; b < b1; ++b) {
    double* d = dst + b * len;
    std::fill(d, d + len, 0.0);
    for (int64_t c = 0; c < nc; ++c) {
      const double* s = part.data() + (b * nc + c) * len;
      for (int64_t k = 0; k < len; ++k) d[k] += s[k];
    }
  }
}
void reduce_chunks(const std::vector<double>& part, double* dst, int64_t B, int64_t nc, int64_t len) {
  reduce_chunks(part, dst, 0, B, nc, len);
}

// (B,) bool: whether one of the HP sums of squares of batch row b (at s + b * stride) exceeds
// SAFE_MAX^2 or is not finite. The row may then hold some |w| > SAFE_MAX (its feature's sum is at
// least its square), past the range the kernels square unscaled, and the caller runs the rescaled
// PyTorch path on it (whiteformer/ops/scaling.py). The sums are ones the kernels form anyway: the
// check adds no pass over w.
at::Tensor rows_past_range(const double* s, int64_t B, int64_t HP, int64_t stride, const at::Tensor& like) {
  auto flags = at::empty({B}, like.options().dtype(at::kBool));
  bool* f = flags.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {
    bool over = false;
    for (int64_t k = 0; k < HP; ++k) over |= !(s[b * stride + k] <= SAFE_MAX2);
    f[b] = over;
  }
  return flags;
}

// feature-sized scratch: a fixed aligned array when p is a compile-time constant (kept in
// registers), else a heap buffer
template <typename T, int PC>
struct Buf {
  alignas(64) T v[PC];
  explicit Buf(int64_t) {}
  T* data() { return v; }
};
template <typename T>
struct Buf<T, 0> {
  std::vector<T> v;
  explicit Buf(int64_t P) : v(P) {}
  T* data() { return v.data(); }
};

// sum of v[0:P) (a vectorised reduction; measured faster than an explicit pairwise tree)
template <typename T, int PC>
inline T row_sum(const T* __restrict v, int64_t P) {
  T s = T(0);
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < (PC > 0 ? PC : P); ++j) s += v[j];
  return s;
}

// ------------------------------------------------------------------ output rows
int64_t l3_bytes() {
  static const int64_t v = [] {
    long s = -1;
#ifdef _SC_LEVEL3_CACHE_SIZE
    s = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
    // the reported size may be the whole host's; a process rarely gets more than 32 MB
    return std::min<int64_t>(s > 0 ? int64_t(s) : int64_t(32) << 20, int64_t(32) << 20);
  }();
  return v;
}

// outputs of at least this many bytes are written with non-temporal stores (default: half the
// last-level cache; set_stream_min_bytes changes it, e.g. to measure either way)
std::atomic<int64_t> stream_min{-1};
int64_t stream_min_bytes() {
  const int64_t v = stream_min.load(std::memory_order_relaxed);
  return v >= 0 ? v : l3_bytes() / 2;
}

// whether the pages of [p, p + bytes) are in memory already (sampled: the first, middle and last
// page). A fresh block (glibc maps one above its mmap threshold, 32 MB at most) faults each page
// in on first touch: the kernel zeroes it through the cache, so a non-temporal store to it writes
// the line twice. Measured (B 4, N 16k, 100 MB): the forward 1.9x -> 1.4x a clone with plain
// stores, while a reused block (B 1, 25 MB) stays faster with non-temporal ones.
bool resident(const void* p, int64_t bytes) {
#if defined(__linux__)
  const int64_t page = sysconf(_SC_PAGESIZE);
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p) / page * page;
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + bytes - 1) / page * page;
  for (const uintptr_t a : {lo, lo + (hi - lo) / 2 / page * page, hi}) {
    unsigned char in = 0;
    if (mincore(reinterpret_cast<void*>(a), page, &in) != 0 || !(in & 1)) return false;
  }
#else
  (void)p;
  (void)bytes;
#endif
  return true;
}

// Transparent huge pages for the 2 MB-aligned interior of a fresh block (one fault per 2 MB
// instead of per 4 KB page; the kernel honours it where THP is "always" or "madvise"). Measured
// on a 100 MB block: first touch 224 -> 110 ms, against 89 ms for a block already in memory.
void advise_huge_pages(const void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t huge = uintptr_t(2) << 20, a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lo = (a + huge - 1) / huge * huge, hi = (a + bytes) / huge * huge;
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

// Prepares a large output (w-sized, before its first write) and says whether to write it with
// non-temporal stores: a fresh block (pages not yet in memory, see resident) of 8 MB or more gets
// huge pages and plain stores; a block in memory already gets non-temporal stores when it is
// larger than half the last-level cache (stream_min_bytes) and its rows are 32-byte aligned (p a
// compile-time constant with p * sizeof(T) % 32 == 0)
template <typename T, int PC>
bool want_stream(const at::Tensor& out) {
  const int64_t bytes = out.numel() * int64_t(sizeof(T));
  const bool fresh = bytes >= (int64_t(8) << 20) && !resident(out.data_ptr(), bytes);
  if (fresh) advise_huge_pages(out.data_ptr(), bytes);
#if defined(__AVX__)
  if (fresh || PC == 0 || (PC * sizeof(T)) % 32 != 0 || bytes < stream_min_bytes()) return false;
  if (reinterpret_cast<uintptr_t>(out.data_ptr()) % 32 != 0) return false;
  for (int d = 0; d < 3; ++d)
    if ((out.stride(d) * int64_t(sizeof(T))) % 32 != 0) return false;
  return resident(out.data_ptr(), bytes);
#else
  return false;
#endif
}

template <typename T, int PC>
struct RowWriter {
  bool stream;
  Buf<T, PC> buf;
  RowWriter(bool s, int64_t P) : stream(s), buf(P) {}
  // y[j] = f(j) for j < P (f is called once per j, in order)
  template <typename F>
  inline void put(T* __restrict y, int64_t P, F f) {
#if defined(__AVX__)
    if (PC > 0 && stream) {
      T* r = buf.data();
#pragma omp simd
      for (int64_t j = 0; j < P; ++j) r[j] = f(j);
      if constexpr (std::is_same_v<T, float>) {
        for (int64_t j = 0; j < P; j += 8) _mm256_stream_ps(y + j, _mm256_load_ps(r + j));
      } else {
        for (int64_t j = 0; j < P; j += 4) _mm256_stream_pd(y + j, _mm256_load_pd(r + j));
      }
      return;
    }
#endif
#pragma omp simd
    for (int64_t j = 0; j < P; ++j) y[j] = f(j);
  }
  void zero(T* y, int64_t P) {
    put(y, P, [](int64_t) { return T(0); });
  }
  ~RowWriter() {
#if defined(__AVX__)
    if (stream) _mm_sfence();
#endif
  }
};

// calls fn(std::integral_constant<int, PC>) with PC = P for the specialised sizes, else 0
template <typename Fn>
void with_p(int64_t P, Fn&& fn) {
  switch (P) {
    case 32: fn(std::integral_constant<int, 32>{}); break;
    case 48: fn(std::integral_constant<int, 48>{}); break;
    case 64: fn(std::integral_constant<int, 64>{}); break;
    default: fn(std::integral_constant<int, 0>{}); break;
  }
}

// Software prefetch of the row about 8 KB ahead in the same head: the hardware prefetcher alone
// leaves the passes well below the memory bandwidth (measured: forward 4.0 -> 2.8 ms).
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
}
inline int64_t prefetch_distance(int64_t row_bytes) { return std::max<int64_t>(8, 8192 / std::max<int64_t>(row_bytes, 1)); }
#define PREFETCH_ROW(R, b, h, n) prefetch_row((R).row(b, h, std::min(n + PFD, N - 1)), RB)

// Float rows of 32 / 48 / 64 features with AVX-512: the running sums are held in PC / 16
// registers and each division a / b is a reciprocal estimate r (vrcp14ps, relative error
// < 2^-14) refined by one Newton step folded into the product, a / b ~ (a r) (2 - b r) (error
// ~2^-28 before rounding, i.e. ~1 ulp in float), much cheaper than vdivps; the per-token sums
// of rho are reduced 16 tokens at a time (hsum16). Double and the other builds (and other p)
// keep the exact divisions of the generic code below.
#if defined(__AVX512F__)
template <typename T, int PC>
constexpr bool kFastRows = std::is_same_v<T, float> && PC > 0 && PC % 16 == 0;
inline void store_row16(float* y, __m512 v, bool stream) {
  if (stream) {  // rows are 32-byte aligned (want_stream)
    _mm256_stream_ps(y, _mm512_castps512_ps256(v));
    _mm256_stream_ps(y + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  } else {
    _mm512_storeu_ps(y, v);
  }
}
// float(d[0:16)) in one vector (AVX-512F only)
inline __m512 cvt16_ps(const double* d) {
  const __m256 lo = _mm512_cvtpd_ps(_mm512_loadu_pd(d)), hi = _mm512_cvtpd_ps(_mm512_loadu_pd(d + 8));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
// d[0:16) (double) of the 16 floats of v
inline void cvt16_pd(__m512 v, __m512d* d) {
  d[0] = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  d[1] = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
// d[0:16) += the lanes of v (a block's float sums folded into the double running totals), in two
// double vector additions
inline void add16_to(double* d, __m512 v) {
  __m512d e[2];
  cvt16_pd(v, e);
  _mm512_storeu_pd(d, _mm512_add_pd(_mm512_loadu_pd(d), e[0]));
  _mm512_storeu_pd(d + 8, _mm512_add_pd(_mm512_loadu_pd(d + 8), e[1]));
}
// block_begin / block_end for K vectors of 16 floats
template <int K>
inline void block_begin16(const double* tot, __m512* bs, __m512* lc) {
  for (int k = 0; k < K; ++k) {
    bs[k] = cvt16_ps(tot + 16 * k);
    lc[k] = _mm512_setzero_ps();
  }
}
template <int K>
inline void block_end16(double* tot, const __m512* lc) {
  for (int k = 0; k < K; ++k) add16_to(tot + 16 * k, lc[k]);
}
// the kept tokens among [nb, nb + cnt) (cnt <= 16) of batch row b, bit i for token nb + i, as the two
// 8-lane masks of a pair of double vectors (mk: the (B, N) keep-mask, or nullptr: all kept)
inline void kept_halves16(const bool* mk, int64_t N, int64_t b, int64_t nb, int64_t cnt, __mmask8* kb) {
  __mmask16 keep = __mmask16((1u << cnt) - 1u);
  if (mk)
    for (int64_t i = 0; i < cnt; ++i)
      if (!mk[b * N + nb + i]) keep = __mmask16(keep & ~(1u << i));
  kb[0] = __mmask8(keep & 0xFF);
  kb[1] = __mmask8(keep >> 8);
}
// lane i of the result = sum of the lanes of s[4 (i % 4) + i / 4] (a 16 x 16 transpose-and-add)
inline __m512 hsum16(const __m512* s) {
  __m512 u[8], v[4], x[2];
  for (int i = 0; i < 8; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#else
template <typename T, int PC>
constexpr bool kFastRows = false;
#endif

// ================================================================== non-causal TSSA
// Statistics per (b, h) (double): s_j = sum_n w_nj^2, T_j = sum_n Pi_n w_nj^2, M = sum_n Pi_n.
// Derived: r_j = 1 / max(s_j, eps^2), c = 1 / (M + 1e-8), d_j = c T_j, g_j = 1 / (1 + d_j).

inline double inv_energy(double s) { return 1.0 / std::max(s, NORM_EPS2); }

template <typename T>
struct Dims {
  int64_t B, H, N, P, CHUNK, nc;
};

// tokens per group: loops visit a group's rows head by head, so the whole chunk for the usual
// (B, H, N, p) layout (long sequential runs per head), BLK tokens when the heads of a token are
// adjacent in memory (the (B, N, H, p) view of a projection)
inline int64_t group_size(int64_t sh, int64_t sn, int64_t chunk) { return sh > sn ? chunk : BLK; }
// The head ranges [h0, h1) that a pass in which nothing couples the heads runs its items under:
// one head at a time when each head's rows are contiguous (by_head: every operand's head stride
// above its token stride), so that the pass reads one long run of rows per operand and head
// instead of a run of one chunk per head in turn, which reads faster once w outgrows the cache;
// else all heads together, a token's rows of all heads being adjacent.
inline std::vector<std::pair<int64_t, int64_t>> head_runs(int64_t H, bool by_head) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  if (!by_head) return {{0, H}};
  for (int64_t h = 0; h < H; ++h) runs.emplace_back(h, h + 1);
  return runs;
}

// Feature energies per work item it = (b, chunk of CHUNK tokens), for the items [lo, hi):
// part[(it * H + h) * P + j] = sum over the chunk's kept tokens of w_nj^2, summed in T over blocks
// of BLK tokens, then in double; rows visited in groups of GRP tokens (group_size), one head at a
// time over all the items where w's heads are contiguous (head_runs)
template <typename T, int PC>
void chunk_energies_items(const Rows<const T>& W, const bool* mk, int64_t lo, int64_t hi, int64_t H, int64_t N,
                          int64_t P_, int64_t CHUNK, int64_t nc, int64_t GRP, double* part) {
  const int64_t P = PC > 0 ? PC : P_, HP = H * P, RB = P * int64_t(sizeof(T)), PFD = prefetch_distance(RB);
  Buf<T, PC> buf(P);
  for (const auto [h0, h1] : head_runs(H, W.sh > W.sn))
  for (int64_t it = lo; it < hi; ++it) {
    const int64_t b = it / nc, n0 = (it % nc) * CHUNK, n1 = std::min(N, n0 + CHUNK);
    double* acc = part + it * HP;
    std::fill(acc + h0 * P, acc + h1 * P, 0.0);
    for (int64_t ng = n0; ng < n1; ng += GRP) {
      const int64_t ge = std::min(n1, ng + GRP);
      for (int64_t h = h0; h < h1; ++h) {
        double* tot = acc + h * P;
        for (int64_t nb = ng; nb < ge; nb += BLK) {
          T* a = buf.data();
          for (int64_t j = 0; j < P; ++j) a[j] = T(0);
          for (int64_t n = nb; n < std::min(ge, nb + BLK); ++n) {
            PREFETCH_ROW(W, b, h, n);
            if (mk && !mk[b * N + n]) continue;
            const T* __restrict x = W.row(b, h, n);
#pragma omp simd
            for (int64_t j = 0; j < P; ++j) a[j] += x[j] * x[j];
          }
          for (int64_t j = 0; j < P; ++j) tot[j] += double(a[j]);
        }
      }
    }
  }
}

// chunk_energies_items over all B * nc items, in parallel
template <typename T, int PC>
void chunk_energies(const Rows<const T>& W, const bool* mk, int64_t B, int64_t H, int64_t N, int64_t P,
                    int64_t CHUNK, int64_t nc, int64_t GRP, double* part) {
  at::parallel_for(0, B * nc, 1, [&](int64_t lo, int64_t hi) {
    chunk_energies_items<T, PC>(W, mk, lo, hi, H, N, P, CHUNK, nc, GRP, part);
  });
}

// One head's tokens [nb, ne) (ne - nb <= BLK): tot[j] += sum over the kept tokens n of c_n w_nj^2
// (Pi_n w_n^2: the moment T / Q; lambda_n w_n^2), summed in T over the block (a: P values of
// scratch), then added to the double totals. coef(n) gives c_n; it is called once per kept token,
// in token order.
template <typename T, typename Coef>
inline void add_weighted_energy(const Rows<const T>& W, const bool* mk, int64_t N, int64_t P, int64_t b,
                                int64_t h, int64_t nb, int64_t ne, T* a, double* tot, Coef coef) {
  for (int64_t j = 0; j < P; ++j) a[j] = T(0);
  for (int64_t n = nb; n < ne; ++n) {
    if (mk && !mk[b * N + n]) continue;
    const T c = coef(n);
    const T* __restrict x = W.row(b, h, n);
#pragma omp simd
    for (int64_t j = 0; j < P; ++j) a[j] += c * x[j] * x[j];
  }
  for (int64_t j = 0; j < P; ++j) tot[j] += double(a[j]);
}

#if defined(__AVX512F__)
// Logits of one head's tokens [ng, ge) for float rows (kFastRows): lg[n - ng] = th sum_j w_nj^2 r_j,
// 0 at padded tokens. Each token's 16 lane sums (one vector) are reduced 16 tokens at a time
// (hsum16) instead of one horizontal sum per token.
template <int PC>
inline void head_logits16(const Rows<const float>& W, const bool* mk, int64_t N, int64_t b, int64_t h, int64_t ng,
                          int64_t ge, const float* rh, float th, float* lg, int64_t PFD) {
  constexpr int K = PC / 16;
  static_assert(BLK == 16, "hsum16 reduces one block of 16 tokens");
  __m512 rv[K];
  for (int k = 0; k < K; ++k) rv[k] = _mm512_loadu_ps(rh + 16 * k);
  const __m512 tv = _mm512_set1_ps(th);
  for (int64_t nb = ng; nb < ge; nb += BLK) {
    const int64_t ne = std::min(ge, nb + BLK);
    __m512 sv[16];
    for (int64_t n = nb; n < ne; ++n) {
      prefetch_row(W.row(b, h, std::min(n + PFD, N - 1)), PC * int64_t(sizeof(float)));
      __m512 acc = _mm512_setzero_ps();
      if (!mk || mk[b * N + n]) {
        const float* __restrict x = W.row(b, h, n);
        for (int k = 0; k < K; ++k) {
          const __m512 xv = _mm512_loadu_ps(x + 16 * k);
          acc = _mm512_fmadd_ps(_mm512_mul_ps(xv, xv), rv[k], acc);
        }
      }
      sv[4 * ((n - nb) % 4) + (n - nb) / 4] = acc;
    }
    for (int64_t i = ne - nb; i < BLK; ++i) sv[4 * (i % 4) + i / 4] = _mm512_setzero_ps();
    _mm512_mask_storeu_ps(lg + (nb - ng), __mmask16((1u << (ne - nb)) - 1u), _mm512_mul_ps(hsum16(sv), tv));
  }
}

// out rows of one head's kept tokens [ng, ge) for float rows (kFastRows): y = (x (-Pi)) g
template <int PC>
inline void head_out16(const Rows<const float>& W, Rows<float> O, const bool* mk, int64_t N, int64_t b, int64_t h,
                       int64_t ng, int64_t ge, const float* pih, const float* g, bool stream, int64_t PFD) {
  constexpr int K = PC / 16;
  __m512 gv[K];
  for (int k = 0; k < K; ++k) gv[k] = _mm512_loadu_ps(g + 16 * k);
  for (int64_t n = ng; n < ge; ++n) {
    float* y = O.row(b, h, n);
    if (mk && !mk[b * N + n]) {
      for (int k = 0; k < K; ++k) store_row16(y + 16 * k, _mm512_setzero_ps(), stream);
      continue;
    }
    prefetch_row(W.row(b, h, std::min(n + PFD, N - 1)), PC * int64_t(sizeof(float)));
    const float* __restrict x = W.row(b, h, n);
    const __m512 pv = _mm512_set1_ps(-pih[n]);
    for (int k = 0; k < K; ++k)
      store_row16(y + 16 * k, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * k), pv), gv[k]), stream);
  }
}
#endif

// The three passes run on work items (b, chunk of CHUNK tokens) and keep one partial sum per item,
// reduced in chunk order: results do not depend on the schedule. Schedules: with at least as many
// batch rows as threads, each thread runs all three passes on one row before the next (the row's
// w, H N p values, is read three times from L2 / L3 rather than from memory once a whole batch
// outgrows the cache); with fewer, each pass runs over all items in parallel. Where a token's rows
// of all heads are adjacent (a layer's (B, N, H, p) view), pass 2 visits the items last to first
// and passes 1 and 3 first to last, so that each pass starts on the tokens the one before ended
// on, still in cache. Where each head's rows are contiguous, passes 1 and 3 go head by head
// (head_runs), so pass 1 ends in the last head alone, and pass 2 goes first to last as well: read
// backwards chunk by chunk, every chunk change broke the run of rows ahead of the prefetch.
template <typename T, int PC>
void tssa_fwd_impl(Rows<const T> W, const T* temp, const bool* mk, Rows<T> O, bool stream, T* pi, double* s,
                   double* Tm, double* M, Dims<T> D) {
  const int64_t B = D.B, H = D.H, N = D.N, P = PC > 0 ? PC : D.P, CHUNK = D.CHUNK, nc = D.nc, HP = H * P;
  auto kept = [&](int64_t b, int64_t n) { return !mk || mk[b * N + n]; };
  const int64_t GRP = group_size(W.sh, W.sn, CHUNK), RB = P * int64_t(sizeof(T)), PFD = prefetch_distance(RB);

  std::vector<double> part(B * nc * HP), partM(B * nc * H);
  std::vector<T> r(B * HP), gain(B * HP);
  // after pass 1 of rows [b0, b1): s and r = 1 / max(s, eps^2)
  auto finish_energies = [&](int64_t b0, int64_t b1) {
    reduce_chunks(part, s, b0, b1, nc, HP);
    for (int64_t k = b0 * HP; k < b1 * HP; ++k) r[k] = T(inv_energy(s[k]));
  };
  // pass 3 head by head (head_runs) where w's and out's heads are contiguous (pass 1: w's; out is
  // allocated like w, so the two agree)
  const bool by_head = W.sh > W.sn && O.sh > O.sn;
  // pass 2 on items [lo, hi): logits, Pi (softmax over heads) and the Pi-weighted moments, first to
  // last where passes 1 and 3 go head by head, else last to first (see above)
  auto moments = [&](int64_t lo, int64_t hi) {
    std::vector<T> lg(H * GRP), tmp(GRP);
    Buf<T, PC> buf(P), vb(P);
    for (int64_t k = lo; k < hi; ++k) {
      const int64_t it = by_head ? k : hi - 1 - (k - lo);
      const int64_t b = it / nc, n0 = (it % nc) * CHUNK, n1 = std::min(N, n0 + CHUNK);
      double* accT = part.data() + it * HP;
      double* accM = partM.data() + it * H;
      std::fill(accT, accT + HP, 0.0);
      std::fill(accM, accM + H, 0.0);
      for (int64_t ng = n0; ng < n1; ng += GRP) {
        const int64_t ge = std::min(n1, ng + GRP);
        for (int64_t h = 0; h < H; ++h) {
          const T* __restrict rh = r.data() + (b * H + h) * P;
          const T th = temp[h];
#if defined(__AVX512F__)
          if constexpr (kFastRows<T, PC>) {
            head_logits16<PC>(W, mk, N, b, h, ng, ge, rh, th, lg.data() + h * GRP, PFD);
            continue;
          }
#endif
          for (int64_t n = ng; n < ge; ++n) {
            T dot = T(0);
            PREFETCH_ROW(W, b, h, n);
            if (kept(b, n)) {
              const T* __restrict x = W.row(b, h, n);
              T* v = vb.data();
#pragma omp simd
              for (int64_t j = 0; j < P; ++j) v[j] = x[j] * x[j] * rh[j];
              dot = row_sum<T, PC>(v, P);
            }
            lg[h * GRP + (n - ng)] = th * dot;
          }
        }
        softmax_heads<T>(lg.data(), H, GRP, ge - ng, tmp.data());
        for (int64_t h = 0; h < H; ++h) {
          T* pih = pi + (b * H + h) * N;
          for (int64_t n = ng; n < ge; ++n) pih[n] = kept(b, n) ? lg[h * GRP + (n - ng)] : T(0);
          double m = 0.0;
          for (int64_t nb = ng; nb < ge; nb += BLK)
            add_weighted_energy(W, mk, N, P, b, h, nb, std::min(ge, nb + BLK), buf.data(), accT + h * P,
                                [&](int64_t n) {
                                  m += double(pih[n]);
                                  return pih[n];
                                });
          accM[h] += m;
        }
      }
    }
  };
  // after pass 2 of rows [b0, b1): T, M and the gains g = 1 / (1 + T / (M + 1e-8))
  auto finish_moments = [&](int64_t b0, int64_t b1) {
    reduce_chunks(part, Tm, b0, b1, nc, HP);
    reduce_chunks(partM, M, b0, b1, nc, H);
    for (int64_t bh = b0 * H; bh < b1 * H; ++bh) {
      const double c = 1.0 / (M[bh] + PI_EPS);
      for (int64_t j = 0; j < P; ++j) gain[bh * P + j] = T(1.0 / (1.0 + c * Tm[bh * P + j]));
    }
  };
  // pass 3 on items [lo, hi): out = -w Pi g
  auto output = [&](int64_t lo, int64_t hi) {
    RowWriter<T, PC> out(stream, P);
    for (const auto [h0, h1] : head_runs(H, by_head))
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t b = it / nc, n0 = (it % nc) * CHUNK, n1 = std::min(N, n0 + CHUNK);
      for (int64_t ng = n0; ng < n1; ng += GRP) {
        const int64_t ge = std::min(n1, ng + GRP);
        for (int64_t h = h0; h < h1; ++h) {
          const T* __restrict g = gain.data() + (b * H + h) * P;
          const T* pih = pi + (b * H + h) * N;
#if defined(__AVX512F__)
          if constexpr (kFastRows<T, PC>) {
            head_out16<PC>(W, O, mk, N, b, h, ng, ge, pih, g, out.stream, PFD);
            continue;
          }
#endif
          for (int64_t n = ng; n < ge; ++n) {
            T* y = O.row(b, h, n);
            if (!kept(b, n)) {
              out.zero(y, P);
              continue;
            }
            PREFETCH_ROW(W, b, h, n);
            const T* __restrict x = W.row(b, h, n);
            const T pv = -pih[n];
            out.put(y, P, [&](int64_t j) { return x[j] * pv * g[j]; });
          }
        }
      }
    }
  };

  if (B >= at::get_num_threads()) {  // row by row
    at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
      Phases ph;
      for (int64_t b = lo; b < hi; ++b) {
        ph.next("tssa_fwd: energies (read w)");
        chunk_energies_items<T, PC>(W, mk, b * nc, (b + 1) * nc, H, N, P, CHUNK, nc, GRP, part.data());
        finish_energies(b, b + 1);
        ph.next("tssa_fwd: logits, softmax, moments (read w)");
        moments(b * nc, (b + 1) * nc);
        finish_moments(b, b + 1);
        ph.next("tssa_fwd: out (read w, write out)");
        output(b * nc, (b + 1) * nc);
      }
    });
    return;
  }
  Phases ph;
  ph.next("tssa_fwd: energies (read w)");
  chunk_energies<T, PC>(W, mk, B, H, N, P, CHUNK, nc, GRP, part.data());
  finish_energies(0, B);
  ph.next("tssa_fwd: logits, softmax, moments (read w)");
  at::parallel_for(0, B * nc, 1, moments);
  finish_moments(0, B);
  ph.next("tssa_fwd: out (read w, write out)");
  at::parallel_for(0, B * nc, 1, output);
}

std::vector<at::Tensor> tssa_fwd(const at::Tensor& w, const at::Tensor& temp, const c10::optional<at::Tensor>& mask,
                                 int64_t chunk) {
  check_common(w, temp, mask);
  const int64_t B = w.size(0), H = w.size(1), N = w.size(2), P = w.size(3), CHUNK = pick_chunk(chunk);
  auto out = at::empty_like(w);
  auto pi = at::empty({B, H, N}, w.options());
  auto od = w.options().dtype(at::kDouble);
  auto s = at::empty({B, H, P}, od), Tm = at::empty({B, H, P}, od), M = at::empty({B, H}, od);
  AT_DISPATCH_FLOATING_TYPES(w.scalar_type(), "tssa_fwd", [&] {
    using T = scalar_t;
    with_p(P, [&](auto pc) {
      constexpr int PC = decltype(pc)::value;
      tssa_fwd_impl<T, PC>(rows_of<const T>(w, "w"), temp.data_ptr<T>(), mask_ptr(mask), rows_of<T>(out, "out"),
                           want_stream<T, PC>(out), pi.data_ptr<T>(), s.data_ptr<double>(), Tm.data_ptr<double>(),
                           M.data_ptr<double>(), Dims<T>{B, H, N, P, CHUNK, nchunks(N, CHUNK)});
    });
  });
  return {out, pi, s, Tm, M, rows_past_range(s.data_ptr<double>(), B, H * P, H * P, w)};
}

#if defined(__AVX512F__)
// Pass A of the backward on one head's block [nb, ne) (<= BLK tokens) of float rows (kFastRows):
// tot += sum over kept n of Pi_n w_n G_n (summed in float over the block), an = -sum_j g_j w_nj G_nj
// (0 at padded tokens), the 16 tokens' sums reduced together (hsum16). No software prefetch here
// or in lambda_group16: the hardware prefetcher follows a head's run of rows on its own, and the
// prefetch instructions only cost issue slots (measured: pass q a little faster without).
template <int PC>
inline void q_block16(const Rows<const float>& W, const Rows<const float>& G, const bool* mk, int64_t N, int64_t b,
                      int64_t h, int64_t nb, int64_t ne, const float* pih, const float* gh, float* an, double* tot) {
  constexpr int K = PC / 16;
  __m512 gv[K], qv[K], sv[16];
  for (int k = 0; k < K; ++k) {
    gv[k] = _mm512_loadu_ps(gh + 16 * k);
    qv[k] = _mm512_setzero_ps();
  }
  for (int64_t n = nb; n < ne; ++n) {
    __m512 s = _mm512_setzero_ps();
    if (!mk || mk[b * N + n]) {
      const float* __restrict x = W.row(b, h, n);
      const float* __restrict gr = G.row(b, h, n);
      const __m512 pv = _mm512_set1_ps(pih[n]);
      for (int k = 0; k < K; ++k) {
        const __m512 xg = _mm512_mul_ps(_mm512_loadu_ps(x + 16 * k), _mm512_loadu_ps(gr + 16 * k));
        qv[k] = _mm512_fmadd_ps(pv, xg, qv[k]);
        s = _mm512_fmadd_ps(gv[k], xg, s);
      }
    }
    sv[4 * ((n - nb) % 4) + (n - nb) / 4] = s;
  }
  for (int64_t i = ne - nb; i < BLK; ++i) sv[4 * (i % 4) + i / 4] = _mm512_setzero_ps();
  _mm512_mask_storeu_ps(an, __mmask16(((1u << (ne - nb)) - 1u) << 0), _mm512_sub_ps(_mm512_setzero_ps(), hsum16(sv)));
  for (int k = 0; k < K; ++k) add16_to(tot + 16 * k, qv[k]);
}

// Pass B of the backward on the tokens [ng, ge) (one group, see group_size) of batch row b, all
// heads, float rows (kFastRows). Per head pt_hn = sum_j cD_j w_nj^2 of its rows (the pass's read
// from memory; 16 tokens' sums reduced together, hsum16) into Lf (scratch, H x ld floats, ld >=
// ge - ng rounded up to BLK); per token the softmax backward over heads in double, with
// P_hn = pt_hn + a_hn - K_h (+ dL/dPi_hn), Lam_hn = Pi_hn (P_hn - sum_h' Pi_h'n P_h'n) (0 at
// padded tokens) stored in Lf, lam_hn = temp_h Lam_hn in lam; then per head and block of BLK
// tokens tot_h += sum over kept n of Lam_n w_n^2 (in float over the block), the rows read again
// from L2. a, gpi, pi and lam are (H, N) slices of batch row b; Pg is scratch of H x BLK doubles.
template <int PC>
inline void lambda_group16(const Rows<const float>& W, const bool* mk, int64_t N, int64_t H, int64_t b, int64_t ng,
                           int64_t ge, const float* cDT, const float* a, const double* K, const float* gpi,
                           const float* pi, const float* temp, float* lam, double* accS, float* Lf, int64_t ld,
                           double* Pg) {
  constexpr int KV = PC / 16;
  for (int64_t h = 0; h < H; ++h) {
    __m512 cv[KV];
    for (int k = 0; k < KV; ++k) cv[k] = _mm512_loadu_ps(cDT + h * PC + 16 * k);
    for (int64_t nb = ng; nb < ge; nb += BLK) {
      const int64_t ne = std::min(ge, nb + BLK);
      __m512 sv[16];
      for (int64_t n = nb; n < ne; ++n) {
        __m512 u = _mm512_setzero_ps();
        if (!mk || mk[b * N + n]) {
          const float* __restrict x = W.row(b, h, n);
          for (int k = 0; k < KV; ++k) {
            const __m512 xv = _mm512_loadu_ps(x + 16 * k);
            u = _mm512_fmadd_ps(cv[k], _mm512_mul_ps(xv, xv), u);
          }
        }
        sv[4 * ((n - nb) % 4) + (n - nb) / 4] = u;
      }
      for (int64_t i = ne - nb; i < BLK; ++i) sv[4 * (i % 4) + i / 4] = _mm512_setzero_ps();
      _mm512_storeu_ps(Lf + h * ld + (nb - ng), hsum16(sv));
    }
  }
  for (int64_t nb = ng; nb < ge; nb += BLK) {
    const int64_t cnt = std::min(ge, nb + BLK) - nb, e = nb - ng;
    const __mmask16 in = __mmask16((1u << cnt) - 1u);
    __mmask8 kb[2];
    kept_halves16(mk, N, b, nb, cnt, kb);
    __m512d mean[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
    for (int64_t h = 0; h < H; ++h) {
      const int64_t o = h * N + nb;
      __m512d pv[2], av[2], tv[2], gv[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
      cvt16_pd(_mm512_loadu_ps(Lf + h * ld + e), tv);
      cvt16_pd(_mm512_maskz_loadu_ps(in, a + o), av);
      cvt16_pd(_mm512_maskz_loadu_ps(in, pi + o), pv);
      if (gpi) cvt16_pd(_mm512_maskz_loadu_ps(in, gpi + o), gv);
      const __m512d kh = _mm512_set1_pd(K[h]);
      for (int u = 0; u < 2; ++u) {
        const __m512d p = _mm512_maskz_add_pd(kb[u], _mm512_sub_pd(_mm512_add_pd(tv[u], av[u]), kh), gv[u]);
        _mm512_storeu_pd(Pg + h * BLK + 8 * u, p);
        mean[u] = _mm512_fmadd_pd(pv[u], p, mean[u]);
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      const int64_t o = h * N + nb;
      __m512d pv[2];
      cvt16_pd(_mm512_maskz_loadu_ps(in, pi + o), pv);
      const __m512d th = _mm512_set1_pd(double(temp[h]));
      __m256 Lh[2], lh[2];
      for (int u = 0; u < 2; ++u) {
        const __m512d L = _mm512_maskz_mul_pd(kb[u], pv[u], _mm512_sub_pd(_mm512_loadu_pd(Pg + h * BLK + 8 * u), mean[u]));
        Lh[u] = _mm512_cvtpd_ps(L);
        lh[u] = _mm512_cvtpd_ps(_mm512_mul_pd(th, L));
      }
      auto join = [](const __m256* v) {
        return _mm512_castpd_ps(
            _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(v[0])), _mm256_castps_pd(v[1]), 1));
      };
      _mm512_storeu_ps(Lf + h * ld + e, join(Lh));
      _mm512_mask_storeu_ps(lam + o, in, join(lh));
    }
  }
  for (int64_t h = 0; h < H; ++h)
    for (int64_t nb = ng; nb < ge; nb += BLK) {
      const int64_t ne = std::min(ge, nb + BLK);
      const float* Lb = Lf + h * ld + (nb - ng);
      __m512 acc[KV];
      for (int k = 0; k < KV; ++k) acc[k] = _mm512_setzero_ps();
      for (int64_t n = nb; n < ne; ++n) {
        if (mk && !mk[b * N + n]) continue;
        const float* __restrict x = W.row(b, h, n);
        const __m512 l = _mm512_set1_ps(Lb[n - nb]);
        for (int k = 0; k < KV; ++k) {
          const __m512 xv = _mm512_loadu_ps(x + 16 * k);
          acc[k] = _mm512_fmadd_ps(_mm512_mul_ps(l, xv), xv, acc[k]);
        }
      }
      for (int k = 0; k < KV; ++k) add16_to(accS + h * PC + 16 * k, acc[k]);
    }
}

// Pass C of the backward on one head's tokens [ng, ge) of float rows (kFastRows), the per-feature
// coefficients in registers: dw = w (cD Pi + lambda r + dL/ds) - Pi g G (0 at padded tokens)
template <int PC>
inline void dw_rows16(const Rows<const float>& W, const Rows<const float>& G, Rows<float> DW, const bool* mk,
                      int64_t N, int64_t b, int64_t h, int64_t ng, int64_t ge, const float* pih, const float* lh,
                      const float* gh, const float* cdh, const float* rh, const float* sh, bool stream, int64_t PFD) {
  constexpr int K = PC / 16;
  constexpr int64_t RB = PC * int64_t(sizeof(float));
  __m512 gv[K], cv[K], rv[K], sv[K];
  for (int k = 0; k < K; ++k) {
    gv[k] = _mm512_loadu_ps(gh + 16 * k);
    cv[k] = _mm512_loadu_ps(cdh + 16 * k);
    rv[k] = _mm512_loadu_ps(rh + 16 * k);
    sv[k] = _mm512_loadu_ps(sh + 16 * k);
  }
  for (int64_t n = ng; n < ge; ++n) {
    float* y = DW.row(b, h, n);
    if (mk && !mk[b * N + n]) {
      for (int k = 0; k < K; ++k) store_row16(y + 16 * k, _mm512_setzero_ps(), stream);
      continue;
    }
    prefetch_row(W.row(b, h, std::min(n + PFD, N - 1)), RB);
    prefetch_row(G.row(b, h, std::min(n + PFD, N - 1)), RB);
    const float* __restrict x = W.row(b, h, n);
    const float* __restrict gr = G.row(b, h, n);
    const __m512 pv = _mm512_set1_ps(pih[n]), l = _mm512_set1_ps(lh[n]);
    for (int k = 0; k < K; ++k) {
      const __m512 c = _mm512_add_ps(_mm512_fmadd_ps(cv[k], pv, _mm512_mul_ps(l, rv[k])), sv[k]);
      const __m512 t = _mm512_mul_ps(_mm512_mul_ps(pv, gv[k]), _mm512_loadu_ps(gr + 16 * k));
      store_row16(y + 16 * k, _mm512_fmsub_ps(_mm512_loadu_ps(x + 16 * k), c, t), stream);
    }
  }
}
#endif

template <typename T, int PC>
void tssa_bwd_impl(Rows<const T> G, const T* gpi, Rows<const T> W, const T* temp, const bool* mk, const T* pi,
                   const double* s, const double* Tm, const double* M, Rows<T> DW, bool stream, double* dtemp,
                   Dims<T> D) {
  const int64_t B = D.B, H = D.H, N = D.N, P = PC > 0 ? PC : D.P, CHUNK = D.CHUNK, nc = D.nc, HP = H * P;
  const int64_t GRP = group_size(W.sh, W.sn, CHUNK), RB = P * int64_t(sizeof(T)), PFD = prefetch_distance(RB);
  auto kept = [&](int64_t b, int64_t n) { return !mk || mk[b * N + n]; };

  // per (b, h) statistics
  std::vector<double> r(B * HP), live(B * HP), g(B * HP), d(B * HP), c(B * H);
  std::vector<T> gT(B * HP);
  for (int64_t bh = 0; bh < B * H; ++bh) {
    c[bh] = 1.0 / (M[bh] + PI_EPS);
    for (int64_t j = 0; j < P; ++j) {
      const int64_t k = bh * P + j;
      r[k] = inv_energy(s[k]);
      live[k] = s[k] > NORM_EPS2 ? 1.0 : 0.0;
      d[k] = c[bh] * Tm[k];
      g[k] = 1.0 / (1.0 + d[k]);
      gT[k] = T(g[k]);
    }
  }
  // The passes run on work items (b, chunk) with one partial sum per item, reduced in chunk order,
  // on the schedules of the forward (tssa_fwd_impl): row by row when the batch keeps every thread
  // busy, else each pass over all items in parallel. All three visit the items first to last (a
  // head's rows are read in long runs in one direction, which the prefetch needs more than it
  // gains from the tokens a reverse pass would find left in the cache).
  std::vector<T> a(B * H * N), lam(B * H * N);
  std::vector<double> part(B * nc * HP);
  std::vector<double> q(B * HP), cD(B * HP), K(B * H), Ssum(B * HP);
  std::vector<T> cDT(B * HP), rT(B * HP), ST(B * HP);
  // pass A: q_j = sum_n w Pi G (dL/dg_j = -q_j), a_n = -sum_j w g G (dL/dPi through out)
  auto pass_q = [&](int64_t lo, int64_t hi) {
    Buf<T, PC> buf(P), vb(P);
    for (const auto [h0, h1] : head_runs(H, W.sh > W.sn && G.sh > G.sn))
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t b = it / nc, n0 = (it % nc) * CHUNK, n1 = std::min(N, n0 + CHUNK);
      double* acc = part.data() + it * HP;
      std::fill(acc + h0 * P, acc + h1 * P, 0.0);
      for (int64_t ng = n0; ng < n1; ng += GRP) {
        const int64_t ge = std::min(n1, ng + GRP);
        for (int64_t h = h0; h < h1; ++h)
        for (int64_t nb = ng; nb < ge; nb += BLK) {
          const int64_t ne = std::min(ge, nb + BLK);
          const T* __restrict gh = gT.data() + (b * H + h) * P;
#if defined(__AVX512F__)
          if constexpr (kFastRows<T, PC>) {
            q_block16<PC>(W, G, mk, N, b, h, nb, ne, pi + (b * H + h) * N, gh, a.data() + (b * H + h) * N + nb,
                          acc + h * P);
            continue;
          }
#endif
          T* q = buf.data();
          for (int64_t j = 0; j < P; ++j) q[j] = T(0);
          for (int64_t n = nb; n < ne; ++n) {
            PREFETCH_ROW(W, b, h, n);
            PREFETCH_ROW(G, b, h, n);
            T& an = a[(b * H + h) * N + n];
            if (!kept(b, n)) {
              an = T(0);
              continue;
            }
            const T* __restrict x = W.row(b, h, n);
            const T* __restrict gr = G.row(b, h, n);
            const T pv = pi[(b * H + h) * N + n];
            T* v = vb.data();
#pragma omp simd
            for (int64_t j = 0; j < P; ++j) {
              const T xg = x[j] * gr[j];
              q[j] += pv * xg;
              v[j] = gh[j] * xg;
            }
            an = -row_sum<T, PC>(v, P);
          }
          double* tot = acc + h * P;
          for (int64_t j = 0; j < P; ++j) tot[j] += double(q[j]);
        }
      }
    }
  };
  auto finish_q = [&](int64_t b0, int64_t b1) {
    reduce_chunks(part, q.data(), b0, b1, nc, HP);
    for (int64_t bh = b0 * H; bh < b1 * H; ++bh) {
      double k = 0.0;
      for (int64_t j = 0; j < P; ++j) {
        const int64_t i = bh * P + j;
        const double Dj = g[i] * g[i] * q[i];  // dL/dd_j = -g^2 dL/dg_j
        cD[i] = c[bh] * Dj;
        k += Dj * d[i];
        cDT[i] = T(cD[i]);
      }
      K[bh] = c[bh] * k;  // = c^2 sum_j D_j T_j
    }
  };
  // pass B: dL/dPi, softmax over heads -> Lam = dL/dlogit / temp (lambda = temp Lam); sum_n Lam w^2,
  // from which finish_lambda forms dL/ds and dL/dtemp (float rows of 32 / 48 / 64 features:
  // lambda_group16, one read of w)
  auto pass_lambda = [&](int64_t lo, int64_t hi) {
    std::vector<double> Pg(H * GRP);
    Buf<T, PC> buf(P), vb(P);
#if defined(__AVX512F__)
    const int64_t LD = (GRP + BLK - 1) / BLK * BLK;
    std::vector<float> Lf(H * LD);
    std::vector<double> pg16(H * BLK);
#endif
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t b = it / nc, n0 = (it % nc) * CHUNK, n1 = std::min(N, n0 + CHUNK);
      double* accS = part.data() + it * HP;
      std::fill(accS, accS + HP, 0.0);
#if defined(__AVX512F__)
      if constexpr (kFastRows<T, PC>) {
        const int64_t o = b * H * N;
        for (int64_t ng = n0; ng < n1; ng += GRP)
          lambda_group16<PC>(W, mk, N, H, b, ng, std::min(n1, ng + GRP), cDT.data() + b * HP, a.data() + o,
                             K.data() + b * H, gpi ? gpi + o : nullptr, pi + o, temp, lam.data() + o, accS,
                             Lf.data(), LD, pg16.data());
        continue;
      }
#endif
      for (int64_t ng = n0; ng < n1; ng += GRP) {
        const int64_t ge = std::min(n1, ng + GRP);
        for (int64_t h = 0; h < H; ++h) {
          const int64_t bh = b * H + h;
          const T* __restrict cDh = cDT.data() + bh * P;
          for (int64_t n = ng; n < ge; ++n) {
            double pn = 0.0;
            PREFETCH_ROW(W, b, h, n);
            if (kept(b, n)) {
              const T* __restrict x = W.row(b, h, n);
              T* v1 = vb.data();
#pragma omp simd
              for (int64_t j = 0; j < P; ++j) v1[j] = cDh[j] * (x[j] * x[j]);
              pn = double(row_sum<T, PC>(v1, P)) + double(a[bh * N + n]) - K[bh] +
                   (gpi ? double(gpi[bh * N + n]) : 0.0);
            }
            Pg[h * GRP + n - ng] = pn;
          }
        }
        for (int64_t n = ng; n < ge; ++n) {
          const int64_t i = n - ng;
          const bool k = kept(b, n);
          double mean = 0.0;
          for (int64_t h = 0; h < H; ++h) mean += double(pi[(b * H + h) * N + n]) * Pg[h * GRP + i];
          for (int64_t h = 0; h < H; ++h)  // Lam for now: tempered below, once its energy is summed
            lam[(b * H + h) * N + n] = T(k ? double(pi[(b * H + h) * N + n]) * (Pg[h * GRP + i] - mean) : 0.0);
        }
        for (int64_t h = 0; h < H; ++h) {
          T* lh = lam.data() + (b * H + h) * N;
          for (int64_t nb = ng; nb < ge; nb += BLK)
            add_weighted_energy(W, mk, N, P, b, h, nb, std::min(ge, nb + BLK), buf.data(), accS + h * P,
                                [&](int64_t n) { return lh[n]; });
          for (int64_t n = ng; n < ge; ++n) lh[n] = T(double(temp[h]) * double(lh[n]));
        }
      }
    }
  };
  // per-feature coefficients of 2 w_nj: c D_j Pi_n + lambda_n r_j + dL/ds_j,
  // dL/ds_j = -r_j^2 sum_n lambda_n w_nj^2
  auto finish_lambda = [&](int64_t b0, int64_t b1) {
    reduce_chunks(part, Ssum.data(), b0, b1, nc, HP);
    for (int64_t bh = b0 * H; bh < b1 * H; ++bh) {  // sum_n Lam w^2 -> dL/dtemp = sum_n Lam_n R_n
      double dt = 0.0;                             // = sum_j r_j sum_n Lam_n w_nj^2; then sum_n lambda w^2
      const double th = double(temp[bh % H]);
      for (int64_t j = 0; j < P; ++j) {
        dt += r[bh * P + j] * Ssum[bh * P + j];
        Ssum[bh * P + j] *= th;
      }
      dtemp[bh] = dt;
    }
    for (int64_t k = b0 * HP; k < b1 * HP; ++k) {
      cDT[k] = T(2.0 * cD[k]);
      rT[k] = T(2.0 * r[k]);
      ST[k] = T(-2.0 * r[k] * r[k] * Ssum[k] * live[k]);
    }
  };
  // pass C: dw = -Pi g G + 2 w (c D Pi + lambda r + dL/ds)
  auto pass_dw = [&](int64_t lo, int64_t hi) {
    RowWriter<T, PC> out(stream, P);
    for (const auto [h0, h1] : head_runs(H, W.sh > W.sn && G.sh > G.sn && DW.sh > DW.sn))
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t b = it / nc, n0 = (it % nc) * CHUNK, n1 = std::min(N, n0 + CHUNK);
      for (int64_t ng = n0; ng < n1; ng += GRP) {
        const int64_t ge = std::min(n1, ng + GRP);
        for (int64_t h = h0; h < h1; ++h) {
          const int64_t bh = b * H + h;
          const T* __restrict gh = gT.data() + bh * P;
          const T* __restrict cdh = cDT.data() + bh * P;
          const T* __restrict rh = rT.data() + bh * P;
          const T* __restrict sh = ST.data() + bh * P;
#if defined(__AVX512F__)
          if constexpr (kFastRows<T, PC>) {
            dw_rows16<PC>(W, G, DW, mk, N, b, h, ng, ge, pi + bh * N, lam.data() + bh * N, gh, cdh, rh, sh,
                          out.stream, PFD);
            continue;
          }
#endif
          for (int64_t n = ng; n < ge; ++n) {
            T* y = DW.row(b, h, n);
            if (!kept(b, n)) {
              out.zero(y, P);
              continue;
            }
            PREFETCH_ROW(W, b, h, n);
            PREFETCH_ROW(G, b, h, n);
            const T* __restrict x = W.row(b, h, n);
            const T* __restrict gr = G.row(b, h, n);
            const T pv = pi[bh * N + n];
            const T l = lam[bh * N + n];
            out.put(y, P, [&](int64_t j) { return x[j] * (cdh[j] * pv + l * rh[j] + sh[j]) - pv * gh[j] * gr[j]; });
          }
        }
      }
    }
  };

  if (B >= at::get_num_threads()) {  // row by row
    at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
      Phases ph;
      for (int64_t b = lo; b < hi; ++b) {
        ph.next("tssa_bwd: q (read w, G)");
        pass_q(b * nc, (b + 1) * nc);
        finish_q(b, b + 1);
        ph.next("tssa_bwd: lambda (read w)");
        pass_lambda(b * nc, (b + 1) * nc);
        finish_lambda(b, b + 1);
        ph.next("tssa_bwd: dw (read w, G, write dw)");
        pass_dw(b * nc, (b + 1) * nc);
      }
    });
    return;
  }
  Phases ph;
  ph.next("tssa_bwd: q (read w, G)");
  at::parallel_for(0, B * nc, 1, pass_q);
  finish_q(0, B);
  ph.next("tssa_bwd: lambda (read w)");
  at::parallel_for(0, B * nc, 1, pass_lambda);
  finish_lambda(0, B);
  ph.next("tssa_bwd: dw (read w, G, write dw)");
  at::parallel_for(0, B * nc, 1, pass_dw);
}

std::vector<at::Tensor> tssa_bwd(const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_pi,
                                 const at::Tensor& w, const at::Tensor& temp, const c10::optional<at::Tensor>& mask,
                                 const at::Tensor& pi, const at::Tensor& s, const at::Tensor& Tm,
                                 const at::Tensor& M, int64_t chunk) {
  check_common(w, temp, mask);
  const int64_t B = w.size(0), H = w.size(1), N = w.size(2), P = w.size(3), CHUNK = pick_chunk(chunk);
  check_like(grad_out, w, "grad_out");
  check_small(pi, {B, H, N}, w.scalar_type(), "pi");
  check_small(s, {B, H, P}, at::kDouble, "s");
  check_small(Tm, {B, H, P}, at::kDouble, "T");
  check_small(M, {B, H}, at::kDouble, "M");
  if (grad_pi.has_value()) check_small(*grad_pi, {B, H, N}, w.scalar_type(), "grad_pi");
  auto dw = at::empty_like(w);
  auto dtemp = at::empty({B, H}, w.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(w.scalar_type(), "tssa_bwd", [&] {
    using T = scalar_t;
    with_p(P, [&](auto pc) {
      constexpr int PC = decltype(pc)::value;
      tssa_bwd_impl<T, PC>(rows_of<const T>(grad_out, "grad_out"),
                           grad_pi.has_value() ? grad_pi->data_ptr<T>() : nullptr, rows_of<const T>(w, "w"),
                           temp.data_ptr<T>(), mask_ptr(mask), pi.data_ptr<T>(), s.data_ptr<double>(),
                           Tm.data_ptr<double>(), M.data_ptr<double>(), rows_of<T>(dw, "grad_w"),
                           want_stream<T, PC>(dw), dtemp.data_ptr<double>(),
                           Dims<T>{B, H, N, P, CHUNK, nchunks(N, CHUNK)});
    });
  });
  return {dw, dtemp};
}

// ================================================================== causal TSSA
// Per (b, h) and token t (prefix sums over kept tokens s <= t):
//   E_t = sum w_s^2, rho_t = w_t^2 / max(E_t, 1e-12), logit_t = temp (sum_j rho_tj + lb_t),
//   Pi_t = softmax_heads, Q_t = sum Pi_s w_s^2, M_t = sum Pi_s, out_t = -w_t Pi_t / (1 + Q_t / (M_t + 1e-8)).
// Checkpoints (double) Ec/Qc (B, nc + 1, H, p), Mc (B, nc + 1, H): the prefix sums before each
// chunk; index nc holds the totals (the final recurrent state). Running sums are double.
// The scans go over blocks of BLK tokens and, inside a block, head by head, so the per-token
// work of different tokens overlaps (the only sequential dependence is the running sums).

template <typename T>
struct CausalArgs {
  Rows<const T> W;
  const T* temp;
  const T* lb;  // (B, H, N) logit bias or nullptr
  const bool* mk;
  int64_t B, H, N, P, nc, CHUNK;
  inline bool kept(int64_t b, int64_t n) const { return !mk || mk[b * N + n]; }
};


// Within a block the running sums are a T base (the double sum before the block, rounded) plus
// a T sum over at most BLK tokens; the block's sum is added to the double total at its end. The
// per-token work is then all in T, and the rounding error stays ~2 ulp however long the prefix.
template <typename T>
inline void block_begin(const double* __restrict tot, T* __restrict base, T* __restrict loc, int64_t P) {
  for (int64_t j = 0; j < P; ++j) {
    base[j] = T(tot[j]);
    loc[j] = T(0);
  }
}
template <typename T>
inline void block_end(double* __restrict tot, const T* __restrict loc, int64_t P) {
  for (int64_t j = 0; j < P; ++j) tot[j] += double(loc[j]);
}


// tokens [nb, ne) (ne - nb <= BLK), all heads: E += w^2 and the logits lg[h * BLK + i]
template <typename T, int PC>
inline void causal_logits(const CausalArgs<T>& A, int64_t b, int64_t nb, int64_t ne, double* E, T* lg, T* v,
                          T* base, T* loc) {
  const int64_t H = A.H, P = PC > 0 ? PC : A.P, RB = P * int64_t(sizeof(T)), pfd = prefetch_distance(RB);
#if defined(__AVX512F__)
  if constexpr (kFastRows<T, PC>) {
    constexpr int K = PC / 16;
    // den is clamped to the largest float: an overflowed (inf) prefix sum would make the Newton
    // step inf * 0 = NaN; clamped, r is a tiny (denormal) estimate and the term ~0, as x / inf
    const __m512 eps = _mm512_set1_ps(float(RATIO_EPS)), two = _mm512_set1_ps(2.f),
                 big = _mm512_set1_ps(std::numeric_limits<float>::max());
    for (int64_t h = 0; h < H; ++h) {
      double* __restrict e = E + h * P;
      __m512 bs[K], lc[K];
      block_begin16<K>(e, bs, lc);
      // per token, the lanes of sum_j rho_j in sv (transposed order for hsum16), reduced per block
      static_assert(BLK == 16, "hsum16 reduces one block of 16 tokens");
      __m512 sv[16];
      __mmask16 km = 0;  // kept tokens of the block
      for (int64_t n = nb; n < ne; ++n) {
        prefetch_row(A.W.row(b, h, std::min(n + pfd, A.N - 1)), RB);
        __m512 s = _mm512_setzero_ps();
        if (A.kept(b, n)) {
          km |= __mmask16(1u << (n - nb));
          const float* __restrict x = A.W.row(b, h, n);
          for (int k = 0; k < K; ++k) {
            const __m512 xv = _mm512_loadu_ps(x + 16 * k);
            const __m512 x2 = _mm512_mul_ps(xv, xv);
            lc[k] = _mm512_add_ps(lc[k], x2);
            // s += x2 / den as (x2 r) (2 - den r), r ~ 1 / den (the Newton step folded in)
            const __m512 den = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(bs[k], lc[k]), eps), big),
                         r = _mm512_rcp14_ps(den);
            s = _mm512_fmadd_ps(_mm512_mul_ps(x2, r), _mm512_fnmadd_ps(den, r, two), s);
          }
        }
        sv[4 * ((n - nb) % 4) + (n - nb) / 4] = s;
      }
      for (int64_t i = ne - nb; i < BLK; ++i) sv[4 * (i % 4) + i / 4] = _mm512_setzero_ps();
      __m512 rs = hsum16(sv);
      if (A.lb) rs = _mm512_add_ps(rs, _mm512_maskz_loadu_ps(km, A.lb + (b * H + h) * A.N + nb));
      _mm512_storeu_ps(lg + h * BLK, _mm512_maskz_mul_ps(km, rs, _mm512_set1_ps(A.temp[h])));
      block_end16<K>(e, lc);
    }
    return;
  }
#endif
  for (int64_t h = 0; h < H; ++h) {
    double* __restrict e = E + h * P;
    block_begin(e, base, loc, P);
    const T th = A.temp[h];
    for (int64_t n = nb; n < ne; ++n) {
      prefetch_row(A.W.row(b, h, std::min(n + pfd, A.N - 1)), RB);
      T& l = lg[h * BLK + (n - nb)];
      if (!A.kept(b, n)) {
        l = T(0);
        continue;
      }
      const T* __restrict x = A.W.row(b, h, n);
#pragma omp simd
      for (int64_t j = 0; j < P; ++j) {
        const T x2 = x[j] * x[j];
        loc[j] += x2;
        v[j] = x2 / std::max(base[j] + loc[j], T(RATIO_EPS));
      }
      T rs = row_sum<T, PC>(v, P);
      if (A.lb) rs += A.lb[(b * H + h) * A.N + n];
      l = th * rs;
    }
    block_end(e, loc, P);
  }
}

// tokens [nb, ne), all heads, Pi in pv[h * BLK + i]: Q += Pi w^2, M += Pi, out rows
template <typename T, int PC>
inline void causal_out(const CausalArgs<T>& A, Rows<T> O, RowWriter<T, PC>& wr, int64_t b, int64_t nb, int64_t ne,
                       const T* pv, double* Q, double* M, T* base, T* loc) {
  const int64_t H = A.H, P = PC > 0 ? PC : A.P;
#if defined(__AVX512F__)
  if constexpr (kFastRows<T, PC>) {
    constexpr int K = PC / 16;
    const __m512 one = _mm512_set1_ps(1.f), big = _mm512_set1_ps(std::numeric_limits<float>::max());
    for (int64_t h = 0; h < H; ++h) {
      double* __restrict q = Q + h * P;
      __m512 bs[K], lc[K];
      block_begin16<K>(q, bs, lc);
      double m = M[h];
      for (int64_t n = nb; n < ne; ++n) {
        float* y = O.row(b, h, n);
        if (!A.kept(b, n)) {
          for (int k = 0; k < K; ++k) store_row16(y + 16 * k, _mm512_setzero_ps(), wr.stream);
          continue;
        }
        const float* __restrict x = A.W.row(b, h, n);
        const float pt = pv[h * BLK + (n - nb)];
        m += double(pt);
        const __m512 vp = _mm512_set1_ps(pt), vc = _mm512_set1_ps(float(1.0 / (m + PI_EPS)));
        for (int k = 0; k < K; ++k) {
          // y = -(pt x) / den: q0 = pt x r, y = -(q0 + q0 (1 - den r))
          const __m512 px = _mm512_mul_ps(vp, _mm512_loadu_ps(x + 16 * k));
          lc[k] = _mm512_fmadd_ps(px, _mm512_loadu_ps(x + 16 * k), lc[k]);
          const __m512 den = _mm512_min_ps(_mm512_fmadd_ps(_mm512_add_ps(bs[k], lc[k]), vc, one), big);  // as above
          const __m512 r = _mm512_rcp14_ps(den), q0 = _mm512_mul_ps(px, r);
          store_row16(y + 16 * k, _mm512_fnmsub_ps(q0, _mm512_fnmadd_ps(den, r, one), q0), wr.stream);
        }
      }
      M[h] = m;
      block_end16<K>(q, lc);
    }
    return;
  }
#endif
  for (int64_t h = 0; h < H; ++h) {
    double* __restrict q = Q + h * P;
    block_begin(q, base, loc, P);
    for (int64_t n = nb; n < ne; ++n) {
      T* y = O.row(b, h, n);
      if (!A.kept(b, n)) {
        wr.zero(y, P);
        continue;
      }
      const T* __restrict x = A.W.row(b, h, n);
      const T pt = pv[h * BLK + (n - nb)], np = -pt;
      M[h] += double(pt);
      const T c = T(1.0 / (M[h] + PI_EPS));
      wr.put(y, P, [&](int64_t j) {
        loc[j] += pt * x[j] * x[j];
        return x[j] * np / (T(1) + (base[j] + loc[j]) * c);
      });
    }
    block_end(q, loc, P);
  }
}

template <typename T, int PC>
void causal_fwd_impl(const CausalArgs<T>& A, Rows<T> O, bool stream, T* pi, double* Ec, double* Qc, double* Mc,
                     bool one_pass) {
  const int64_t B = A.B, H = A.H, N = A.N, P = PC > 0 ? PC : A.P, nc = A.nc, CHUNK = A.CHUNK, HP = H * P;
  auto ck = [&](double* base, int64_t b, int64_t c, int64_t len) { return base + (b * (nc + 1) + c) * len; };
  auto store_pi = [&](int64_t b, int64_t nb, int64_t ne, const T* lg) {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t n = nb; n < ne; ++n) pi[(b * H + h) * N + n] = A.kept(b, n) ? lg[h * BLK + (n - nb)] : T(0);
  };

  Phases ph;
  if (one_pass) {
    ph.next("causal_fwd: scan per sequence (read w, write out)");
    // sequential over the tokens of each sequence, parallel over the batch
    at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
      std::vector<double> E(HP), Q(HP), M(H);
      std::vector<T> lg(H * BLK), tmp(BLK);
      Buf<T, PC> vb(P), bb(P), lb_(P);
      RowWriter<T, PC> wr(stream, P);
      for (int64_t b = lo; b < hi; ++b) {
        std::fill(E.begin(), E.end(), 0.0);
        std::fill(Q.begin(), Q.end(), 0.0);
        std::fill(M.begin(), M.end(), 0.0);
        for (int64_t c = 0; c <= nc; ++c) {
          std::copy(E.begin(), E.end(), ck(Ec, b, c, HP));
          std::copy(Q.begin(), Q.end(), ck(Qc, b, c, HP));
          std::copy(M.begin(), M.end(), ck(Mc, b, c, H));
          if (c == nc) break;
          const int64_t n1 = std::min(N, (c + 1) * CHUNK);
          for (int64_t nb = c * CHUNK; nb < n1; nb += BLK) {
            const int64_t ne = std::min(n1, nb + BLK);
            causal_logits<T, PC>(A, b, nb, ne, E.data(), lg.data(), vb.data(), bb.data(), lb_.data());
            softmax_heads<T>(lg.data(), H, BLK, ne - nb, tmp.data());
            store_pi(b, nb, ne, lg.data());
            causal_out<T, PC>(A, O, wr, b, nb, ne, lg.data(), Q.data(), M.data(), bb.data(), lb_.data());
          }
        }
      }
    });
    return;
  }
  // Fewer sequences than threads: chunks in parallel, never waiting for another thread.
  // Pass A: chunk sums of w^2 -> E at every chunk start. Pass B, a pool of work items taken by
  // whichever thread is free: "pi" of chunk c (E, logits, Pi, and the chunk's sums of Pi w^2 and
  // Pi, folded in chunk order into the Q / M prefix sums as soon as all earlier chunks are in),
  // and "out" of chunk c (once the prefix at its start is known). A thread prefers "out" items,
  // takes a new "pi" item otherwise, and stops when neither is available: the thread that
  // publishes the last missing chunk then finds the remaining "out" items ready and runs them.
  // The prefix sums are folded in chunk order, so the result does not depend on the timing.
  const int64_t NI = B * nc;
  std::vector<double> part(NI * HP), partM(NI * H);
  ph.next("causal_fwd: chunk energies (read w)");
  chunk_energies<T, PC>(A.W, A.mk, B, H, N, P, CHUNK, nc, CHUNK, part.data());
  for (int64_t b = 0; b < B; ++b) {
    double* e0 = ck(Ec, b, 0, HP);
    std::fill(e0, e0 + HP, 0.0);
    for (int64_t c = 0; c < nc; ++c)
      for (int64_t k = 0; k < HP; ++k) e0[(c + 1) * HP + k] = e0[c * HP + k] + part[(b * nc + c) * HP + k];
    std::fill(ck(Qc, b, 0, HP), ck(Qc, b, 0, HP) + HP, 0.0);
    std::fill(ck(Mc, b, 0, H), ck(Mc, b, 0, H) + H, 0.0);
  }

  ph.next("causal_fwd: chunk pipeline (read w twice, write out)");
  std::mutex mu;                                       // guards the bookkeeping below
  std::vector<char> published(NI, 0);                  // "pi" of the chunk done
  std::vector<int64_t> folded(B, 0), out_next(B, 0);  // chunks in the Q/M prefix; next "out"
  std::atomic<int64_t> next_pi{0};
  auto claim_out = [&]() -> int64_t {  // under mu: lowest chunk of some b whose "out" can run
    for (int64_t b = 0; b < B; ++b) {
      const int64_t c = out_next[b];
      if (c < nc && c <= folded[b] && published[b * nc + c]) {
        ++out_next[b];
        return b * nc + c;
      }
    }
    return -1;
  };
  auto publish = [&](int64_t it) {  // under mu
    const int64_t b = it / nc;
    published[it] = 1;
    for (int64_t& c = folded[b]; c < nc && published[b * nc + c]; ++c) {
      const double* q = part.data() + (b * nc + c) * HP;
      const double* m = partM.data() + (b * nc + c) * H;
      for (int64_t k = 0; k < HP; ++k) ck(Qc, b, c + 1, HP)[k] = ck(Qc, b, c, HP)[k] + q[k];
      for (int64_t k = 0; k < H; ++k) ck(Mc, b, c + 1, H)[k] = ck(Mc, b, c, H)[k] + m[k];
    }
  };
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<double> S(HP), M(H);
    std::vector<T> lg(H * BLK), tmp(BLK);
    Buf<T, PC> vb(P), bb(P), lb_(P);
    RowWriter<T, PC> wr(stream, P);
    for (;;) {
      int64_t it;
      {
        std::lock_guard<std::mutex> lock(mu);
        it = claim_out();
      }
      if (it >= 0) {  // out of chunk it
        const int64_t b = it / nc, c = it % nc, n1 = std::min(N, (c + 1) * CHUNK);
        std::copy(ck(Qc, b, c, HP), ck(Qc, b, c, HP) + HP, S.begin());
        std::copy(ck(Mc, b, c, H), ck(Mc, b, c, H) + H, M.begin());
        for (int64_t nb = c * CHUNK; nb < n1; nb += BLK) {
          const int64_t ne = std::min(n1, nb + BLK);
          for (int64_t h = 0; h < H; ++h)
            for (int64_t n = nb; n < ne; ++n) lg[h * BLK + (n - nb)] = pi[(b * H + h) * N + n];
          causal_out<T, PC>(A, O, wr, b, nb, ne, lg.data(), S.data(), M.data(), bb.data(), lb_.data());
        }
        continue;
      }
      it = next_pi.fetch_add(1);
      if (it >= NI) break;
      // pi of chunk it, and its sums of Pi w^2 and Pi
      const int64_t b = it / nc, c = it % nc, n1 = std::min(N, (c + 1) * CHUNK);
      std::copy(ck(Ec, b, c, HP), ck(Ec, b, c, HP) + HP, S.begin());
      double* accQ = part.data() + it * HP;
      double* accM = partM.data() + it * H;
      std::fill(accQ, accQ + HP, 0.0);
      std::fill(accM, accM + H, 0.0);
      for (int64_t nb = c * CHUNK; nb < n1; nb += BLK) {
        const int64_t ne = std::min(n1, nb + BLK);
        causal_logits<T, PC>(A, b, nb, ne, S.data(), lg.data(), vb.data(), bb.data(), lb_.data());
        softmax_heads<T>(lg.data(), H, BLK, ne - nb, tmp.data());
        store_pi(b, nb, ne, lg.data());
        for (int64_t h = 0; h < H; ++h)
          add_weighted_energy(A.W, A.mk, N, P, b, h, nb, ne, vb.data(), accQ + h * P, [&](int64_t n) {
            const T pt = lg[h * BLK + (n - nb)];
            accM[h] += double(pt);
            return pt;
          });
      }
      std::lock_guard<std::mutex> lock(mu);
      publish(it);
    }
  });
}

template <typename T>
CausalArgs<T> causal_args(const at::Tensor& w, const at::Tensor& temp, const c10::optional<at::Tensor>& lb,
                          const c10::optional<at::Tensor>& mask, int64_t CHUNK) {
  const int64_t B = w.size(0), H = w.size(1), N = w.size(2), P = w.size(3);
  if (lb.has_value()) check_small(*lb, {B, H, N}, w.scalar_type(), "logit bias");
  return {rows_of<const T>(w, "w"), temp.data_ptr<T>(), lb.has_value() ? lb->data_ptr<T>() : nullptr,
          mask_ptr(mask), B, H, N, P, nchunks(N, CHUNK), CHUNK};
}

std::vector<at::Tensor> causal_fwd(const at::Tensor& w, const at::Tensor& temp, const c10::optional<at::Tensor>& lb,
                                   const c10::optional<at::Tensor>& mask, int64_t mode, int64_t chunk) {
  check_common(w, temp, mask);
  const int64_t B = w.size(0), H = w.size(1), N = w.size(2), P = w.size(3), CHUNK = pick_chunk(chunk),
                nc = nchunks(N, CHUNK);
  auto out = at::empty_like(w);
  auto pi = at::empty({B, H, N}, w.options());
  auto od = w.options().dtype(at::kDouble);
  auto Ec = at::empty({B, nc + 1, H, P}, od), Qc = at::empty({B, nc + 1, H, P}, od);
  auto Mc = at::empty({B, nc + 1, H}, od);
  // mode 1: one sequential pass per sequence (parallel over the batch); 0: chunks in parallel
  // (an extra read of w); -1: one pass when the batch alone keeps every thread busy
  const bool one_pass = mode == 1 || (mode < 0 && B >= at::get_num_threads());
  AT_DISPATCH_FLOATING_TYPES(w.scalar_type(), "causal_fwd", [&] {
    using T = scalar_t;
    const CausalArgs<T> A = causal_args<T>(w, temp, lb, mask, CHUNK);
    with_p(P, [&](auto pc) {
      constexpr int PC = decltype(pc)::value;
      causal_fwd_impl<T, PC>(A, rows_of<T>(out, "out"), want_stream<T, PC>(out), pi.data_ptr<T>(),
                             Ec.data_ptr<double>(), Qc.data_ptr<double>(), Mc.data_ptr<double>(), one_pass);
    });
  });
  // from the totals of the sums of squares (checkpoint nc)
  return {out, pi, Ec, Qc, Mc, rows_past_range(Ec.data_ptr<double>() + nc * H * P, B, H * P, (nc + 1) * H * P, w)};
}

// ------------------------------------------------------------------ causal backward
// With D_t = g_t^2 w_t Pi_t G_t (= dL/d dots_t), c_t = 1 / (M_t + 1e-8), d_t = c_t Q_t:
//   dL/dQ_t = c_t D_t, dL/dM_t = -c_t sum_j D_tj d_tj,
//   U_s = sum_{t>=s} dL/dQ_t, V_s = sum_{t>=s} dL/dM_t (reverse cumulative sums, + state grads),
//   dL/dPi_s = gPi_s - sum_j w g G + sum_j U_sj w_sj^2 + V_s,
//   Lambda = Pi (dL/dPi - sum_heads Pi dL/dPi), lambda = temp Lambda (= dL/dlb),
//   dL/dE_t = -lambda_t w_t^2 / E_t^2 (0 where clamped), W_s = sum_{t>s} dL/dE_t (the later tokens),
//   dw = -Pi g G + 2 w (U Pi + lambda B / E^2 + W), B_s = E_s - w_s^2 = sum_{t<s} w_t^2 (the exclusive
//   prefix; 1 / 1e-12 in place of B / E^2 where clamped).
// A token's own ratio w^2 / E has the gradient 1 / E - w^2 / E^2 = B / E^2 with respect to w^2: the
// two terms of size 1 / E cancel at a sequence's first tokens (B = 0), so they are never formed
// apart (in float they left ~1 ulp of lambda / E, up to 1e-3 of the gradient on short rows).
// Every quantity of token s needs only U, V, W, i.e. sums over the later tokens, so one reverse
// sweep per chunk (after a forward recompute of the chunk from its checkpoint: 1 / E, B / E^2 and
// d into a scratch that stays in L2) gives lambda, dtemp and dw together, carrying U, V, W from
// one chunk to the one before. Schedules: with at least as many sequences as threads, each
// sequence is swept from its last chunk to its first (w and G read once, dw written once); with
// fewer, the chunks are swept in parallel: a first pass forms the chunk sums of dL/dQ and dL/dM (so
// U, V at every chunk end), the sweep starts W at 0, and a last pass adds 2 w (W at the chunk end)
// to dw, W entering dw linearly.
template <typename T>
struct CausalGrads {
  Rows<const T> G;
  const T* gpi;  // (B, H, N) or nullptr
  const T* pi;
  const double *Ec, *Qc, *Mc;
};

#if defined(__AVX512F__)
// float(lo), float(hi) as one vector of 16 floats
inline __m512 cvt16_ps(__m512d lo, __m512d hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm512_cvtpd_ps(lo))),
                                             _mm256_castps_pd(_mm512_cvtpd_ps(hi)), 1));
}
// d[0:2) += the 16 floats of v (as doubles)
inline void add16_pd(__m512d* d, __m512 v) {
  __m512d e[2];
  cvt16_pd(v, e);
  d[0] = _mm512_add_pd(d[0], e[0]);
  d[1] = _mm512_add_pd(d[1], e[1]);
}

// The causal backward for float rows of 32 / 48 / 64 features (kFastRows): the generic code's
// arithmetic with the per-feature work in vectors, the running sums (E, Q in the recompute; U, W
// in the sweep) kept in double vectors (2 per 16 features), the per-token sums over features of
// 16 tokens reduced together (hsum16), and the softmax over heads 16 tokens at a time in double.
// 1 / E and 1 / (1 + d) are exact divisions (vdivps), as in the generic code.
// The loops over the PC / 16 vectors of a row are unrolled (GCC unroll) so that these arrays of
// running sums are held in registers rather than on the stack.

// The running sums at the start of each block of one head's tokens [n0, n1), from the chunk's
// checkpoint (e0, q0, M): for block kb (tokens n0 + kb BLK ...), E, Q into Eb, Qb + kb ld and M into
// Mb[kb ldm], each the generic recompute's per-token double sum (E += w^2, Q += Pi w^2, M += Pi)
// up to that token, so the blocks' recompute continues it exactly
template <int PC>
inline void causal_block_sums16(const CausalArgs<float>& A, const float* pih, int64_t b, int64_t h, int64_t n0,
                                int64_t n1, const double* e0, const double* q0, double M, double* Eb, double* Qb,
                                double* Mb, int64_t ld, int64_t ldm, int64_t PFD) {
  constexpr int K = PC / 16;
  constexpr int64_t RB = PC * int64_t(sizeof(float));
  __m512d e[2 * K], q[2 * K];
#pragma GCC unroll 8
  for (int k = 0; k < 2 * K; ++k) {
    e[k] = _mm512_loadu_pd(e0 + 8 * k);
    q[k] = _mm512_loadu_pd(q0 + 8 * k);
  }
  for (int64_t nb = n0, kb = 0; nb < n1; nb += BLK, ++kb) {
#pragma GCC unroll 8
    for (int k = 0; k < 2 * K; ++k) {
      _mm512_storeu_pd(Eb + kb * ld + 8 * k, e[k]);
      _mm512_storeu_pd(Qb + kb * ld + 8 * k, q[k]);
    }
    Mb[kb * ldm] = M;
    for (int64_t n = nb; n < std::min(n1, nb + BLK); ++n) {
      prefetch_row(A.W.row(b, h, std::min(n + PFD, A.N - 1)), RB);
      if (!A.kept(b, n)) continue;
      const float* __restrict x = A.W.row(b, h, n);
      const float pv = pih[n];
      M += double(pv);
      const __m512 vp = _mm512_set1_ps(pv);
#pragma GCC unroll 8
      for (int k = 0; k < K; ++k) {
        const __m512 xv = _mm512_loadu_ps(x + 16 * k), x2 = _mm512_mul_ps(xv, xv);
        add16_pd(e + 2 * k, x2);
        add16_pd(q + 2 * k, _mm512_mul_ps(vp, x2));
      }
    }
  }
}

// Forward recompute of one head's tokens [n0, n1) from the running sums before n0 (e0, q0, M): per kept
// token i = n - n0, cs[i] = c = 1 / (M + 1e-8) and, per feature, iE = 1 / E (-1e12 where E <= 1e-12),
// own = B / E^2 (1e12 where clamped, B = E - w^2 the exclusive prefix) and d = Q c.
template <int PC>
inline void causal_recompute16(const CausalArgs<float>& A, const float* pih, int64_t b, int64_t h, int64_t n0,
                               int64_t n1, const double* e0, const double* q0, double M, double* cs, float* iE,
                               float* own, float* sd) {
  constexpr int K = PC / 16;
  __m512d e[2 * K], q[2 * K];
#pragma GCC unroll 8
  for (int k = 0; k < 2 * K; ++k) {
    e[k] = _mm512_loadu_pd(e0 + 8 * k);
    q[k] = _mm512_loadu_pd(q0 + 8 * k);
  }
  const __m512 one = _mm512_set1_ps(1.f), clamped_ie = _mm512_set1_ps(float(-1.0 / RATIO_EPS)),
               clamped_own = _mm512_set1_ps(float(1.0 / RATIO_EPS));
  const __m512d eps = _mm512_set1_pd(RATIO_EPS);
  __m512 ef[K];  // float(E) before the token (B), then after it
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) ef[k] = cvt16_ps(e[2 * k], e[2 * k + 1]);
  for (int64_t n = n0; n < n1; ++n) {
    if (!A.kept(b, n)) continue;
    const int64_t i = n - n0;
    const float* __restrict x = A.W.row(b, h, n);
    const float pv = pih[n];
    M += double(pv);
    const double cc = 1.0 / (M + PI_EPS);
    cs[i] = cc;
    const __m512 vp = _mm512_set1_ps(pv);
    const __m512d vc = _mm512_set1_pd(cc);
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      const __m512 xv = _mm512_loadu_ps(x + 16 * k), x2 = _mm512_mul_ps(xv, xv);
      const __m512 before = ef[k];
      add16_pd(e + 2 * k, x2);
      add16_pd(q + 2 * k, _mm512_mul_ps(vp, x2));
      const __mmask16 live = __mmask16(_mm512_cmp_pd_mask(e[2 * k], eps, _CMP_GT_OQ) |
                                       (unsigned(_mm512_cmp_pd_mask(e[2 * k + 1], eps, _CMP_GT_OQ)) << 8));
      ef[k] = cvt16_ps(e[2 * k], e[2 * k + 1]);
      const __m512 inv = _mm512_div_ps(one, ef[k]);
      const int64_t o = i * PC + 16 * k;
      _mm512_storeu_ps(iE + o, _mm512_mask_blend_ps(live, clamped_ie, inv));
      const __m512 ow = _mm512_mul_ps(_mm512_mul_ps(before, inv), inv);
      _mm512_storeu_ps(own + o, _mm512_mask_blend_ps(live, clamped_own, ow));
      _mm512_storeu_ps(sd + o, cvt16_ps(_mm512_mul_pd(q[2 * k], vc), _mm512_mul_pd(q[2 * k + 1], vc)));
    }
  }
}

// First step of the sweep on one head's block [nb, ne) (<= BLK tokens), last token first, with the
// recomputed iE, d, c of the block's tokens (index n - nb): per kept token, with g = 1 / (1 + d),
//   U += c g Pi g w G (u, double), up = U Pi, pg = Pi g G (rows, for the dw step),
//   V -= c sum_j g Pi g w G d, Pg = sum_j U w^2 - sum_j g w G + V + gPi, Rs = sum_j w^2 |iE| + lb
// (Pg, Rs: 0 at padded tokens and past ne). The three float sums over features of the 16 tokens
// are reduced together (hsum16), sum_j U w^2 in double per token.
template <int PC>
inline void causal_dpi16(const Rows<const float>& W, const Rows<const float>& G, const bool* mk, int64_t N,
                         int64_t b, int64_t h, int64_t nb, int64_t ne, const float* pih, const float* gpih,
                         const float* lbh, const float* iE, const float* sd, const double* cs, float* up, float* pg,
                         double* u, double* V, double* Pg, double* Rs, int64_t PFD) {
  constexpr int K = PC / 16;
  constexpr int64_t RB = PC * int64_t(sizeof(float));
  static_assert(BLK == 16, "hsum16 reduces one block of 16 tokens");
  __m512d uv[2 * K];
#pragma GCC unroll 8
  for (int k = 0; k < 2 * K; ++k) uv[k] = _mm512_loadu_pd(u + 8 * k);
  __m512 sdm[16], san[16], srs[16];
  double ue[16];
  for (int64_t i = ne - nb; i < BLK; ++i) {
    const int64_t slot = 4 * (i % 4) + i / 4;
    sdm[slot] = san[slot] = srs[slot] = _mm512_setzero_ps();
  }
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t n = ne - 1; n >= nb; --n) {
    const int64_t i = n - nb, slot = 4 * (i % 4) + i / 4;
    prefetch_row(W.row(b, h, std::max<int64_t>(n - PFD, 0)), RB);
    prefetch_row(G.row(b, h, std::max<int64_t>(n - PFD, 0)), RB);
    if (mk && !mk[b * N + n]) {
      sdm[slot] = san[slot] = srs[slot] = _mm512_setzero_ps();
      continue;
    }
    const float* __restrict x = W.row(b, h, n);
    const float* __restrict gr = G.row(b, h, n);
    const __m512 vp = _mm512_set1_ps(pih[n]), ct = _mm512_set1_ps(float(cs[i]));
    __m512 dmv = _mm512_setzero_ps(), anv = _mm512_setzero_ps(), rsv = _mm512_setzero_ps();
    __m512d uev = _mm512_setzero_pd();
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      const int64_t o = i * PC + 16 * k;
      const __m512 xv = _mm512_loadu_ps(x + 16 * k), gv = _mm512_loadu_ps(gr + 16 * k);
      const __m512 dv = _mm512_loadu_ps(sd + o), iev = _mm512_loadu_ps(iE + o);
      const __m512 g = _mm512_div_ps(one, _mm512_add_ps(one, dv));
      const __m512 gxg = _mm512_mul_ps(_mm512_mul_ps(g, xv), gv);
      const __m512 gp = _mm512_mul_ps(g, vp);
      add16_pd(uv + 2 * k, _mm512_mul_ps(_mm512_mul_ps(ct, gp), gxg));
      _mm512_storeu_ps(up + o, _mm512_mul_ps(cvt16_ps(uv[2 * k], uv[2 * k + 1]), vp));
      _mm512_storeu_ps(pg + o, _mm512_mul_ps(gp, gv));
      dmv = _mm512_fmadd_ps(_mm512_mul_ps(gp, gxg), dv, dmv);
      anv = _mm512_add_ps(anv, gxg);
      const __m512 x2 = _mm512_mul_ps(xv, xv);
      rsv = _mm512_fmadd_ps(x2, _mm512_abs_ps(iev), rsv);
      __m512d x2d[2];
      cvt16_pd(x2, x2d);
      uev = _mm512_fmadd_pd(uv[2 * k], x2d[0], uev);
      uev = _mm512_fmadd_pd(uv[2 * k + 1], x2d[1], uev);
    }
    sdm[slot] = dmv;
    san[slot] = anv;
    srs[slot] = rsv;
    ue[i] = _mm512_reduce_add_pd(uev);
  }
#pragma GCC unroll 8
  for (int k = 0; k < 2 * K; ++k) _mm512_storeu_pd(u + 8 * k, uv[k]);
  alignas(64) float dms[16], ans[16], rss[16];
  _mm512_store_ps(dms, hsum16(sdm));
  _mm512_store_ps(ans, hsum16(san));
  _mm512_store_ps(rss, hsum16(srs));
  double v = *V;
  for (int64_t i = BLK - 1; i >= 0; --i) {
    const int64_t n = nb + i;
    if (n >= ne || (mk && !mk[b * N + n])) {
      Pg[i] = Rs[i] = 0.0;
      continue;
    }
    v -= cs[i] * double(dms[i]);
    Pg[i] = ue[i] - double(ans[i]) + v + (gpih ? double(gpih[n]) : 0.0);
    Rs[i] = double(rss[i]) + (lbh ? double(lbh[n]) : 0.0);
  }
  *V = v;
}

// Softmax step of the sweep on the block [nb, ne), all heads, 16 tokens per double vector pair:
// Lam = Pi (Pg - sum_heads Pi Pg) (0 at padded tokens), aT[h] += sum_n Lam Rs (dL/dtemp),
// lam = temp Lam into dlb. pi, dlb: the batch row's (H, N); Pg, Rs: [h * BLK + token].
inline void causal_lambda16(const bool* mk, int64_t N, int64_t H, int64_t b, int64_t nb, int64_t ne, const float* pi,
                            const float* temp, const double* Pg, const double* Rs, double* aT, float* dlb) {
  const int64_t cnt = ne - nb;
  const __mmask16 in = __mmask16((1u << cnt) - 1u);
  __mmask8 kb[2];
  kept_halves16(mk, N, b, nb, cnt, kb);
  __m512d mean[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
  for (int64_t h = 0; h < H; ++h) {
    __m512d pv[2];
    cvt16_pd(_mm512_maskz_loadu_ps(in, pi + h * N + nb), pv);
    for (int u = 0; u < 2; ++u) mean[u] = _mm512_fmadd_pd(pv[u], _mm512_loadu_pd(Pg + h * BLK + 8 * u), mean[u]);
  }
  for (int64_t h = 0; h < H; ++h) {
    __m512d pv[2], L[2], lt = _mm512_setzero_pd();
    cvt16_pd(_mm512_maskz_loadu_ps(in, pi + h * N + nb), pv);
    const __m512d th = _mm512_set1_pd(double(temp[h]));
    for (int u = 0; u < 2; ++u) {
      L[u] = _mm512_maskz_mul_pd(kb[u], pv[u], _mm512_sub_pd(_mm512_loadu_pd(Pg + h * BLK + 8 * u), mean[u]));
      lt = _mm512_fmadd_pd(L[u], _mm512_loadu_pd(Rs + h * BLK + 8 * u), lt);
    }
    aT[h] += _mm512_reduce_add_pd(lt);
    _mm512_mask_storeu_ps(dlb + h * N + nb, in, cvt16_ps(_mm512_mul_pd(th, L[0]), _mm512_mul_pd(th, L[1])));
  }
}

// dw step of the sweep on one head's block [nb, ne), last token first: with W (wv, double) the sum
// of dL/dE over the later tokens, dw = 2 w (up + lam own + W) - pg, then W += -lam w^2 iE^2 where
// E is not clamped (0 rows at padded tokens)
template <int PC>
inline void causal_dw16(const Rows<const float>& W, Rows<float> DW, const bool* mk, int64_t N, int64_t b, int64_t h,
                        int64_t nb, int64_t ne, const float* lamh, const float* iE, const float* own, const float* up,
                        const float* pg, double* wvp, bool stream) {
  constexpr int K = PC / 16;
  __m512d wv[2 * K];
#pragma GCC unroll 8
  for (int k = 0; k < 2 * K; ++k) wv[k] = _mm512_loadu_pd(wvp + 8 * k);
  const __m512 two = _mm512_set1_ps(2.f);
  for (int64_t n = ne - 1; n >= nb; --n) {
    float* y = DW.row(b, h, n);
    if (mk && !mk[b * N + n]) {
#pragma GCC unroll 8
      for (int k = 0; k < K; ++k) store_row16(y + 16 * k, _mm512_setzero_ps(), stream);
      continue;
    }
    const int64_t i = n - nb;
    const float* __restrict x = W.row(b, h, n);
    const __m512 vl = _mm512_set1_ps(lamh[n]), vn = _mm512_set1_ps(-lamh[n]);
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      const int64_t o = i * PC + 16 * k;
      const __m512 xv = _mm512_loadu_ps(x + 16 * k), iev = _mm512_loadu_ps(iE + o);
      const __m512 later = cvt16_ps(wv[2 * k], wv[2 * k + 1]);
      const __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(vn, xv), xv), iev), iev);
      add16_pd(wv + 2 * k, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(iev, _mm512_setzero_ps(), _CMP_GT_OQ), t));
      const __m512 c = _mm512_add_ps(_mm512_fmadd_ps(vl, _mm512_loadu_ps(own + o), _mm512_loadu_ps(up + o)), later);
      store_row16(y + 16 * k, _mm512_fmsub_ps(_mm512_mul_ps(two, xv), c, _mm512_loadu_ps(pg + o)), stream);
    }
  }
#pragma GCC unroll 8
  for (int k = 0; k < 2 * K; ++k) _mm512_storeu_pd(wvp + 8 * k, wv[k]);
}

// Chunk sums of the per-chunk schedule's first pass for one head's tokens [n0, n1) from the chunk's
// checkpoint (q0, M): with d = Q c, g = 1 / (1 + d), D = g^2 w Pi G, u += c D (double) and the
// return value sum_n -c sum_j D d
template <int PC>
inline double causal_chunk_sums16(const Rows<const float>& W, const Rows<const float>& G, const bool* mk, int64_t N,
                                  int64_t b, int64_t h, int64_t n0, int64_t n1, const float* pih, const double* q0,
                                  double M, double* u, int64_t PFD) {
  constexpr int K = PC / 16;
  constexpr int64_t RB = PC * int64_t(sizeof(float));
  __m512d q[2 * K], uv[2 * K];
#pragma GCC unroll 8
  for (int k = 0; k < 2 * K; ++k) {
    q[k] = _mm512_loadu_pd(q0 + 8 * k);
    uv[k] = _mm512_setzero_pd();
  }
  const __m512 one = _mm512_set1_ps(1.f);
  double am = 0.0;
  for (int64_t n = n0; n < n1; ++n) {
    prefetch_row(W.row(b, h, std::min(n + PFD, N - 1)), RB);
    prefetch_row(G.row(b, h, std::min(n + PFD, N - 1)), RB);
    if (mk && !mk[b * N + n]) continue;
    const float* __restrict x = W.row(b, h, n);
    const float* __restrict gr = G.row(b, h, n);
    const float pv = pih[n];
    M += double(pv);
    const double cc = 1.0 / (M + PI_EPS);
    const __m512 vp = _mm512_set1_ps(pv), ct = _mm512_set1_ps(float(cc));
    const __m512d vc = _mm512_set1_pd(cc);
    __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      const __m512 xv = _mm512_loadu_ps(x + 16 * k);
      add16_pd(q + 2 * k, _mm512_mul_ps(vp, _mm512_mul_ps(xv, xv)));
      const __m512 d = cvt16_ps(_mm512_mul_pd(q[2 * k], vc), _mm512_mul_pd(q[2 * k + 1], vc));
      const __m512 g = _mm512_div_ps(one, _mm512_add_ps(one, d));
      const __m512 D = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(g, g), xv), vp),
                                     _mm512_loadu_ps(gr + 16 * k));
      add16_pd(uv + 2 * k, _mm512_mul_ps(ct, D));
      acc = _mm512_fmadd_ps(D, d, acc);
    }
    am -= cc * double(_mm512_reduce_add_ps(acc));
  }
#pragma GCC unroll 8
  for (int k = 0; k < 2 * K; ++k) _mm512_storeu_pd(u + 8 * k, uv[k]);
  return am;
}
#endif

template <typename T, int PC>
void causal_bwd_impl(const CausalArgs<T>& A, const CausalGrads<T>& Z, const double* gE, const double* gQ,
                     const double* gM, Rows<T> DW, bool stream, T* dlb, double* dtemp, bool per_sequence) {
  const int64_t B = A.B, H = A.H, N = A.N, P = PC > 0 ? PC : A.P, nc = A.nc, CHUNK = A.CHUNK, HP = H * P;
  const int64_t RB = P * int64_t(sizeof(T)), PFD = prefetch_distance(RB);
  auto ck = [&](const double* base, int64_t b, int64_t c, int64_t len) { return base + (b * (nc + 1) + c) * len; };
  auto piv = [&](int64_t b, int64_t h, int64_t n) { return Z.pi[(b * H + h) * N + n]; };

  // scratch of one chunk, [h][token] rows: iE = 1 / max(E, 1e-12) (negative where clamped), d = Q c,
  // own = B / E^2 (1 / 1e-12 where clamped: the gradient of the token's own ratio); c; and of one
  // block, per token: U Pi (up) and Pi g G (pg), the terms of dw known before lambda, dL/dPi (Pg) and
  // the logit over temp (Rs)
  // (float rows of 32 / 48 / 64 features, kFastRows: iE, d, own, c only of one block, recomputed
  // block by block from the running sums at each block start, Eb, Qb, Mb ([block][h] rows), so that
  // a block's scratch stays in L2)
  struct Scratch {
    std::vector<T> iE, d, own, up, pg;
    std::vector<double> c, Pg, Rs, Eb, Qb, Mb;
  };
  auto scratch = [&]() {
    const int64_t rows = kFastRows<T, PC> ? BLK : CHUNK, nbk = kFastRows<T, PC> ? (CHUNK + BLK - 1) / BLK : 0;
    return Scratch{std::vector<T>(rows * HP),     std::vector<T>(rows * HP),     std::vector<T>(rows * HP),
                   std::vector<T>(BLK * HP),      std::vector<T>(BLK * HP),      std::vector<double>(rows * H),
                   std::vector<double>(BLK * H),  std::vector<double>(BLK * H),  std::vector<double>(nbk * HP),
                   std::vector<double>(nbk * HP), std::vector<double>(nbk * H)};
  };
  auto recompute = [&](Scratch& S, int64_t b, int64_t c, int64_t n0, int64_t n1) {
    Buf<double, PC> eb(P), qb(P);
    for (int64_t h = 0; h < H; ++h) {
      double* __restrict e = eb.data();
      double* __restrict q = qb.data();
      std::copy(ck(Z.Ec, b, c, HP) + h * P, ck(Z.Ec, b, c, HP) + (h + 1) * P, e);
      std::copy(ck(Z.Qc, b, c, HP) + h * P, ck(Z.Qc, b, c, HP) + (h + 1) * P, q);
      double M = ck(Z.Mc, b, c, H)[h];
      for (int64_t n = n0; n < n1; ++n) {
        PREFETCH_ROW(A.W, b, h, n);
        if (!A.kept(b, n)) continue;
        const int64_t i = h * CHUNK + (n - n0);
        const T* __restrict x = A.W.row(b, h, n);
        const T pv = piv(b, h, n);
        M += double(pv);
        const double cc = 1.0 / (M + PI_EPS);
        S.c[i] = cc;
        T* __restrict ie = S.iE.data() + i * P;
        T* __restrict sd = S.d.data() + i * P;
        T* __restrict ow = S.own.data() + i * P;
#pragma omp simd
        for (int64_t j = 0; j < P; ++j) {
          const T x2 = x[j] * x[j];
          const double before = e[j];
          e[j] += double(x2);
          q[j] += double(pv * x2);
          const bool live = e[j] > RATIO_EPS;
          const T inv = T(1) / T(e[j]);
          ie[j] = live ? inv : T(-1.0 / RATIO_EPS);
          ow[j] = live ? T(before) * inv * inv : T(1.0 / RATIO_EPS);
          sd[j] = T(q[j] * cc);
        }
      }
    }
  };

  // chunk `it`, backwards: on entry U (HP), V (H), Wv (HP) hold the sums over the tokens after the
  // chunk, on return those from its first token; writes lambda (dlb), the chunk's share of dtemp
  // (pT) and dw (with the W of the chunk's own later tokens and Wv's entry value)
  std::vector<double> pT(B * nc * H);
  auto sweep = [&](Scratch& S, RowWriter<T, PC>& wr, int64_t it, double* U, double* V, double* Wv) {
    const int64_t b = it / nc, c = it % nc, n0 = c * CHUNK, n1 = std::min(N, n0 + CHUNK);
    double* aT = pT.data() + it * H;
    std::fill(aT, aT + H, 0.0);
    const int64_t nblk = (n1 - n0 + BLK - 1) / BLK;
#if defined(__AVX512F__)
    if constexpr (kFastRows<T, PC>) {
      const float* pib = Z.pi + b * H * N;
      for (int64_t h = 0; h < H; ++h)
        causal_block_sums16<PC>(A, pib + h * N, b, h, n0, n1, ck(Z.Ec, b, c, HP) + h * P,
                                ck(Z.Qc, b, c, HP) + h * P, ck(Z.Mc, b, c, H)[h], S.Eb.data() + h * P,
                                S.Qb.data() + h * P, S.Mb.data() + h, HP, H, PFD);
      for (int64_t kb = nblk - 1; kb >= 0; --kb) {
        const int64_t nb = n0 + kb * BLK, ne = std::min(n1, nb + BLK);
        for (int64_t h = 0; h < H; ++h) {
          const int64_t bh = b * H + h, o = h * BLK;
          causal_recompute16<PC>(A, pib + h * N, b, h, nb, ne, S.Eb.data() + kb * HP + h * P,
                                 S.Qb.data() + kb * HP + h * P, S.Mb[kb * H + h], S.c.data() + o,
                                 S.iE.data() + o * P, S.own.data() + o * P, S.d.data() + o * P);
          causal_dpi16<PC>(A.W, Z.G, A.mk, N, b, h, nb, ne, Z.pi + bh * N, Z.gpi ? Z.gpi + bh * N : nullptr,
                           A.lb ? A.lb + bh * N : nullptr, S.iE.data() + o * P, S.d.data() + o * P, S.c.data() + o,
                           S.up.data() + h * BLK * P, S.pg.data() + h * BLK * P, U + h * P, V + h,
                           S.Pg.data() + h * BLK, S.Rs.data() + h * BLK, PFD);
        }
        causal_lambda16(A.mk, N, H, b, nb, ne, pib, A.temp, S.Pg.data(), S.Rs.data(), aT, dlb + b * H * N);
        for (int64_t h = 0; h < H; ++h) {
          const int64_t o = h * BLK;
          causal_dw16<PC>(A.W, DW, A.mk, N, b, h, nb, ne, dlb + (b * H + h) * N, S.iE.data() + o * P,
                          S.own.data() + o * P, S.up.data() + h * BLK * P, S.pg.data() + h * BLK * P, Wv + h * P,
                          wr.stream);
        }
      }
      return;
    }
#endif
    recompute(S, b, c, n0, n1);
    Buf<T, PC> v1(P), v2(P), v3(P);
    Buf<double, PC> v4(P);
    for (int64_t kb = nblk - 1; kb >= 0; --kb) {
      const int64_t nb = n0 + kb * BLK, ne = std::min(n1, nb + BLK);
      // dL/dPi (into Pg) and the logits over temp (Rs) for every head; U and V run backwards
      for (int64_t h = 0; h < H; ++h) {
        double* __restrict u = U + h * P;
        for (int64_t n = ne - 1; n >= nb; --n) {
          const int64_t k = h * BLK + (n - nb), i = h * CHUNK + (n - n0);
          prefetch_row(A.W.row(b, h, std::max<int64_t>(n - PFD, 0)), RB);
          prefetch_row(Z.G.row(b, h, std::max<int64_t>(n - PFD, 0)), RB);
          if (!A.kept(b, n)) {
            S.Pg[k] = S.Rs[k] = 0.0;
            continue;
          }
          const T* __restrict x = A.W.row(b, h, n);
          const T* __restrict gr = Z.G.row(b, h, n);
          const T* __restrict ie = S.iE.data() + i * P;
          const T* __restrict sd = S.d.data() + i * P;
          T* __restrict up = S.up.data() + k * P;
          T* __restrict pg = S.pg.data() + k * P;
          const T pv = piv(b, h, n);
          const double cc = S.c[i];
          const T ct = T(cc);
          T* an_ = v1.data();
          T* dm_ = v2.data();
          T* rs_ = v3.data();
          double* ue_ = v4.data();
#pragma omp simd
          for (int64_t j = 0; j < P; ++j) {
            const T x2 = x[j] * x[j], g = T(1) / (T(1) + sd[j]);
            const T gxg = g * x[j] * gr[j];
            u[j] += double(ct * g * pv * gxg);
            up[j] = T(u[j]) * pv;
            pg[j] = pv * g * gr[j];
            dm_[j] = g * pv * gxg * sd[j];
            an_[j] = gxg;
            ue_[j] = u[j] * double(x2);
            rs_[j] = x2 * std::abs(ie[j]);
          }
          V[h] -= cc * double(row_sum<T, PC>(dm_, P));
          S.Pg[k] = row_sum<double, PC>(ue_, P) - double(row_sum<T, PC>(an_, P)) + V[h] +
                    (Z.gpi ? double(Z.gpi[(b * H + h) * N + n]) : 0.0);
          S.Rs[k] = double(row_sum<T, PC>(rs_, P)) + (A.lb ? double(A.lb[(b * H + h) * N + n]) : 0.0);
        }
      }
      // softmax over heads
      for (int64_t n = nb; n < ne; ++n) {
        const bool kp = A.kept(b, n);
        double mean = 0.0;
        for (int64_t h = 0; h < H; ++h) mean += double(piv(b, h, n)) * S.Pg[h * BLK + (n - nb)];
        for (int64_t h = 0; h < H; ++h) {
          const double Lam = kp ? double(piv(b, h, n)) * (S.Pg[h * BLK + (n - nb)] - mean) : 0.0;
          aT[h] += Lam * S.Rs[h * BLK + (n - nb)];
          dlb[(b * H + h) * N + n] = T(double(A.temp[h]) * Lam);
        }
      }
      // dw; W (dL/dE of the later tokens) runs backwards
      for (int64_t h = 0; h < H; ++h) {
        double* __restrict wv = Wv + h * P;
        for (int64_t n = ne - 1; n >= nb; --n) {
          T* y = DW.row(b, h, n);
          if (!A.kept(b, n)) {
            wr.zero(y, P);
            continue;
          }
          const int64_t k = h * BLK + (n - nb), i = h * CHUNK + (n - n0);
          const T* __restrict x = A.W.row(b, h, n);
          const T* __restrict ie = S.iE.data() + i * P;
          const T* __restrict own = S.own.data() + i * P;
          const T* __restrict up = S.up.data() + k * P;
          const T* __restrict pg = S.pg.data() + k * P;
          const T lam = dlb[(b * H + h) * N + n];
          wr.put(y, P, [&](int64_t j) {
            const T later = T(wv[j]);
            wv[j] += ie[j] > T(0) ? double(-lam * x[j] * x[j] * ie[j] * ie[j]) : 0.0;
            return T(2) * x[j] * (up[j] + lam * own[j] + later) - pg[j];
          });
        }
      }
    }
  };

  Phases ph;
  if (per_sequence) {
    ph.next("causal_bwd: reverse sweep per sequence (read w, G, write dw)");
    at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
      Scratch S = scratch();
      RowWriter<T, PC> wr(stream, P);
      std::vector<double> U(HP), V(H), Wv(HP);
      for (int64_t b = lo; b < hi; ++b) {
        auto init = [&](std::vector<double>& v, const double* g0, int64_t len) {
          for (int64_t k = 0; k < len; ++k) v[k] = g0 ? g0[b * len + k] : 0.0;
        };
        init(U, gQ, HP);
        init(V, gM, H);
        init(Wv, gE, HP);
        for (int64_t c = nc - 1; c >= 0; --c) sweep(S, wr, b * nc + c, U.data(), V.data(), Wv.data());
      }
    });
    reduce_chunks(pT, dtemp, B, nc, H);
    return;
  }

  ph.next("causal_bwd: chunk sums of dL/dQ, dL/dM (read w, G)");
  // pass 1: chunk sums of dL/dQ and dL/dM (no coupling between heads: head by head)
  std::vector<double> pQ(B * nc * HP), pM(B * nc * H);
  at::parallel_for(0, B * nc, 1, [&](int64_t lo, int64_t hi) {
    Buf<T, PC> vb(P);
    Buf<double, PC> qb(P);
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t b = it / nc, c = it % nc, n0 = c * CHUNK, n1 = std::min(N, n0 + CHUNK);
      for (int64_t h = 0; h < H; ++h) {
#if defined(__AVX512F__)
        if constexpr (kFastRows<T, PC>) {
          pM[it * H + h] = causal_chunk_sums16<PC>(A.W, Z.G, A.mk, N, b, h, n0, n1, Z.pi + (b * H + h) * N,
                                                   ck(Z.Qc, b, c, HP) + h * P, ck(Z.Mc, b, c, H)[h],
                                                   pQ.data() + it * HP + h * P, PFD);
          continue;
        }
#endif
        double* __restrict q = qb.data();
        std::copy(ck(Z.Qc, b, c, HP) + h * P, ck(Z.Qc, b, c, HP) + (h + 1) * P, q);
        double M = ck(Z.Mc, b, c, H)[h], am = 0.0;
        double* __restrict u = pQ.data() + it * HP + h * P;
        std::fill(u, u + P, 0.0);
        for (int64_t n = n0; n < n1; ++n) {
          PREFETCH_ROW(A.W, b, h, n);
          PREFETCH_ROW(Z.G, b, h, n);
          if (!A.kept(b, n)) continue;
          const T* __restrict x = A.W.row(b, h, n);
          const T* __restrict gr = Z.G.row(b, h, n);
          const T pv = piv(b, h, n);
          M += double(pv);
          const double cc = 1.0 / (M + PI_EPS);
          const T ct = T(cc);
          T* v = vb.data();
#pragma omp simd
          for (int64_t j = 0; j < P; ++j) {
            const T x2 = x[j] * x[j];
            q[j] += double(pv * x2);
            const T d = T(q[j] * cc), g = T(1) / (T(1) + d);
            const T Dj = g * g * x[j] * pv * gr[j];
            u[j] += double(ct * Dj);
            v[j] = Dj * d;
          }
          am -= cc * double(row_sum<T, PC>(v, P));
        }
        pM[it * H + h] = am;
      }
    }
  });
  // suffix sums: the value after chunk c (tokens of later chunks + the state gradients)
  auto suffix = [&](const std::vector<double>& pt, const double* g0, std::vector<double>& off, int64_t len) {
    off.assign(B * nc * len, 0.0);
    std::vector<double> run(len);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t k = 0; k < len; ++k) run[k] = g0 ? g0[b * len + k] : 0.0;
      for (int64_t c = nc - 1; c >= 0; --c) {
        std::copy(run.begin(), run.end(), off.begin() + (b * nc + c) * len);
        const double* s = pt.data() + (b * nc + c) * len;
        for (int64_t k = 0; k < len; ++k) run[k] += s[k];
      }
    }
  };
  std::vector<double> Uoff, Voff, Woff;
  suffix(pQ, gQ, Uoff, HP);
  suffix(pM, gM, Voff, H);
  ph.next("causal_bwd: reverse sweep per chunk (read w, G, write dw)");
  // pass 2: every chunk swept with W starting at 0: its sum of dL/dE is W on return
  std::vector<double> pE(B * nc * HP, 0.0);
  at::parallel_for(0, B * nc, 1, [&](int64_t lo, int64_t hi) {
    Scratch S = scratch();
    RowWriter<T, PC> wr(false, P);  // dw is read again below
    for (int64_t it = lo; it < hi; ++it)
      sweep(S, wr, it, Uoff.data() + it * HP, Voff.data() + it * H, pE.data() + it * HP);
  });
  suffix(pE, gE, Woff, HP);
  reduce_chunks(pT, dtemp, B, nc, H);
  ph.next("causal_bwd: dw += 2 w W (read w, dw, write dw)");
  // pass 3: dw += 2 w W, W at the chunk's end
  at::parallel_for(0, B * nc, 1, [&](int64_t lo, int64_t hi) {
    Buf<T, PC> wb(P);
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t b = it / nc, c = it % nc, n0 = c * CHUNK, n1 = std::min(N, n0 + CHUNK);
      for (int64_t h = 0; h < H; ++h) {
        T* __restrict w2 = wb.data();
        for (int64_t j = 0; j < P; ++j) w2[j] = T(2.0 * Woff[it * HP + h * P + j]);
        for (int64_t n = n0; n < n1; ++n) {
          PREFETCH_ROW(A.W, b, h, n);
          if (!A.kept(b, n)) continue;
          const T* __restrict x = A.W.row(b, h, n);
          T* __restrict y = DW.row(b, h, n);
#pragma omp simd
          for (int64_t j = 0; j < P; ++j) y[j] += x[j] * w2[j];
        }
      }
    }
  });
}

std::vector<at::Tensor> causal_bwd(const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_pi,
                                   const c10::optional<at::Tensor>& grad_E, const c10::optional<at::Tensor>& grad_Q,
                                   const c10::optional<at::Tensor>& grad_M, const at::Tensor& w,
                                   const at::Tensor& temp, const c10::optional<at::Tensor>& lb,
                                   const c10::optional<at::Tensor>& mask, const at::Tensor& pi, const at::Tensor& Ec,
                                   const at::Tensor& Qc, const at::Tensor& Mc, int64_t mode, int64_t chunk) {
  check_common(w, temp, mask);
  const int64_t B = w.size(0), H = w.size(1), N = w.size(2), P = w.size(3), CHUNK = pick_chunk(chunk),
                nc = nchunks(N, CHUNK);
  check_like(grad_out, w, "grad_out");
  check_small(pi, {B, H, N}, w.scalar_type(), "pi");
  check_small(Ec, {B, nc + 1, H, P}, at::kDouble, "E checkpoints");
  check_small(Qc, {B, nc + 1, H, P}, at::kDouble, "Q checkpoints");
  check_small(Mc, {B, nc + 1, H}, at::kDouble, "M checkpoints");
  if (grad_pi.has_value()) check_small(*grad_pi, {B, H, N}, w.scalar_type(), "grad_pi");
  auto state_grad = [&](const c10::optional<at::Tensor>& t, at::IntArrayRef shape, const char* name) -> const double* {
    if (!t.has_value()) return nullptr;
    check_small(*t, shape, at::kDouble, name);
    return t->data_ptr<double>();
  };
  const double* gE = state_grad(grad_E, {B, H, P}, "grad of sum_sq");
  const double* gQ = state_grad(grad_Q, {B, H, P}, "grad of sum_sq_pi");
  const double* gM = state_grad(grad_M, {B, H}, "grad of sum_pi");
  auto dw = at::empty_like(w);
  auto dlb = at::empty({B, H, N}, w.options());
  auto dtemp = at::empty({B, H}, w.options().dtype(at::kDouble));
  // mode 1: one reverse sweep per sequence (parallel over the batch); 0: chunks in parallel (an
  // extra read of w and G, and one of dw); -1: per sequence when the batch keeps every thread busy
  const bool per_sequence = mode == 1 || (mode < 0 && B >= at::get_num_threads());
  AT_DISPATCH_FLOATING_TYPES(w.scalar_type(), "causal_bwd", [&] {
    using T = scalar_t;
    const CausalArgs<T> A = causal_args<T>(w, temp, lb, mask, CHUNK);
    const CausalGrads<T> Z{rows_of<const T>(grad_out, "grad_out"),
                           grad_pi.has_value() ? grad_pi->data_ptr<T>() : nullptr,
                           pi.data_ptr<T>(),
                           Ec.data_ptr<double>(),
                           Qc.data_ptr<double>(),
                           Mc.data_ptr<double>()};
    with_p(P, [&](auto pc) {
      constexpr int PC = decltype(pc)::value;
      causal_bwd_impl<T, PC>(A, Z, gE, gQ, gM, rows_of<T>(dw, "grad_w"), want_stream<T, PC>(dw), dlb.data_ptr<T>(),
                             dtemp.data_ptr<double>(), per_sequence);
    });
  });
  return {dw, dlb, dtemp};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tssa_fwd", &tssa_fwd, "fused TSSA forward -> (out, pi, s, T, M, rows past SAFE_MAX)");
  m.def("tssa_bwd", &tssa_bwd, "fused TSSA backward -> (grad_w, grad_temp per (b, h))");
  m.def("causal_fwd", &causal_fwd, "fused causal TSSA forward -> (out, pi, E, Q, M checkpoints, rows past SAFE_MAX)");
  m.def("causal_bwd", &causal_bwd, "fused causal TSSA backward -> (grad_w, grad_logit_bias, grad_temp per (b, h))");
  m.def("set_stream_min_bytes", [](int64_t v) { stream_min.store(v); },
        "outputs of at least this many bytes use non-temporal stores (-1: half the last-level cache)");
  m.attr("DEFAULT_CHUNK") = DEFAULT_CHUNK;
}
