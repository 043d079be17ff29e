// A host emulation of templates/cuda/platform.j2: the CUDA decode templates compiled by g++ and run on the CPU,
// one fiber per CUDA thread, so that CI checks their index math, fragment layouts, pipelines and numerics
// without a GPU (it says nothing of their speed). tests/cuda_emu/cuda/platform.j2 includes this file in place of
// the real platform; tests/cuda_emu/emulate.py renders, builds and calls the kernels.
//
// What it models, and how faithfully:
// - Blocks run one after another on the calling thread; a block's CUDA threads are fibers (kvgen_emu_fibers.h)
//   that take turns wherever one waits. Warp-collective operations (mma, movmatrix, shuffles, votes, __syncwarp)
//   meet at a barrier of the warp's 32 lanes, __syncthreads at one of the block's; a barrier some threads never
//   reach is reported as a deadlock. A mask other than the full warp's is refused (the templates use none).
// - Shared memory is one buffer a block, poisoned with 0xFF bytes (NaN in every 16-bit float type) between
//   canaries that are checked after the block: a read of a byte no copy or store wrote shows as NaN, a write past
//   either end fails the launch.
// - cp.async copies are queued and land only when a cp_async_wait retires their group (the latest the hardware
//   may land them), so a read of a stage before its wait reads the previous tile's bytes or poison. A copy must
//   be aligned to its size and land inside the block's shared memory.
// - Shared-memory reads of a stage (lds_words) must lie inside the block's shared memory, aligned to their size;
//   the bank model (kvgen_emu_banks.h) counts the wavefronts the hardware would serve each warp-wide read in.
// - mma.sync m16n8k16: the fragment layouts of the PTX ISA; products exact and sums in double, rounded to float
//   once (the tensor cores' fp32 accumulation rounds more often: tolerances, not bits, compare the two).
// - ex2.approx is exp2f, lop3 and prmt are exact bit operations, half2 arithmetic is cuda_fp16.h's host code.
// - The launch API: dynamic shared memory past 48 KB needs cudaFuncSetAttribute first and at most 227 KB (an
//   H100's opt-in limit), as on the device; the failure is a cudaError_t the entry point returns.
// A contract broken inside a kernel (a misaligned copy, a partial mask, a deadlock, a fiber's stack overflowing
// into its guard page) ends the process with one line: the emulation has no way to return from a grid.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kvgen_emu_banks.h"
#include "kvgen_emu_fibers.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define __launch_bounds__(...)

