// cuda_emul.h -- run plain CUDA C++ kernels on the CPU, for tests.
//
// The prelude the emulation harness (tests/emulator/harness.py) force-includes
// in front of the EXACT generated .cu source that CuPy/NVRTC compiles; the
// source itself is never edited.  Compile with
//   g++ -std=c++20 -Og -pthread -fPIC -fno-extern-tls-init -fno-strict-aliasing
//
// Execution model
//   * A launch runs its blocks on a few OS worker threads (one block at a time
//     per worker).  Inside a block every CUDA thread is a fiber with its own
//     stack; fibers are scheduled cooperatively, round-robin, and switch only at
//     synchronisation points (__syncthreads, warp shuffles, __syncwarp,
//     ballots).  So the threads of a block really run "concurrently" with
//     respect to each other (a thread that waits at a barrier lets the others
//     run), and __syncthreads is a real barrier.
//   * Warp intrinsics are a warp-level rendezvous: each lane deposits its
//     value and waits until every lane named in the mask has arrived; the
//     last one to arrive computes every lane's result (PTX shfl.sync
//     semantics, including `width`).
//   * __shared__ expands to thread_local: a block-scope `__shared__ T a[N]` is
//     then a static thread-local, i.e. one copy per worker thread, and each
//     worker runs one block at a time, so it is per block.  `extern __shared__`
//     (dynamic shared memory) becomes `extern thread_local`; the harness
//     defines those symbols as aliases of one per-thread arena (so, as on the
//     GPU, all extern __shared__ arrays share one address).  Before each block
//     the arena and every static __shared__ variable the harness can see are
//     filled with 0xFF bytes (NaN for every float type) and a canary after the
//     dynamic region is checked after the block, so reading uninitialised or
//     writing out-of-range shared memory shows up.
//   * cp.async is asynchronous: a source whose non-PTX branch checks
//     PN_EMUL_CP_ASYNC calls pn_emul_cp_async / _commit / _wait (below); a
//     copy is queued per thread at issue and performed at the wait that covers
//     its group (or when the thread exits), so a read of the destination before
//     that wait sees the 0xFF fill or older contents.
//   * Misuse is reported, not silently tolerated: divergent __syncthreads (threads
//     at different call sites), deadlock, a shuffle whose mask excludes the
//     caller or names an exited / absent lane or a lane that called a different
//     intrinsic, a shuffle reading a lane outside the mask, too much dynamic
//     shared memory.  The launch returns an error that the harness raises.
//
// __half / __nv_bfloat16 follow cuda_fp16.h / cuda_bf16.h: correctly rounded
// conversions (RN by default, RZ/RD/RU variants), subnormals, inf, canonical
// NaN 0x7FFF on conversion from float/double, arithmetic rounded once.
#pragma once

#include <math.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#if !defined(__x86_64__) || defined(CUDA_EMUL_UCONTEXT)
#define CUDA_EMUL_USE_UCONTEXT 1
#include <ucontext.h>
#endif

// --------------------------------------------------------------------------- keywords

#define CUDA_EMUL_EXPORT __attribute__((visibility("default")))
#define __CUDACC__ 1
#define __CUDACC_RTC__ 1
#define __CUDA_EMUL__ 1
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ thread_local
#ifndef __restrict__
#define __restrict__ __restrict
#endif

using uint = unsigned int;
using ushort = unsigned short;
using ulong = unsigned long;
using uchar = unsigned char;
using longlong = long long;
using ulonglong = unsigned long long;

// --------------------------------------------------------------------------- vector types

#define CUDA_EMUL_VEC(T, N, A)                                                              \
  struct __attribute__((aligned(A))) N##1 { T x; };                                        \
  struct __attribute__((aligned(A * 2 > 16 ? 16 : A * 2))) N##2 { T x, y; };               \
  struct N##3 { T x, y, z; };                                                               \
  struct __attribute__((aligned(A * 4 > 16 ? 16 : A * 4))) N##4 { T x, y, z, w; };         \
  inline N##1 make_##N##1(T x) { return N##1{x}; }                                        \
  inline N##2 make_##N##2(T x, T y) { return N##2{x, y}; }                                \
  inline N##3 make_##N##3(T x, T y, T z) { return N##3{x, y, z}; }                        \
  inline N##4 make_##N##4(T x, T y, T z, T w) { return N##4{x, y, z, w}; }

CUDA_EMUL_VEC(signed char, char, 1)
CUDA_EMUL_VEC(unsigned char, uchar, 1)
CUDA_EMUL_VEC(short, short, 2)
CUDA_EMUL_VEC(unsigned short, ushort, 2)
CUDA_EMUL_VEC(int, int, 4)
CUDA_EMUL_VEC(unsigned int, uint, 4)
CUDA_EMUL_VEC(long, long, 8)
CUDA_EMUL_VEC(unsigned long, ulong, 8)
CUDA_EMUL_VEC(long long, longlong, 8)
CUDA_EMUL_VEC(unsigned long long, ulonglong, 8)
CUDA_EMUL_VEC(float, float, 4)
CUDA_EMUL_VEC(double, double, 8)
#undef CUDA_EMUL_VEC

static_assert(sizeof(float4) == 16 && alignof(float4) == 16, "float4 layout");
static_assert(sizeof(uint4) == 16 && alignof(uint4) == 16, "uint4 layout");
static_assert(sizeof(double2) == 16 && alignof(double2) == 16, "double2 layout");
static_assert(sizeof(float2) == 8 && alignof(float2) == 8, "float2 layout");

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

constexpr int warpSize = 32;

// The built-in index variables: per worker OS thread, rewritten by the
// scheduler on every fiber switch (fibers never migrate between OS threads).
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

// --------------------------------------------------------------------------- fp16 / bf16

namespace cuda_emul {

enum Round { RN = 0, RZ = 1, RD = 2, RU = 3 };

inline uint64_t dbits(double d) { uint64_t u; std::memcpy(&u, &d, 8); return u; }
inline uint32_t fbits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bitsf(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline double bitsd(uint64_t u) { double d; std::memcpy(&d, &u, 8); return d; }

// Round a double to a binary format with EB exponent bits and MB stored
// mantissa bits (IEEE-style: bias 2^(EB-1)-1, subnormals, inf, NaN), in the
// given rounding mode.  Every float is exactly a double, so float -> half /
// bfloat16 goes through here too and is rounded once.  NaN -> 0x7FFF, the
// canonical NaN cuda_fp16.h / cuda_bf16.h produce.
template <int EB, int MB>
inline uint16_t round_to_small(double x, Round mode) {
  const uint64_t u = dbits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 63) << (EB + MB));
  const uint64_t a = u & 0x7fffffffffffffffULL;
  const uint16_t inf = static_cast<uint16_t>(((1u << EB) - 1u) << MB);
  if (a > 0x7ff0000000000000ULL) return 0x7fff;
  const bool neg = (u >> 63) != 0;
  auto overflow = [&]() -> uint16_t {
    const bool to_inf = mode == RN || (mode == RU && !neg) || (mode == RD && neg);
    return static_cast<uint16_t>(sign | (to_inf ? inf : inf - 1));
  };
  if (a == 0x7ff0000000000000ULL) return static_cast<uint16_t>(sign | inf);
  if (a == 0) return sign;
  int e = static_cast<int>(a >> 52);
  uint64_t m = a & ((1ULL << 52) - 1);
  if (e == 0) e = 1; else m |= 1ULL << 52;  // value = m * 2^(e - 1075)
  const int bias = (1 << (EB - 1)) - 1;
  const int eu = e - 1023;                  // exponent of bit 52 of m
  if (eu + bias >= (1 << EB) - 1) return overflow();
  const int q = std::max(eu, 1 - bias) - MB;  // exponent of the result's last place
  const int s = q + 1075 - e;                 // >= 52 - MB > 0
  uint64_t r;
  bool up;
  if (s >= 64) {
    r = 0;  // m < 2^53 <= 2^(s-1): below half of the last place, but not zero
    up = (mode == RU && !neg) || (mode == RD && neg);
  } else {
    r = m >> s;
    const uint64_t rem = m & ((1ULL << s) - 1);
    const uint64_t half = 1ULL << (s - 1);
    switch (mode) {
      case RN: up = rem > half || (rem == half && (r & 1)); break;
      case RZ: up = false; break;
      case RU: up = rem != 0 && !neg; break;
      default: up = rem != 0 && neg; break;
    }
  }
  r += up;
  // normal: ((eu + bias - 1) << MB) + r carries into the exponent correctly;
  // subnormal: r itself (r == 2^MB is the smallest normal).
  const uint64_t bits = (static_cast<uint64_t>(std::max(eu + bias, 1) - 1) << MB) + r;
  if (bits >= inf) return overflow();
  return static_cast<uint16_t>(sign | bits);
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1f;
  const uint32_t m = h & 0x3ffu;
  if (e == 0) {
    const float v = std::ldexp(static_cast<float>(m), -24);  // exact
    return sign ? -v : v;
  }
  if (e == 31) return bitsf(sign | 0x7f800000u | (m << 13));
  return bitsf(sign | ((e + 112) << 23) | (m << 13));
}