namespace kvgen_emu {

constexpr size_t kSmemDefault = 48 * 1024;    // dynamic shared memory without the opt-in attribute
constexpr size_t kSmemOptIn = 227 * 1024;     // the most an H100 block may opt into
constexpr size_t kCanary = 64;                // poisoned guard bytes either side of a block's shared memory
constexpr unsigned char kCanaryByte = 0xA5;

struct Warp {
  explicit Warp(int n) : bar(n), lanes(n) {}  // the last warp of a block may be partial
  Barrier bar;
  // each lane's operands of a collective, in two buffers used by turns: a lane writes the next collective's while
  // slower lanes still read this one's, and cannot come round to this buffer again before they pass the next
  // barrier, so one barrier a collective suffices
  uint32_t slot[2][32][8];
  // shared-memory reads (lds_words) not yet joined by every lane: the warp's n-th read is each lane's n-th
  std::deque<LdsOp> lds;
  unsigned long long lds_done = 0;  // reads every lane has made (popped from the front of `lds`)
  int lanes;
};

struct Block {
  Block(int threads, size_t smem_bytes)
      : bar(threads), bytes(smem_bytes), mem(smem_bytes + 2 * kCanary + 16) {
    unsigned char* base = mem.data();
    base += (16 - reinterpret_cast<uintptr_t>(base) % 16) % 16;
    lo_guard = base;
    smem = base + kCanary;
    poison();
    for (int w = 0; w < (threads + 31) / 32; ++w) warps.emplace_back(new Warp(std::min(32, threads - 32 * w)));
  }
  void poison() {
    std::memset(lo_guard, kCanaryByte, kCanary);
    std::memset(smem, 0xFF, bytes);
    std::memset(smem + bytes, kCanaryByte, kCanary);
  }
  bool canaries_intact() const {
    for (size_t i = 0; i < kCanary; ++i)
      if (lo_guard[i] != kCanaryByte || smem[bytes + i] != kCanaryByte) return false;
    return true;
  }
  Barrier bar;
  size_t bytes;
  std::vector<unsigned char> mem;
  unsigned char* lo_guard = nullptr;
  unsigned char* smem = nullptr;
  std::vector<std::unique_ptr<Warp>> warps;
};

struct Copy {
  void* dst;
  const void* src;
  int bytes;
  bool valid;
};

// The CUDA thread a fiber plays.
struct Thread {
  dim3 block_idx, thread_idx, grid_dim, block_dim;
  Block* block = nullptr;
  Warp* warp = nullptr;
  int lane = 0;
  std::vector<Copy> open;                 // cp.async copies not yet committed
  std::vector<std::vector<Copy>> groups;  // committed groups, oldest first
  unsigned turn = 0;                      // collectives this lane has joined (the slot buffer is turn % 2)
  unsigned long long lds_made = 0;        // shared-memory reads this lane has made
};
inline Thread& me() { return *static_cast<Thread*>(Scheduler::active()->current->user); }

inline void warp_sync() { me().warp->bar.arrive(); }
inline void check_mask(unsigned mask) {
  if (mask != 0xffffffffu) fail("a warp collective with a partial mask (the emulation models full warps only)");
}
// Publish this lane's N words for a collective and wait for the warp's: returns every lane's words (valid until
// this lane's next collective but one)
template <int N>
inline const uint32_t (&publish(const uint32_t (&words)[N]))[32][8] {
  static_assert(N <= 8, "slot size");
  auto& buf = me().warp->slot[me().turn++ % 2];
  std::memcpy(buf[me().lane], words, sizeof(words));
  warp_sync();
  return buf;
}

template <class T>
inline uint32_t bits_of(T v) {
  static_assert(sizeof(T) == 4, "32-bit values");
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}
template <class T>
inline T from_bits(uint32_t u) {
  T v;
  std::memcpy(&v, &u, 4);
  return v;
}

// the value of a 16-bit float: float16 through a table (cuda_fp16.h's host conversion is a function call per
// element), bfloat16 by a shift
inline const float* half_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t h = 0; h < 65536; ++h) {
      __half_raw r;
      r.x = uint16_t(h);
      t[h] = __half2float(__half(r));
    }
    return t;
  }();
  return table.data();
}
inline float half_value(uint16_t h, __half) { return half_table()[h]; }
inline float half_value(uint16_t h, __nv_bfloat16) { return from_bits<float>(uint32_t(h) << 16); }

template <class T>
inline void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  const auto& s = publish(mine);
  const int g = me().lane / 4, c = me().lane % 4;
  // this lane's rows g, g + 8 of A [16 x 16] (row r, column k: lane (r % 8) * 4 + (k % 8) / 2, register
  // (r >= 8) + 2 (k >= 8), half k % 2) and columns 2c, 2c + 1 of B [16 x 8] (row k, column n: lane n * 4 +
  // (k % 8) / 2, register 4 + (k >= 8), half k % 2)
  float A[2][16], B[2][16];
  for (int k = 0; k < 16; ++k) {
    for (int h = 0; h < 2; ++h) {
      const uint32_t wa = s[g * 4 + (k % 8) / 2][h + 2 * (k >= 8)];
      const uint32_t wb = s[(2 * c + h) * 4 + (k % 8) / 2][4 + (k >= 8)];
      A[h][k] = half_value(uint16_t(k % 2 ? wa >> 16 : wa & 0xFFFF), T());
      B[h][k] = half_value(uint16_t(k % 2 ? wb >> 16 : wb & 0xFFFF), T());
    }
  }
  // C/D: c0, c1 (row g, columns 2c, 2c + 1), c2, c3 (row g + 8); products exact in double, one rounding
  for (int i = 0; i < 4; ++i) {
    double acc = d[i];
    for (int k = 0; k < 16; ++k) acc += double(A[i >> 1][k]) * double(B[i & 1][k]);
    d[i] = static_cast<float>(acc);
  }
}

inline void perform(const Copy& cp) {
  const auto* s = static_cast<const unsigned char*>(me().block->smem);
  const auto* dst = static_cast<unsigned char*>(cp.dst);
  if (dst < s || dst + cp.bytes > s + me().block->bytes) fail("cp.async into bytes outside the block's shared memory");
  if (cp.valid)
    std::memcpy(cp.dst, cp.src, cp.bytes);
  else
    std::memset(cp.dst, 0, cp.bytes);
}

inline void record_lds(const unsigned char* p, int bytes) {
  Thread& t = me();
  Warp& w = *t.warp;
  const unsigned long long i = t.lds_made++ - w.lds_done;
  while (w.lds.size() <= i) w.lds.emplace_back();
  LdsOp& op = w.lds[i];
  op.bytes = bytes;
  op.offset[t.lane] = p - t.block->smem;
  ++op.joined;
  while (!w.lds.empty() && w.lds.front().joined == w.lanes) {
    account(w.lds.front(), w.lanes);
    w.lds.pop_front();
    ++w.lds_done;
  }
}

// kernel pointer -> the dynamic shared memory it may launch with
inline std::mutex attr_mutex;
inline std::map<const void*, size_t> smem_limits;
inline size_t smem_limit(const void* kernel) {
  std::lock_guard<std::mutex> lock(attr_mutex);
  const auto it = smem_limits.find(kernel);
  return it == smem_limits.end() ? kSmemDefault : it->second;
}

// Run every block of the grid with body() as each thread's kernel call; aborts on a deadlock or a write past
// a block's shared memory.
inline void run_grid(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body) {
  const int threads = int(block.x * block.y * block.z);
  Block blk(threads, smem);
  Scheduler sched(threads);
  std::vector<Thread> state(threads);
  for (int t = 0; t < threads; ++t) sched.fibers[t].user = &state[t];
  for (unsigned i = 0; i < grid.x * grid.y * grid.z; ++i) {
    blk.poison();
    for (auto& w : blk.warps) {
      w->lds.clear();  // reads some lanes never joined (a divergent warp) are not counted
      w->lds_done = 0;
    }
    for (int t = 0; t < threads; ++t) {
      Thread& th = state[t];
      th = Thread();
      th.block_idx = dim3(i % grid.x, (i / grid.x) % grid.y, i / (grid.x * grid.y));
      th.thread_idx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
      th.grid_dim = grid;
      th.block_dim = block;
      th.block = &blk;
      th.warp = blk.warps[t / 32].get();
      th.lane = t % 32;
    }
    sched.run(body);  // copies a thread never waited for are dropped, as the hardware drops them at exit
    if (!blk.canaries_intact()) fail("a store past the end (or before the start) of a block's shared memory");
  }
}

}  // namespace kvgen_emu

// ----------------------------------------------------------------------------------------------- CUDA built-ins