inline float bf16_bits_to_float(uint16_t b) { return bitsf(static_cast<uint32_t>(b) << 16); }

}  // namespace cuda_emul

struct __half_raw { unsigned short x; };
struct __nv_bfloat16_raw { unsigned short x; };
struct __half;
struct __nv_bfloat16;
__half __float2half_rn(float f);
__half __double2half(double f);
float __half2float(__half h);
__nv_bfloat16 __float2bfloat16_rn(float f);
__nv_bfloat16 __double2bfloat16(double f);
float __bfloat162float(__nv_bfloat16 h);

// Like CUDA's: implicit from float/double/int, implicit to float, raw access.
struct __attribute__((aligned(2))) __half {
  unsigned short __x;
  __half() = default;
  constexpr __half(const __half_raw& r) : __x(r.x) {}
  __half(float f) : __x(cuda_emul::round_to_small<5, 10>(f, cuda_emul::RN)) {}
  __half(double f) : __x(cuda_emul::round_to_small<5, 10>(f, cuda_emul::RN)) {}
  __half(int v) : __half(static_cast<double>(v)) {}
  __half(unsigned int v) : __half(static_cast<double>(v)) {}
  __half(long long v) : __half(static_cast<double>(v)) {}
  __half(unsigned long long v) : __half(static_cast<double>(v)) {}
  __half(long v) : __half(static_cast<double>(v)) {}
  __half(unsigned long v) : __half(static_cast<double>(v)) {}
  explicit __half(const __nv_bfloat16& b);
  operator float() const { return cuda_emul::half_bits_to_float(__x); }
  operator __half_raw() const { return __half_raw{__x}; }
  __half& operator=(const __half_raw& r) { __x = r.x; return *this; }
  __half& operator=(float f) { return *this = __half(f); }
  __half& operator=(double f) { return *this = __half(f); }
};

struct __attribute__((aligned(2))) __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  constexpr __nv_bfloat16(const __nv_bfloat16_raw& r) : __x(r.x) {}
  __nv_bfloat16(float f) : __x(cuda_emul::round_to_small<8, 7>(f, cuda_emul::RN)) {}
  __nv_bfloat16(double f) : __x(cuda_emul::round_to_small<8, 7>(f, cuda_emul::RN)) {}
  __nv_bfloat16(int v) : __nv_bfloat16(static_cast<double>(v)) {}
  __nv_bfloat16(unsigned int v) : __nv_bfloat16(static_cast<double>(v)) {}
  __nv_bfloat16(long long v) : __nv_bfloat16(static_cast<double>(v)) {}
  __nv_bfloat16(unsigned long long v) : __nv_bfloat16(static_cast<double>(v)) {}
  __nv_bfloat16(long v) : __nv_bfloat16(static_cast<double>(v)) {}
  __nv_bfloat16(unsigned long v) : __nv_bfloat16(static_cast<double>(v)) {}
  explicit __nv_bfloat16(const __half& h) : __nv_bfloat16(static_cast<float>(h)) {}
  operator float() const { return cuda_emul::bf16_bits_to_float(__x); }
  operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }
  __nv_bfloat16& operator=(const __nv_bfloat16_raw& r) { __x = r.x; return *this; }
  __nv_bfloat16& operator=(float f) { return *this = __nv_bfloat16(f); }
  __nv_bfloat16& operator=(double f) { return *this = __nv_bfloat16(f); }
};

inline __half::__half(const __nv_bfloat16& b) : __half(static_cast<float>(b)) {}

struct __attribute__((aligned(4))) __half2 { __half x, y; };
struct __attribute__((aligned(4))) __nv_bfloat162 { __nv_bfloat16 x, y; };
struct __half2_raw { unsigned short x, y; };
struct __nv_bfloat162_raw { unsigned short x, y; };
using half = __half;
using half2 = __half2;
using nv_bfloat16 = __nv_bfloat16;
using nv_bfloat162 = __nv_bfloat162;

#define CUDA_EMUL_SMALL_CONV(T, EB, MB, NAME)                                                  \
  inline T __float2##NAME##_rn(float f) { T r; r.__x = cuda_emul::round_to_small<EB, MB>(f, cuda_emul::RN); return r; } \
  inline T __float2##NAME##_rz(float f) { T r; r.__x = cuda_emul::round_to_small<EB, MB>(f, cuda_emul::RZ); return r; } \
  inline T __float2##NAME##_rd(float f) { T r; r.__x = cuda_emul::round_to_small<EB, MB>(f, cuda_emul::RD); return r; } \
  inline T __float2##NAME##_ru(float f) { T r; r.__x = cuda_emul::round_to_small<EB, MB>(f, cuda_emul::RU); return r; } \
  inline T __float2##NAME(float f) { return __float2##NAME##_rn(f); }                         \
  inline T __double2##NAME(double f) { T r; r.__x = cuda_emul::round_to_small<EB, MB>(f, cuda_emul::RN); return r; }

CUDA_EMUL_SMALL_CONV(__half, 5, 10, half)
CUDA_EMUL_SMALL_CONV(__nv_bfloat16, 8, 7, bfloat16)
#undef CUDA_EMUL_SMALL_CONV

inline float __half2float(__half h) { return cuda_emul::half_bits_to_float(h.__x); }
inline float __bfloat162float(__nv_bfloat16 h) { return cuda_emul::bf16_bits_to_float(h.__x); }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
inline float __low2float(__nv_bfloat162 h) { return __bfloat162float(h.x); }
inline float __high2float(__nv_bfloat162 h) { return __bfloat162float(h.y); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline short __half_as_short(__half h) { return static_cast<short>(h.__x); }
inline __half __ushort_as_half(unsigned short u) { __half h; h.__x = u; return h; }
inline __half __short_as_half(short u) { __half h; h.__x = static_cast<unsigned short>(u); return h; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline short __bfloat16_as_short(__nv_bfloat16 h) { return static_cast<short>(h.__x); }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 h; h.__x = u; return h; }
inline __nv_bfloat16 __short_as_bfloat16(short u) { __nv_bfloat16 h; h.__x = static_cast<unsigned short>(u); return h; }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__float2half_rn(a), __float2half_rn(b)}; }
inline __half2 __float22half2_rn(float2 v) { return __floats2half2_rn(v.x, v.y); }
inline __half2 __float2half2_rn(float a) { return __floats2half2_rn(a, a); }
inline float2 __half22float2(__half2 h) { return float2{__half2float(h.x), __half2float(h.y)}; }
inline __half2 __halves2half2(__half a, __half b) { return __half2{a, b}; }
inline __half2 __half2half2(__half a) { return __half2{a, a}; }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __floats2bfloat162_rn(v.x, v.y); }
inline __nv_bfloat162 __float2bfloat162_rn(float a) { return __floats2bfloat162_rn(a, a); }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return float2{__bfloat162float(h.x), __bfloat162float(h.y)}; }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat162{a, b}; }
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 a) { return __nv_bfloat162{a, a}; }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 h) { return h.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 h) { return h.y; }