#define blockIdx (kvgen_emu::me().block_idx)
#define threadIdx (kvgen_emu::me().thread_idx)
#define gridDim (kvgen_emu::me().grid_dim)
#define blockDim (kvgen_emu::me().block_dim)
#define KVGEN_DYNAMIC_SMEM(name) unsigned char* const name = kvgen_emu::me().block->smem

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __uint_as_float(unsigned x) { return kvgen_emu::from_bits<float>(x); }
inline float __int_as_float(int x) { return kvgen_emu::from_bits<float>(static_cast<uint32_t>(x)); }
inline int __float_as_int(float x) { return static_cast<int>(kvgen_emu::bits_of(x)); }
inline float __log2f(float x) { return log2f(x); }
template <class T>
inline T __ldg(const T* p) {
  return *p;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = (uint64_t(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned sel = (s >> (4 * i)) & 0xF;
    if (sel & 8) kvgen_emu::fail("__byte_perm with a sign-replicating selector (not emulated)");
    r |= unsigned((v >> (8 * sel)) & 0xFF) << (8 * i);
  }
  return r;
}
// cuda_fp16.h has no host __hfma2: one rounding of the exact a * b + c (double holds it for every operand the
// templates pass)
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  const float2 fa = __half22float2(a), fb = __half22float2(b), fc = __half22float2(c);
  return __halves2half2(__double2half(double(fa.x) * fb.x + fc.x), __double2half(double(fa.y) * fb.y + fc.y));
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  kvgen_emu::check_mask(mask);
  kvgen_emu::warp_sync();
}
inline void __syncthreads() { kvgen_emu::me().block->bar.arrive(); }
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  kvgen_emu::check_mask(mask);
  const uint32_t mine[1] = {kvgen_emu::bits_of(v)};
  const auto& s = kvgen_emu::publish(mine);
  return kvgen_emu::from_bits<T>(s[(kvgen_emu::me().lane ^ lane_mask) & 31][0]);
}
inline int __any_sync(unsigned mask, int pred) {
  kvgen_emu::check_mask(mask);
  const uint32_t mine[1] = {pred ? 1u : 0u};
  const auto& s = kvgen_emu::publish(mine);
  int any = 0;
  for (int l = 0; l < 32; ++l) any |= int(s[l][0]);
  return any;
}

// ------------------------------------------------------------------------- the launch API kvgen's entry points use

// cudaError_t, cudaFuncAttribute, cudaDeviceAttr and cudaStream_t come with cuda_fp16.h (driver_types.h)

inline thread_local cudaError_t kvgen_emu_last_error = cudaSuccess;
inline cudaError_t kvgen_emu_error(cudaError_t e) {
  if (e != cudaSuccess) kvgen_emu_last_error = e;
  return e;
}
inline cudaError_t cudaGetLastError() {
  const cudaError_t e = kvgen_emu_last_error;
  kvgen_emu_last_error = cudaSuccess;
  return e;
}
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    default: return "unknown error";
  }
}
inline cudaError_t cudaGetDevice(int* dev) {
  *dev = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  if (attr != cudaDevAttrComputeCapabilityMajor) return kvgen_emu_error(cudaErrorInvalidValue);
  *value = 9;  // an sm_90 device: the entry points take their Hopper paths (PDL is a no-op here)
  return cudaSuccess;
}
template <class F>
inline cudaError_t cudaFuncSetAttribute(F* kernel, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || size_t(value) > kvgen_emu::kSmemOptIn)
    return kvgen_emu_error(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(kvgen_emu::attr_mutex);
  kvgen_emu::smem_limits[reinterpret_cast<const void*>(kernel)] = size_t(value);
  return cudaSuccess;
}

// ----------------------------------------------------------------------------------- platform.j2's primitives

inline void pdl_wait() {}
inline void pdl_trigger() {}

template <class... KArgs, class... Args>
cudaError_t launch_ex(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t, bool,
                      Args&&... args) {
  if (smem > kvgen_emu::smem_limit(reinterpret_cast<const void*>(kernel)))
    return kvgen_emu_error(cudaErrorInvalidValue);
  const unsigned threads = block.x * block.y * block.z;
  if (threads == 0 || threads > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.y > 65535 || grid.z > 65535)
    return kvgen_emu_error(cudaErrorInvalidConfiguration);
  const std::tuple<std::decay_t<KArgs>...> params(std::forward<Args>(args)...);
  kvgen_emu::run_grid(grid, block, smem, [&] { std::apply(kernel, params); });
  return cudaSuccess;
}

template <int BYTES>
inline void lds_words(uint32_t* w, const unsigned char* p) {
  static_assert(BYTES == 16 || BYTES == 8 || BYTES == 4 || BYTES == 2, "shared reads are 2, 4, 8 or 16 bytes");
  const unsigned char* s = kvgen_emu::me().block->smem;
  if (p < s || p + BYTES > s + kvgen_emu::me().block->bytes || reinterpret_cast<uintptr_t>(p) % BYTES)
    kvgen_emu::fail("a shared-memory read outside the block's shared memory or not aligned to its size");
  kvgen_emu::record_lds(p, BYTES);
  if constexpr (BYTES == 2) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    w[0] = h;
  } else {
    std::memcpy(w, p, BYTES);
  }
}