// Arithmetic rounded once: every op on two binary16/bfloat16 values computed
// in double is either exact (+, -, *) or double-rounding-innocuous
// (53 >= 2*11 + 2), so rounding the double result gives the correctly
// rounded answer the hardware returns.
#define CUDA_EMUL_SMALL_OPS(T, P)                                                               \
  inline T P##add(T a, T b) { return T(static_cast<double>(float(a)) + static_cast<double>(float(b))); } \
  inline T P##sub(T a, T b) { return T(static_cast<double>(float(a)) - static_cast<double>(float(b))); } \
  inline T P##mul(T a, T b) { return T(static_cast<double>(float(a)) * static_cast<double>(float(b))); } \
  inline T P##div(T a, T b) { return T(static_cast<double>(float(a)) / static_cast<double>(float(b))); } \
  inline T P##fma(T a, T b, T c) { return T(std::fma(static_cast<double>(float(a)), static_cast<double>(float(b)), static_cast<double>(float(c)))); } \
  inline T P##neg(T a) { T r; r.__x = static_cast<unsigned short>(a.__x ^ 0x8000u); return r; } \
  inline T P##abs(T a) { T r; r.__x = static_cast<unsigned short>(a.__x & 0x7fffu); return r; } \
  inline bool P##isnan(T a) { return std::isnan(float(a)); }                                       \
  inline int P##isinf(T a) { const float f = float(a); return std::isinf(f) ? (f > 0 ? 1 : -1) : 0; } \
  inline bool P##eq(T a, T b) { return float(a) == float(b); }                                     \
  inline bool P##ne(T a, T b) { return float(a) != float(b); }                                     \
  inline bool P##neu(T a, T b) { return !(float(a) == float(b)); }                                 \
  inline bool P##lt(T a, T b) { return float(a) < float(b); }                                      \
  inline bool P##le(T a, T b) { return float(a) <= float(b); }                                     \
  inline bool P##gt(T a, T b) { return float(a) > float(b); }                                      \
  inline bool P##ge(T a, T b) { return float(a) >= float(b); }                                     \
  inline T P##max(T a, T b) { const float x = float(a), y = float(b); return std::isnan(x) ? b : std::isnan(y) ? a : (x > y ? a : b); } \
  inline T P##min(T a, T b) { const float x = float(a), y = float(b); return std::isnan(x) ? b : std::isnan(y) ? a : (x < y ? a : b); } \
  inline T operator+(const T& a, const T& b) { return P##add(a, b); }                                \
  inline T operator-(const T& a, const T& b) { return P##sub(a, b); }                                \
  inline T operator*(const T& a, const T& b) { return P##mul(a, b); }                                \
  inline T operator/(const T& a, const T& b) { return P##div(a, b); }                                \
  inline T& operator+=(T& a, const T& b) { return a = P##add(a, b); }                                \
  inline T& operator-=(T& a, const T& b) { return a = P##sub(a, b); }                                \
  inline T& operator*=(T& a, const T& b) { return a = P##mul(a, b); }                                \
  inline T& operator/=(T& a, const T& b) { return a = P##div(a, b); }                                \
  inline T operator+(const T& a) { return a; }                                                       \
  inline T operator-(const T& a) { return P##neg(a); }                                               \
  inline bool operator==(const T& a, const T& b) { return P##eq(a, b); }                             \
  inline bool operator!=(const T& a, const T& b) { return P##neu(a, b); }                            \
  inline bool operator<(const T& a, const T& b) { return P##lt(a, b); }                              \
  inline bool operator<=(const T& a, const T& b) { return P##le(a, b); }                             \
  inline bool operator>(const T& a, const T& b) { return P##gt(a, b); }                              \
  inline bool operator>=(const T& a, const T& b) { return P##ge(a, b); }

CUDA_EMUL_SMALL_OPS(__half, __h)
CUDA_EMUL_SMALL_OPS(__nv_bfloat16, __h_bf16_)
#undef CUDA_EMUL_SMALL_OPS
// cuda_bf16.h names its bfloat16 ops like the half ones (__hadd etc.), overloaded.
inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) { return __h_bf16_add(a, b); }
inline __nv_bfloat16 __hsub(__nv_bfloat16 a, __nv_bfloat16 b) { return __h_bf16_sub(a, b); }
inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) { return __h_bf16_mul(a, b); }
inline __nv_bfloat16 __hdiv(__nv_bfloat16 a, __nv_bfloat16 b) { return __h_bf16_div(a, b); }
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) { return __h_bf16_fma(a, b, c); }
inline __nv_bfloat16 __hneg(__nv_bfloat16 a) { return __h_bf16_neg(a); }
inline __nv_bfloat16 __habs(__nv_bfloat16 a) { return __h_bf16_abs(a); }
inline bool __hisnan(__nv_bfloat16 a) { return __h_bf16_isnan(a); }
inline int __hisinf(__nv_bfloat16 a) { return __h_bf16_isinf(a); }
inline __nv_bfloat16 __hmax(__nv_bfloat16 a, __nv_bfloat16 b) { return __h_bf16_max(a, b); }
inline __nv_bfloat16 __hmin(__nv_bfloat16 a, __nv_bfloat16 b) { return __h_bf16_min(a, b); }

// --------------------------------------------------------------------------- math

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline double __dsqrt_rn(double x) { return std::sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline double __drcp_rn(double x) { return 1.0 / x; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline float __saturatef(float x) { return x != x ? 0.0f : x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __powf(float a, float b) { return powf(a, b); }
inline float __double2float_rn(double x) { return static_cast<float>(x); }
inline int __float2int_rn(float x) { return static_cast<int>(std::nearbyint(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline float __uint2float_rn(unsigned x) { return static_cast<float>(x); }
inline double __int2double_rn(int x) { return static_cast<double>(x); }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline long long __double_as_longlong(double d) { long long i; std::memcpy(&i, &d, 8); return i; }
inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) { unsigned r = 0; for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i); return r; }
inline unsigned __umulhi(unsigned a, unsigned b) { return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32); }
inline int __mulhi(int a, int b) { return static_cast<int>((static_cast<long long>(a) * b) >> 32); }
inline int __mul24(int a, int b) { return a * b; }
inline unsigned __umul24(unsigned a, unsigned b) { return a * b; }

// CUDA's global min/max overloads (any mix of arithmetic types).
template <class A, class B, std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>, int> = 0>
inline std::common_type_t<A, B> max(A a, B b) { using C = std::common_type_t<A, B>; return static_cast<C>(a) > static_cast<C>(b) ? static_cast<C>(a) : static_cast<C>(b); }
template <class A, class B, std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>, int> = 0>
inline std::common_type_t<A, B> min(A a, B b) { using C = std::common_type_t<A, B>; return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(a) : static_cast<C>(b); }

// Cache-hinted loads/stores: plain memory on the CPU.
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// --------------------------------------------------------------------------- atomics

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

namespace cuda_emul {
template <class T, class F>
inline T atomic_rmw(T* addr, F f) {
  std::atomic_ref<T> ref(*addr);
  T old = ref.load();
  while (!ref.compare_exchange_weak(old, f(old))) {
  }
  return old;
}
}  // namespace cuda_emul

template <class T> inline T atomicAdd(T* a, T v) { return cuda_emul::atomic_rmw(a, [v](T o) { return static_cast<T>(o + v); }); }
template <class T> inline T atomicSub(T* a, T v) { return cuda_emul::atomic_rmw(a, [v](T o) { return static_cast<T>(o - v); }); }
template <class T> inline T atomicExch(T* a, T v) { return cuda_emul::atomic_rmw(a, [v](T) { return v; }); }
template <class T> inline T atomicMax(T* a, T v) { return cuda_emul::atomic_rmw(a, [v](T o) { return o > v ? o : v; }); }
template <class T> inline T atomicMin(T* a, T v) { return cuda_emul::atomic_rmw(a, [v](T o) { return o < v ? o : v; }); }
template <class T> inline T atomicAnd(T* a, T v) { return cuda_emul::atomic_rmw(a, [v](T o) { return o & v; }); }
template <class T> inline T atomicOr(T* a, T v) { return cuda_emul::atomic_rmw(a, [v](T o) { return o | v; }); }
template <class T> inline T atomicXor(T* a, T v) { return cuda_emul::atomic_rmw(a, [v](T o) { return o ^ v; }); }
inline unsigned atomicInc(unsigned* a, unsigned v) { return cuda_emul::atomic_rmw(a, [v](unsigned o) { return o >= v ? 0u : o + 1u; }); }
inline unsigned atomicDec(unsigned* a, unsigned v) { return cuda_emul::atomic_rmw(a, [v](unsigned o) { return (o == 0 || o > v) ? v : o - 1u; }); }
template <class T> inline T atomicCAS(T* a, T cmp, T v) {
  std::atomic_ref<T> ref(*a);
  ref.compare_exchange_strong(cmp, v);
  return cmp;
}

// --------------------------------------------------------------------------- the scheduler

// Provided by the harness's second translation unit (the dynamic shared
// memory arena and the list of static __shared__ variables to poison).
extern "C" unsigned char* cuda_emul_dsmem_arena_ptr();
extern "C" size_t cuda_emul_dsmem_capacity();

#if !defined(CUDA_EMUL_USE_UCONTEXT)
// Minimal x86-64 SysV context switch: callee-saved registers on the old
// stack, stack pointer swap.  ~10x faster than swapcontext (no signal-mask
// syscall), which matters with 1024 fibers per block.
extern "C" void cuda_emul_switch(void** save_sp, void* new_sp);
extern "C" void cuda_emul_trampoline();
asm(R"(
    .text
    .p2align 4
    .globl cuda_emul_switch
    .hidden cuda_emul_switch
    .type cuda_emul_switch, @function
cuda_emul_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuda_emul_switch, .-cuda_emul_switch

    .p2align 4
    .globl cuda_emul_trampoline
    .hidden cuda_emul_trampoline
    .type cuda_emul_trampoline, @function
cuda_emul_trampoline:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size cuda_emul_trampoline, .-cuda_emul_trampoline
)");
#endif

namespace cuda_emul {

constexpr size_t kDsmemGuard = 256;  // canary bytes after the dynamic region

enum WarpOp { OP_SHFL = 1, OP_SHFL_UP, OP_SHFL_DOWN, OP_SHFL_XOR, OP_SYNCWARP, OP_BALLOT, OP_ANY, OP_ALL, OP_MATCH };

inline const char* op_name(int op) {
  switch (op) {
    case OP_SHFL: return "__shfl_sync";
    case OP_SHFL_UP: return "__shfl_up_sync";
    case OP_SHFL_DOWN: return "__shfl_down_sync";
    case OP_SHFL_XOR: return "__shfl_xor_sync";
    case OP_SYNCWARP: return "__syncwarp";
    case OP_BALLOT: return "__ballot_sync";
    case OP_ANY: return "__any_sync";
    case OP_ALL: return "__all_sync";
    default: return "warp intrinsic";
  }
}

// An asynchronous shared-memory copy (cp.async), queued at issue and performed
// when a wait covers its group (see pn_emul_cp_async below).
struct CpCopy {
  void* dst;
  const void* src;
  int bytes;
  uint64_t group;  // the group it joins at the next commit
};

struct Fiber {
  void* sp;
  uint3 tid;
  int next, prev;  // circular list of live fibers
  bool done;
  std::vector<CpCopy> cp_queue;  // issued, not yet performed, in issue order
  uint64_t cp_open = 0;          // the group the next copy joins (= groups committed so far)
#if defined(CUDA_EMUL_USE_UCONTEXT)
  ucontext_t uc;
#endif
};

struct Warp {
  uint32_t members;  // lanes that exist in this block
  uint32_t exited;
  uint32_t arrived;
  uint32_t mask;
  int op;
  int line;
  uint64_t gen;
  uint64_t val[32];
  int req[32];
  uint64_t res[32];
};

struct Block {
  // per worker, reused across blocks
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<int> order;
  unsigned char* stacks = nullptr;
  size_t stack_bytes = 0;
  size_t nstacks = 0;
  void* sched_sp = nullptr;
#if defined(CUDA_EMUL_USE_UCONTEXT)
  ucontext_t sched_uc;
#endif
  // per block
  int n = 0, alive = 0, cur = 0;
  unsigned bar_count = 0;
  int bar_line = 0;
  uint64_t bar_gen = 0;
  int64_t bar_acc[2] = {0, 0};
  uint64_t progress = 0;
  uint64_t stalls = 0;
  uint64_t switches = 0;
  bool failed = false;
  char err[1024];
  void (*invoke)(void*) = nullptr;
  void* ctx = nullptr;
};

inline thread_local Block* tl_block = nullptr;

// Static __shared__ variables, as (offset, size) in this module's TLS block,
// read from the linked library's symbol table by the harness; the block base
// is found from the offset of a known TLS variable (threadIdx).
inline std::vector<std::pair<unsigned long long, unsigned long long>> g_poison;
inline unsigned long long g_anchor_offset = ~0ull;

inline void poison_static_shared() {
  if (g_anchor_offset == ~0ull) return;
  unsigned char* base = reinterpret_cast<unsigned char*>(&threadIdx) - g_anchor_offset;
  for (const auto& [off, size] : g_poison) std::memset(base + off, 0xff, size);
}

[[noreturn]] inline void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

inline void set_current(Block* b, int i) {
  b->cur = i;
  threadIdx = b->fibers[i].tid;
}

#if !defined(CUDA_EMUL_USE_UCONTEXT)
inline void switch_to(void** save, void* to) { cuda_emul_switch(save, to); }
#endif

// Run the next live fiber after the current one (the current one stays live).
__attribute__((noinline)) inline void yield() {
  Block* b = tl_block;
  const int me = b->cur;
  const int nx = b->fibers[me].next;
  if (nx == me) return;
  ++b->switches;
  set_current(b, nx);
#if defined(CUDA_EMUL_USE_UCONTEXT)
  swapcontext(&b->fibers[me].uc, &b->fibers[nx].uc);
#else
  switch_to(&b->fibers[me].sp, b->fibers[nx].sp);
#endif
  asm volatile("" ::: "memory");
}

// Give up the current fiber for good: jump to the next live one, or back to
// the scheduler when none is left or the block failed.
[[noreturn]] inline void leave(bool to_scheduler) {
  Block* b = tl_block;
  const int me = b->cur;
  void* dummy;
  if (!to_scheduler && b->alive > 0) {
    int nx = b->fibers[me].next;
    set_current(b, nx);
#if defined(CUDA_EMUL_USE_UCONTEXT)
    setcontext(&b->fibers[nx].uc);
#else
    switch_to(&dummy, b->fibers[nx].sp);
#endif
  }
#if defined(CUDA_EMUL_USE_UCONTEXT)
  setcontext(&b->sched_uc);
#else
  switch_to(&dummy, b->sched_sp);
#endif
  __builtin_unreachable();
}

template <class Pred>
inline void wait_until(Pred pred, const char* what, int line) {
  Block* b = tl_block;
  while (!pred()) {
    // Every waiting visit without progress counts; a full round of live
    // fibers that all wait and none arrives anywhere is a deadlock.
    if (++b->stalls > 2ull * static_cast<unsigned>(b->alive) + 4) {
      fail("deadlock: thread waits at %s (line %d) and no live thread can make progress "
           "(%d live threads; %u at __syncthreads line %d) -- divergent barrier or warp intrinsic?",
           what, line, b->alive, b->bar_count, b->bar_line);
    }
    yield();
  }
}

inline void made_progress(Block* b) { ++b->progress; b->stalls = 0; }

inline int linear_tid() {
  return static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
}

// ---- __syncthreads and friends

inline void barrier_complete(Block* b) {
  b->bar_count = 0;
  ++b->bar_gen;
  b->bar_acc[b->bar_gen & 1] = 0;  // the slot the next reduction barrier adds into
}

inline int64_t barrier(int line, int64_t contrib, int op) {
  Block* b = tl_block;
  if (b->bar_count == 0) {
    b->bar_line = line;
  } else if (b->bar_line != line) {
    fail("divergent __syncthreads: this thread is at line %d while %u thread(s) wait at line %d", line,
         b->bar_count, b->bar_line);
  }
  const uint64_t g = b->bar_gen;
  int64_t& acc = b->bar_acc[g & 1];
  if (op == 1) acc += contrib;                 // count
  else if (op == 2) acc = (b->bar_count == 0 ? 1 : acc) & (contrib != 0);  // and
  else if (op == 3) acc |= (contrib != 0);     // or
  ++b->bar_count;
  made_progress(b);
  if (static_cast<int>(b->bar_count) == b->alive) {
    const int64_t r = acc;
    barrier_complete(b);
    return r;
  }
  wait_until([b, g] { return b->bar_gen != g; }, "__syncthreads", line);
  return b->bar_acc[g & 1];
}

// ---- warp rendezvous

inline uint64_t warp_op(int line, int op, unsigned mask, uint64_t value, int src_lane_or_arg, int width) {
  Block* b = tl_block;
  const int t = linear_tid();
  const int lane = t & 31;
  Warp& w = b->warps[t >> 5];
  const uint32_t bit = 1u << lane;
  if (!(mask & bit))
    fail("%s (line %d): the calling lane %d is not in mask 0x%08x", op_name(op), line, lane, mask);
  if (mask & ~w.members)
    fail("%s (line %d): mask 0x%08x names lanes that do not exist in this warp (lanes present: 0x%08x; "
         "blockDim (%u,%u,%u))", op_name(op), line, mask, w.members, blockDim.x, blockDim.y, blockDim.z);
  if (mask & w.exited)
    fail("%s (line %d): mask 0x%08x names lanes that have already exited (0x%08x)", op_name(op), line, mask,
         w.exited);
  if (op <= OP_SHFL_XOR && (width < 1 || width > 32 || (width & (width - 1))))
    fail("%s (line %d): width %d is not a power of two in [1, 32]", op_name(op), line, width);
  if (w.arrived == 0) {
    w.mask = mask;
    w.op = op;
    w.line = line;
  } else if (w.mask != mask || w.op != op) {
    fail("warp divergence: lane %d calls %s (line %d, mask 0x%08x) while lanes 0x%08x wait in %s (line %d, "
         "mask 0x%08x)", lane, op_name(op), line, mask, w.arrived, op_name(w.op), w.line, w.mask);
  }
  // Source lane, as PTX shfl.sync computes it (c = ((32 - width) << 8) | 0x1f,
  // or (32 - width) << 8 for .up).
  int src = lane;
  if (op <= OP_SHFL_XOR) {
    const int segmask = (32 - width) & 31;
    const int cval = op == OP_SHFL_UP ? 0 : 31;
    const int b5 = src_lane_or_arg & 31;
    const int max_lane = (lane & segmask) | (cval & ~segmask);
    const int min_lane = lane & segmask;
    int j;
    bool ok;
    switch (op) {
      case OP_SHFL_UP: j = lane - b5; ok = j >= max_lane; break;
      case OP_SHFL_DOWN: j = lane + b5; ok = j <= max_lane; break;
      case OP_SHFL_XOR: j = lane ^ b5; ok = j <= max_lane; break;
      default: j = min_lane | (b5 & ~segmask); ok = j <= max_lane; break;
    }
    src = ok ? j : lane;
    if (!(mask & (1u << src)))
      fail("%s (line %d): lane %d reads lane %d, which is not in mask 0x%08x (undefined on the GPU)",
           op_name(op), line, lane, src, mask);
  }
  w.val[lane] = value;
  w.req[lane] = src;
  w.arrived |= bit;
  made_progress(b);
  if (w.arrived == w.mask) {
    // the last lane in computes everyone's result
    uint32_t ballot = 0;
    for (int l = 0; l < 32; ++l)
      if ((w.mask >> l & 1) && w.val[l]) ballot |= 1u << l;
    for (int l = 0; l < 32; ++l) {
      if (!(w.mask >> l & 1)) continue;
      switch (op) {
        case OP_BALLOT: w.res[l] = ballot; break;
        case OP_ANY: w.res[l] = ballot != 0; break;
        case OP_ALL: w.res[l] = ballot == w.mask; break;
        case OP_SYNCWARP: w.res[l] = 0; break;
        default: w.res[l] = w.val[w.req[l]]; break;
      }
    }
    w.arrived = 0;
    ++w.gen;
    return w.res[lane];
  }
  const uint64_t g = w.gen;
  wait_until([&w, g] { return w.gen != g; }, op_name(op), line);
  return w.res[lane];
}

template <class T>
inline T shfl(int line, int op, unsigned mask, T var, int arg, int width) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a type wider than 8 bytes");
  uint64_t v = 0;
  std::memcpy(&v, &var, sizeof(T));
  const uint64_t r = warp_op(line, op, mask, v, arg, width);
  T out;
  std::memcpy(&out, &r, sizeof(T));
  return out;
}

// ---- launching

struct LaunchCfg {
  unsigned grid[3];
  unsigned block[3];
  unsigned long long smem;   // dynamic shared memory bytes
  int workers;               // OS threads; <= 0: automatic
  unsigned stack_kib;        // per CUDA thread
  unsigned schedule;         // fiber order: 0 thread order, 1 reversed, >= 2 a random permutation (seed)
};

inline std::mutex& launch_mutex() { static std::mutex m; return m; }
inline std::vector<Block*>& worker_blocks() { static std::vector<Block*> v; return v; }
inline char g_last_error[1200];

inline void fail_impl(const char* msg) {
  Block* b = tl_block;
  std::snprintf(b->err, sizeof(b->err), "block (%u,%u,%u) thread (%u,%u,%u): %s", blockIdx.x, blockIdx.y,
                blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z, msg);
  b->failed = true;
  leave(true);
}

inline void fail(const char* fmt, ...) {
  char msg[900];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  fail_impl(msg);
  __builtin_unreachable();
}

// Performs, in issue order, the queued copies of groups older than `before`.
inline void cp_perform(Fiber& f, uint64_t before) {
  size_t keep = 0;
  for (size_t i = 0; i < f.cp_queue.size(); ++i) {
    const CpCopy& c = f.cp_queue[i];
    if (c.group < before) std::memcpy(c.dst, c.src, static_cast<size_t>(c.bytes));
    else f.cp_queue[keep++] = c;
  }
  f.cp_queue.resize(keep);
}

inline void fiber_main(Block* b) {
  b->invoke(b->ctx);
  // thread exit: copies still in flight land (as on the hardware), after every
  // read of this thread
  const int me = b->cur;
  Fiber& f = b->fibers[me];
  cp_perform(f, ~0ull);
  f.done = true;
  --b->alive;
  made_progress(b);
  const int t = linear_tid();
  Warp& w = b->warps[t >> 5];
  const uint32_t bit = 1u << (t & 31);
  w.exited |= bit;
  if (w.arrived && (w.mask & bit))
    fail("thread exits while lanes 0x%08x of its warp wait for it in %s (line %d, mask 0x%08x)", w.arrived,
         op_name(w.op), w.line, w.mask);
  // Exited threads do not count at __syncthreads (as on the hardware).
  if (b->bar_count > 0 && static_cast<int>(b->bar_count) == b->alive) barrier_complete(b);
  b->fibers[f.prev].next = f.next;
  b->fibers[f.next].prev = f.prev;
  leave(b->alive == 0);
}

#if defined(CUDA_EMUL_USE_UCONTEXT)
inline void fiber_entry_uc() { fiber_main(tl_block); }
#else
extern "C" inline void cuda_emul_fiber_entry(Block* b) { fiber_main(b); }
#endif

inline bool prepare_stacks(Block* b, size_t n, size_t stack_bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  stack_bytes = (stack_bytes + page - 1) / page * page;
  if (b->stacks && b->nstacks >= n && b->stack_bytes == stack_bytes) return true;
  if (b->stacks) munmap(b->stacks, b->nstacks * (b->stack_bytes + page));
  const size_t total = n * (stack_bytes + page);
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) { b->stacks = nullptr; return false; }
  b->stacks = static_cast<unsigned char*>(p);
  b->nstacks = n;
  b->stack_bytes = stack_bytes;
  for (size_t i = 0; i < n; ++i) mprotect(b->stacks + i * (stack_bytes + page), page, PROT_NONE);  // guard
  return true;
}

// Runs one block to completion on the calling OS thread; false on failure.
inline bool run_block(Block* b, uint3 bid, dim3 bdim, size_t smem, unsigned schedule) {
  const int n = static_cast<int>(bdim.x * bdim.y * bdim.z);
  blockIdx = bid;
  b->n = n;
  b->alive = n;
  b->bar_count = 0;
  b->bar_gen = 0;
  b->bar_acc[0] = b->bar_acc[1] = 0;
  b->stalls = 0;
  b->failed = false;
  const int nwarps = (n + 31) / 32;
  b->fibers.resize(n);
  b->warps.assign(nwarps, Warp{});
  for (int wi = 0; wi < nwarps; ++wi) {
    const int lanes = std::min(32, n - wi * 32);
    b->warps[wi].members = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
  }
  // poison shared memory, arm the canary after the dynamic region
  unsigned char* arena = cuda_emul_dsmem_arena_ptr();
  std::memset(arena, 0xff, smem);
  std::memset(arena + smem, 0xa5, kDsmemGuard);
  poison_static_shared();
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (int i = 0; i < n; ++i) {
    Fiber& f = b->fibers[i];
    f.tid = uint3{static_cast<unsigned>(i % bdim.x), static_cast<unsigned>((i / bdim.x) % bdim.y),
                  static_cast<unsigned>(i / (bdim.x * bdim.y))};
    f.done = false;
    f.cp_queue.clear();
    f.cp_open = 0;
    unsigned char* lo = b->stacks + static_cast<size_t>(i) * (b->stack_bytes + page) + page;
#if defined(CUDA_EMUL_USE_UCONTEXT)
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = lo;
    f.uc.uc_stack.ss_size = b->stack_bytes;
    f.uc.uc_link = nullptr;
    makecontext(&f.uc, fiber_entry_uc, 0);
#else
    uintptr_t top = reinterpret_cast<uintptr_t>(lo + b->stack_bytes) & ~static_cast<uintptr_t>(15);
    void** s = reinterpret_cast<void**>(top - 56);
    s[0] = nullptr;                                                  // r15
    s[1] = nullptr;                                                  // r14
    s[2] = reinterpret_cast<void*>(&cuda_emul_fiber_entry);         // r13: function
    s[3] = b;                                                        // r12: argument
    s[4] = nullptr;                                                  // rbx
    s[5] = nullptr;                                                  // rbp
    s[6] = reinterpret_cast<void*>(&cuda_emul_trampoline);          // return address
    f.sp = s;
#endif
  }
  // The ring of fibers, in the order the scheduler visits them.  Between two
  // synchronisation points a thread runs alone, so results that depend on
  // this order reveal a race (a missing __syncthreads / __syncwarp).
  std::vector<int>& order = b->order;
  order.resize(n);
  for (int i = 0; i < n; ++i) order[i] = schedule == 1 ? n - 1 - i : i;
  if (schedule >= 2) {
    uint64_t st = 0x9E3779B97F4A7C15ull * (schedule + 1) ^ (bid.x + 1315423911ull * (bid.y + 7 * bid.z));
    for (int i = n - 1; i > 0; --i) {  // Fisher-Yates with splitmix64
      uint64_t z = (st += 0x9E3779B97F4A7C15ull);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      std::swap(order[i], order[static_cast<int>(z % static_cast<uint64_t>(i + 1))]);
    }
  }
  for (int j = 0; j < n; ++j) {
    b->fibers[order[j]].next = order[(j + 1) % n];
    b->fibers[order[j]].prev = order[(j + n - 1) % n];
  }
  tl_block = b;
  set_current(b, order[0]);
#if defined(CUDA_EMUL_USE_UCONTEXT)
  swapcontext(&b->sched_uc, &b->fibers[order[0]].uc);
#else
  switch_to(&b->sched_sp, b->fibers[order[0]].sp);
#endif
  asm volatile("" ::: "memory");
  if (b->failed) return false;
  for (size_t i = 0; i < kDsmemGuard; ++i) {
    if (arena[smem + i] != 0xa5) {
      std::snprintf(b->err, sizeof(b->err),
                    "block (%u,%u,%u): write past the end of dynamic shared memory (%zu bytes requested; "
                    "byte %zu after the end was written)", bid.x, bid.y, bid.z, smem, i);
      return false;
    }
  }
  return true;
}

// A segmentation fault in a kernel (a read or write far outside an argument:
// the harness puts PROT_NONE pages around each one; or a fiber stack
// overflow) says where it happened, then lets the previous handler (Python's
// faulthandler, or the default) take over: the process still dies.
inline struct sigaction g_old_segv, g_old_bus;

inline void fault_handler(int sig, siginfo_t* si, void*) {
  char buf[600];
  const int len = std::snprintf(
      buf, sizeof(buf),
      "\ncuda_emul: %s at address %p in block (%u,%u,%u) thread (%u,%u,%u): an access outside the "
      "memory of every kernel argument (beyond its guard area), or a fiber stack overflow (raise "
      "stack_kib)\n",
      sig == SIGSEGV ? "SIGSEGV" : "SIGBUS", si->si_addr, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x,
      threadIdx.y, threadIdx.z);
  if (len > 0) (void)!write(2, buf, static_cast<size_t>(len));
  sigaction(sig, sig == SIGSEGV ? &g_old_segv : &g_old_bus, nullptr);  // re-faults into it on return
}

struct FaultGuard {
  FaultGuard() {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = fault_handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_old_segv);
    sigaction(SIGBUS, &sa, &g_old_bus);
  }
  ~FaultGuard() {
    sigaction(SIGSEGV, &g_old_segv, nullptr);
    sigaction(SIGBUS, &g_old_bus, nullptr);
  }
};

// The handler must run somewhere when a fiber overflows its stack.
struct AltStack {
  std::vector<char> mem = std::vector<char>(256 * 1024);
  stack_t old{};
  AltStack() {
    stack_t ss{};
    ss.ss_sp = mem.data();
    ss.ss_size = mem.size();
    sigaltstack(&ss, &old);
  }
  ~AltStack() { sigaltstack(&old, nullptr); }
};

inline int launch_impl(const LaunchCfg* cfg, void (*invoke)(void*), void* ctx) {
  std::lock_guard<std::mutex> lock(launch_mutex());
  g_last_error[0] = 0;
  const dim3 grid(cfg->grid[0], cfg->grid[1], cfg->grid[2]);
  const dim3 bdim(cfg->block[0], cfg->block[1], cfg->block[2]);
  const unsigned long long nthreads = 1ull * bdim.x * bdim.y * bdim.z;
  const unsigned long long nblocks = 1ull * grid.x * grid.y * grid.z;
  if (nthreads == 0 || nthreads > 1024 || bdim.z > 64 || nblocks == 0 || grid.y > 65535 || grid.z > 65535) {
    std::snprintf(g_last_error, sizeof(g_last_error),
                  "invalid launch configuration: grid (%u,%u,%u) block (%u,%u,%u) (CUDA allows at most 1024 "
                  "threads per block, block z <= 64, grid y,z <= 65535, nothing empty)",
                  grid.x, grid.y, grid.z, bdim.x, bdim.y, bdim.z);
    return 1;
  }
  if (cfg->smem > cuda_emul_dsmem_capacity()) {
    std::snprintf(g_last_error, sizeof(g_last_error),
                  "dynamic shared memory of %llu bytes exceeds the emulator's %zu (the H100/H200 limit is "
                  "232448 bytes per block)", cfg->smem, cuda_emul_dsmem_capacity());
    return 1;
  }
  unsigned hw = std::thread::hardware_concurrency();
  int workers = cfg->workers > 0 ? cfg->workers : static_cast<int>(hw ? hw : 1);
  workers = static_cast<int>(std::min<unsigned long long>(static_cast<unsigned long long>(workers), nblocks));
  auto& blocks = worker_blocks();
  while (static_cast<int>(blocks.size()) < workers) blocks.push_back(new Block());
  const size_t stack_bytes = static_cast<size_t>(cfg->stack_kib ? cfg->stack_kib : 64) * 1024;
  for (int i = 0; i < workers; ++i) {
    blocks[i]->invoke = invoke;
    blocks[i]->ctx = ctx;
    if (!prepare_stacks(blocks[i], nthreads, stack_bytes)) {
      std::snprintf(g_last_error, sizeof(g_last_error), "could not map fiber stacks");
      return 1;
    }
  }
  FaultGuard fault_guard;
  std::atomic<unsigned long long> next{0};
  std::atomic<bool> failed{false};
  std::mutex err_mutex;
  auto work = [&](int wi) {
    AltStack alt;
    Block* b = blocks[wi];
    blockDim = bdim;
    gridDim = grid;
    for (;;) {
      if (failed.load()) return;
      const unsigned long long i = next.fetch_add(1);
      if (i >= nblocks) return;
      const uint3 bid{static_cast<unsigned>(i % grid.x), static_cast<unsigned>((i / grid.x) % grid.y),
                      static_cast<unsigned>(i / (1ull * grid.x * grid.y))};
      if (!run_block(b, bid, bdim, cfg->smem, cfg->schedule)) {
        std::lock_guard<std::mutex> g(err_mutex);
        if (!failed.exchange(true)) std::snprintf(g_last_error, sizeof(g_last_error), "%s", b->err);
        return;
      }
    }
  };
  if (workers == 1) {
    work(0);
  } else {
    std::vector<std::thread> ts;
    for (int i = 0; i < workers; ++i) ts.emplace_back(work, i);
    for (auto& t : ts) t.join();
  }
  return failed.load() ? 1 : 0;
}

// Each CUDA thread reads its parameters from args[] (the harness keeps those bytes alive
// and unchanged until the launch returns).  A plain pack expansion, not std::tuple /
// std::apply: the same call, without the library templates instantiated per kernel that
// made up about a quarter of a kernel library's g++ time at -Og.
template <class... A>
struct Launcher {
  void (*k)(A...);
  void** args;
  template <size_t... I>
  void call(std::index_sequence<I...>) const {
    k(*static_cast<std::decay_t<A>*>(args[I])...);
  }
  static void invoke(void* p) { static_cast<const Launcher*>(p)->call(std::index_sequence_for<A...>{}); }
};

// CUDA-style launch: args[i] points at the i-th parameter's value (as the
// driver's kernelParams), read as the kernel's declared parameter type.
template <class... A>
inline int launch(void (*k)(A...), const LaunchCfg* cfg, void** args) {
  Launcher<A...> c{k, args};
  return launch_impl(cfg, &Launcher<A...>::invoke, &c);
}

// ---- parameter signatures, for the harness to check the arguments it packs

template <class T> struct code_of { static constexpr const char* value = "?"; };
template <> struct code_of<bool> { static constexpr const char* value = "b1"; };
template <> struct code_of<signed char> { static constexpr const char* value = "i1"; };
template <> struct code_of<char> { static constexpr const char* value = "i1"; };
template <> struct code_of<unsigned char> { static constexpr const char* value = "u1"; };
template <> struct code_of<short> { static constexpr const char* value = "i2"; };
template <> struct code_of<unsigned short> { static constexpr const char* value = "u2"; };
template <> struct code_of<int> { static constexpr const char* value = "i4"; };
template <> struct code_of<unsigned int> { static constexpr const char* value = "u4"; };
template <> struct code_of<long> { static constexpr const char* value = "i8"; };
template <> struct code_of<unsigned long> { static constexpr const char* value = "u8"; };
template <> struct code_of<long long> { static constexpr const char* value = "i8"; };
template <> struct code_of<unsigned long long> { static constexpr const char* value = "u8"; };
template <> struct code_of<float> { static constexpr const char* value = "f4"; };
template <> struct code_of<double> { static constexpr const char* value = "f8"; };
template <> struct code_of<__half> { static constexpr const char* value = "f2"; };
template <> struct code_of<__nv_bfloat16> { static constexpr const char* value = "bf16"; };
template <> struct code_of<void> { static constexpr const char* value = "v"; };

// The signature string ("c*f4,i8:8,...") is a constant built at compile time: no
// std::string code generated per kernel.
template <class T>
constexpr size_t param_code_len() {
  using D = std::decay_t<T>;
  if constexpr (std::is_pointer_v<D>) {
    using E = std::remove_pointer_t<D>;
    return (std::is_const_v<E> ? 2 : 1) + std::char_traits<char>::length(code_of<std::remove_cv_t<E>>::value);
  } else {
    size_t n = 0;
    for (size_t v = sizeof(D); v; v /= 10) ++n;
    return std::char_traits<char>::length(code_of<D>::value) + 1 + n;
  }
}

template <class T>
constexpr void param_code_put(char*& o) {
  using D = std::decay_t<T>;
  const char* c;
  if constexpr (std::is_pointer_v<D>) {
    using E = std::remove_pointer_t<D>;
    if (std::is_const_v<E>) *o++ = 'c';
    *o++ = '*';
    c = code_of<std::remove_cv_t<E>>::value;
    while (*c) *o++ = *c++;
  } else {
    c = code_of<D>::value;
    while (*c) *o++ = *c++;
    *o++ = ':';
    char digits[24];
    int n = 0;
    for (size_t v = sizeof(D); v; v /= 10) digits[n++] = static_cast<char>('0' + v % 10);
    while (n) *o++ = digits[--n];
  }
  *o++ = ',';
}

template <class... A>
struct Signature {
  static constexpr size_t size = (size_t{1} + ... + (param_code_len<A>() + 1));
  static constexpr auto text = [] {
    struct { char s[size]; } r{};
    char* o = r.s;
    (param_code_put<A>(o), ...);
    *o = 0;
    return r;
  }();
};

template <class... A>
inline const char* signature(void (*)(A...)) {
  return Signature<A...>::text.s;
}

}  // namespace cuda_emul

// Exported to the harness (the prelude is included by exactly one translation unit).
extern "C" CUDA_EMUL_EXPORT const char* cuda_emul_last_error() { return cuda_emul::g_last_error; }
extern "C" CUDA_EMUL_EXPORT int cuda_emul_set_poison(const unsigned long long* offsets, const unsigned long long* sizes, int n,
                                    unsigned long long anchor_offset) {
  cuda_emul::g_poison.clear();
  for (int i = 0; i < n; ++i) cuda_emul::g_poison.emplace_back(offsets[i], sizes[i]);
  cuda_emul::g_anchor_offset = anchor_offset;
  return 0;
}

// --------------------------------------------------------------------------- alignment

// The kernels are compiled with -fsanitize=alignment and this handler instead
// of libubsan: a load or store through a pointer that is not aligned for its
// type (a 16-byte vector access at an 8-byte boundary, say) works on a CPU but
// faults on the GPU (cudaErrorMisalignedAddress), so it fails the launch here.
namespace cuda_emul {
struct UbsanLoc { const char* file; unsigned line, column; };
struct UbsanType { unsigned short kind, info; char name[1]; };
struct UbsanMismatch { UbsanLoc loc; const UbsanType* type; unsigned char log_align; unsigned char check_kind; };
inline void type_mismatch(UbsanMismatch* d, void* p) {
  static const char* const what[] = {"load of", "store to", "reference binding to", "member access within",
                                     "member call on", "constructor call on", "downcast of", "downcast of",
                                     "upcast of", "cast to virtual base of"};
  const char* w = d->check_kind < 10 ? what[d->check_kind] : "access to";
  if (tl_block == nullptr) {
    std::fprintf(stderr, "cuda_emul: misaligned %s %p (type %s) at %s:%u outside a kernel\n", w, p,
                 d->type->name, d->loc.file, d->loc.line);
    std::abort();
  }
  if (p == nullptr) fail("%s a null pointer of type %s at %s:%u:%u", w, d->type->name, d->loc.file, d->loc.line, d->loc.column);
  fail("misaligned address: %s %p, type %s needs %u-byte alignment (%s:%u:%u); on the GPU this launch "
       "fails with cudaErrorMisalignedAddress", w, p, d->type->name, 1u << d->log_align, d->loc.file,
       d->loc.line, d->loc.column);
}
}  // namespace cuda_emul
extern "C" void __ubsan_handle_type_mismatch_v1(cuda_emul::UbsanMismatch* d, void* p) { cuda_emul::type_mismatch(d, p); }
extern "C" void __ubsan_handle_type_mismatch_v1_abort(cuda_emul::UbsanMismatch* d, void* p) { cuda_emul::type_mismatch(d, p); }

// --------------------------------------------------------------------------- the intrinsics

#define __syncthreads() ::cuda_emul::barrier(__LINE__, 0, 0)
#define __syncthreads_count(p) static_cast<int>(::cuda_emul::barrier(__LINE__, (p) ? 1 : 0, 1))
#define __syncthreads_and(p) static_cast<int>(::cuda_emul::barrier(__LINE__, (p) ? 1 : 0, 2))
#define __syncthreads_or(p) static_cast<int>(::cuda_emul::barrier(__LINE__, (p) ? 1 : 0, 3))
#define __syncwarp(...) ::cuda_emul::syncwarp_(__LINE__ __VA_OPT__(,) __VA_ARGS__)
#define __shfl_sync(mask, var, ...) ::cuda_emul::shfl_(__LINE__, ::cuda_emul::OP_SHFL, mask, var, __VA_ARGS__)
#define __shfl_up_sync(mask, var, ...) ::cuda_emul::shfl_(__LINE__, ::cuda_emul::OP_SHFL_UP, mask, var, __VA_ARGS__)
#define __shfl_down_sync(mask, var, ...) ::cuda_emul::shfl_(__LINE__, ::cuda_emul::OP_SHFL_DOWN, mask, var, __VA_ARGS__)
#define __shfl_xor_sync(mask, var, ...) ::cuda_emul::shfl_(__LINE__, ::cuda_emul::OP_SHFL_XOR, mask, var, __VA_ARGS__)
#define __ballot_sync(mask, p) static_cast<unsigned>(::cuda_emul::warp_op(__LINE__, ::cuda_emul::OP_BALLOT, mask, (p) ? 1 : 0, 0, 32))
#define __any_sync(mask, p) static_cast<int>(::cuda_emul::warp_op(__LINE__, ::cuda_emul::OP_ANY, mask, (p) ? 1 : 0, 0, 32))
#define __all_sync(mask, p) static_cast<int>(::cuda_emul::warp_op(__LINE__, ::cuda_emul::OP_ALL, mask, (p) ? 1 : 0, 0, 32))

namespace cuda_emul {
inline void syncwarp_(int line, unsigned mask = 0xffffffffu) { warp_op(line, OP_SYNCWARP, mask, 0, 0, 32); }
template <class T>
inline T shfl_(int line, int op, unsigned mask, T var, int arg, int width = 32) {
  return shfl(line, op, mask, var, arg, width);
}
}  // namespace cuda_emul

// cp.async with real asynchronous semantics, for sources that check
// PN_EMUL_CP_ASYNC in their non-PTX branch: a copy is queued at issue (its
// source is read and its destination written only later), a commit closes
// the current group (cp.async.commit_group), and a wait for N performs every
// copy of the groups committed before the newest N (cp.async.wait_group N).
// So a read of the destination before the wait that covers it sees the
// shared memory's 0xFF fill or the previous contents.
#define PN_EMUL_CP_ASYNC 1
inline void pn_emul_cp_async(void* dst, const void* src, int bytes) {
  cuda_emul::Block* b = cuda_emul::tl_block;
  cuda_emul::Fiber& f = b->fibers[b->cur];
  f.cp_queue.push_back(cuda_emul::CpCopy{dst, src, bytes, f.cp_open});
}
inline void pn_emul_cp_commit() {
  cuda_emul::Block* b = cuda_emul::tl_block;
  ++b->fibers[b->cur].cp_open;
}
inline void pn_emul_cp_wait(int n) {
  cuda_emul::Block* b = cuda_emul::tl_block;
  cuda_emul::Fiber& f = b->fibers[b->cur];
  if (f.cp_open > static_cast<uint64_t>(n)) cuda_emul::cp_perform(f, f.cp_open - static_cast<uint64_t>(n));
}

// Lanes of the warp that have not exited (the hardware's answer in converged code).
inline unsigned __activemask() {
  const int t = cuda_emul::linear_tid();
  const auto& w = cuda_emul::tl_block->warps[t >> 5];
  return w.members & ~w.exited;
}