// the counters of kvgen_emu::account (reads, ideal, wavefronts: every read, then reads of 2, 4, 8 and 16 bytes),
// read and reset by tests/cuda_emu/emulate.py
extern "C" void kvgen_emu_lds_stats(unsigned long long* out, int reset) {
  for (int i = 0; i < 5; ++i) {
    out[3 * i] = kvgen_emu::lds_stats[i].reads;
    out[3 * i + 1] = kvgen_emu::lds_stats[i].ideal;
    out[3 * i + 2] = kvgen_emu::lds_stats[i].wavefronts;
    if (reset) kvgen_emu::lds_stats[i] = kvgen_emu::LdsStats();
  }
}

template <int BYTES>
inline void cp_async(void* dst, const void* src, bool valid) {
  static_assert(BYTES == 16 || BYTES == 8 || BYTES == 4, "cp.async copies 4, 8 or 16 bytes");
  if (reinterpret_cast<uintptr_t>(dst) % BYTES || (valid && reinterpret_cast<uintptr_t>(src) % BYTES))
    kvgen_emu::fail("a cp.async not aligned to its size");
  kvgen_emu::me().open.push_back({dst, src, BYTES, valid});
}
inline void cp_async_commit() {
  kvgen_emu::me().groups.push_back(std::move(kvgen_emu::me().open));
  kvgen_emu::me().open.clear();
}
template <int N>
inline void cp_async_wait() {
  auto& groups = kvgen_emu::me().groups;
  while (groups.size() > size_t(N)) {
    for (const auto& cp : groups.front()) kvgen_emu::perform(cp);
    groups.erase(groups.begin());
  }
}

inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, __half) {
  kvgen_emu::mma<__half>(d, a, b0, b1);
}
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, __nv_bfloat16) {
  kvgen_emu::mma<__nv_bfloat16>(d, a, b0, b1);
}

// movmatrix .trans: lane (g, c) receives elements (2c, g) and (2c + 1, g); element (r, k) is held by lane
// r * 4 + k / 2, half k % 2
inline uint32_t transpose8x8(uint32_t x) {
  const uint32_t mine[1] = {x};
  const auto& s = kvgen_emu::publish(mine);
  const int g = kvgen_emu::me().lane / 4, c = kvgen_emu::me().lane % 4;
  auto elem = [&](int r, int k) { return (s[r * 4 + k / 2][0] >> (16 * (k % 2))) & 0xFFFFu; };
  return elem(2 * c, g) | (elem(2 * c + 1, g) << 16);
}

// ex2.approx.ftz: exp2 with subnormal inputs and results flushed to zero
inline float fast_exp2(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.f;
  const float y = exp2f(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;
}

// cvt.rn.f16x2.e4m3x2: e4m3fn is s.eeee.mmm with bias 7, subnormals at exponent 0, NaN at eeee.mmm = 1111.111
// and no infinities; every value is a float16 (the NaN becomes the canonical 0x7FFF)
inline uint32_t cvt_e4m3x2_f16x2(unsigned short x) {
  uint32_t out = 0;
  for (int i = 0; i < 2; ++i) {
    const unsigned code = (x >> (8 * i)) & 0xFF, e = (code >> 3) & 0xF, m = code & 7;
    uint16_t h;
    if (e == 15 && m == 7) {
      h = 0x7FFF;
    } else {
      const float mag = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), int(e) - 10);
      h = __half_raw(__float2half_rn(code & 0x80 ? -mag : mag)).x;
    }
    out |= uint32_t(h) << (16 * i);
  }
  return out;
}

template <int LUT>
inline uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d = 0;
  for (int i = 0; i < 8; ++i) {
    if (LUT >> i & 1) d |= (i & 4 ? a : ~a) & (i & 2 ? b : ~b) & (i & 1 ? c : ~c);
  }
  return d;
}
