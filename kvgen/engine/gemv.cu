// kvgen engine: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows x (a decode step's small batch).
//
// Built by kvgen.engine.gemv through the runtime's CUDA loader (nvcc, the build cache keyed by this file's text)
// and called through ctypes on torch's current stream, so CUDA graphs capture it.
//
// Why it exists: at batch 1 cuBLAS reads a Llama-3-8B layer's q/k/v and o projections at about 0.6-0.75 of the
// copy bandwidth on an H200 (and splits o's K with a second reduce kernel); a decode step is a pass over the
// weights, so those bytes set its time. Design: one warp owns ROWS output columns (weight rows); its lanes walk
// k in 16-byte vectors (8 values), UNROLL vectors per lane in flight before any arithmetic, so a resident warp
// keeps ROWS * UNROLL * 512 bytes of loads outstanding and one wave of warps covers a 4096 x 4096 matrix. The
// weights are read once (L1 no-allocate); x is small and stays cached. float32 accumulation, one rounding.
// With pdl (every launch on Hopper unless KVGEN_PDL=0: kvgen/engine/pdl.py) a warp waits for the kernel that
// writes x inside its first chunk, between that chunk's weight loads and its x loads, and the next kernel may
// start once the loop is done: a launch and the previous kernel's tail overlap. ptxas (nvcc 13, sm_90a) schedules
// the wait ahead of those weight loads all the same, but the peeled first chunk is what lets it pipeline the loop
// after it: a wait before a plain loop (ef7acc6) made the batch-1 projections of Llama-3-8B 1-7% slower on an
// H200 (q/k/v 13.9 -> 14.6 us, o 9.7 -> 10.4, down 29.3 -> 30.9; benchmarks/results/2026-12-04-nvidia-h200).
// With KVGEN_PREFETCH_KB set, a block first asks L2 for that many bytes of its rows' first lines (prefetch, no
// result), ahead of the wait: an experiment, off by default (kvgen/engine/pdl.py).
//
// Contract (checked by the caller): K % 8 == 0; x, w, bias, out 16-byte aligned (x and out rows too: the row
// strides are multiples of 8 elements); w row-major [N, K] (unit stride in k); 1 <= m <= M_MAX.

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

// 8 packed 16-bit values -> float, by type
__device__ __forceinline__ void to_float8(const uint4& v, float* f, const __nv_bfloat16*) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // a bfloat16 is the top half of a float32: shifts, no conversion instruction
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ void to_float8(const uint4& v, float* f, const __half*) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&u[i]));
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

// Programmatic dependent launch (kvgen/engine/pdl.py): let the next kernel's blocks start (after the weight loop);
// wait for the previous kernel's completion and writes (in the first chunk). Both are no-ops in a launch without
// the attribute (and before Hopper).
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Ask L2 for the 128-byte line at p: no result, nothing waited for.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// A weight vector, read once: not kept in L1.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  // not volatile: the loads of a chunk may be scheduled together
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// A vector of x: an ordinary (coherent) load, not the read-only path: under PDL the kernel that writes x may still
// run while this one starts, and the non-coherent path is only for data no kernel writes during this one's lifetime.
__device__ __forceinline__ uint4 load_coherent(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p)
               : "memory");
  return v;
}

// One chunk of the k loop: UNROLL vectors per lane from each of the warp's ROWS weight rows and each of the m
// rows of x (lane's vector idx0 + 32 u), all loaded before the first use, then multiplied into acc. CHECKED: the
// chunk may run past k (the tail); those vectors read as zeros and add nothing. (nvcc writes every load first in
// PTX; ptxas then interleaves them with the FMAs, two vectors per lane in flight: measured, 2026-12-03.)
template <typename T, int M_MAX, int ROWS, int UNROLL, bool CHECKED, bool FIRST = false>
__device__ __forceinline__ void chunk(float (&acc)[M_MAX][ROWS], const uint4* const (&wv)[ROWS], const T* x, int m,
                                      long long x_stride, int idx0, int k8) {
  uint4 wreg[ROWS][UNROLL], xreg[M_MAX][UNROLL];
  const T* tag = nullptr;
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int idx = idx0 + u * 32;
    const bool in = !CHECKED || idx < k8;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wreg[r][u] = in ? load_stream(wv[r] + idx) : make_uint4(0, 0, 0, 0);
  }
  // the first chunk waits for the kernel before (PDL) between its weights and its x: x is that kernel's output
  if constexpr (FIRST) pdl_wait();
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int idx = idx0 + u * 32;
    const bool in = !CHECKED || idx < k8;
#pragma unroll
    for (int i = 0; i < M_MAX; ++i)
      xreg[i][u] = in && i < m ? load_coherent(reinterpret_cast<const uint4*>(x + i * x_stride) + idx)
                               : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    float xf[M_MAX][8];
#pragma unroll
    for (int i = 0; i < M_MAX; ++i) to_float8(xreg[i][u], xf[i], tag);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float wf[8];
      to_float8(wreg[r][u], wf, tag);
#pragma unroll
      for (int i = 0; i < M_MAX; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][r] = fmaf(wf[j], xf[i][j], acc[i][r]);
    }
  }
}

constexpr int WARPS = 4;  // per block: small blocks, so the last wave of a narrow matrix is short

template <typename T, int M_MAX, int ROWS, int UNROLL>
__global__ void __launch_bounds__(WARPS * 32) gemv_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                          const T* __restrict__ bias, T* __restrict__ out, int m,
                                                          int n, int k, long long x_stride, long long out_stride,
                                                          int prefetch_bytes) {
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= n) return;  // (no wait: this warp reads and writes nothing)
  const int k8 = k >> 3;
  const uint4* wv[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    // rows past n repeat the last one (computed, never stored): no branch in the loop
    const int row = row0 + r < n ? row0 + r : n - 1;
    wv[r] = reinterpret_cast<const uint4*>(w + (long long)row * k);
  }
  // Before the first chunk's wait (PDL): ask L2 for the first prefetch_bytes of the block's rows (a share each),
  // which no kernel writes, so a block launched during the previous kernel's tail has them in flight as it waits.
  // Every line lies within its row (line j starts at vector 8 j < k8). At least one line a row once asked for (as
  // the small GEMM takes at least one block); 0 with the switch off (kvgen/engine/pdl.py).
  const int lines = prefetch_bytes > 0 ? min(max(prefetch_bytes / (WARPS * ROWS * 128), 1), (k8 + 7) / 8) : 0;
  for (int j = lane; j < lines; j += 32)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) prefetch_l2(wv[r] + 8 * j);
  float acc[M_MAX][ROWS];
#pragma unroll
  for (int i = 0; i < M_MAX; ++i)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[i][r] = 0.f;

  // Whole chunks without bounds checks (their loads are free to issue together), then a checked tail; the
  // first chunk, whichever it is, is peeled: it holds the wait for the kernel before (PDL).
  int base = 0;
  if (32 * UNROLL <= k8) {
    chunk<T, M_MAX, ROWS, UNROLL, false, true>(acc, wv, x, m, x_stride, lane, k8);
    for (base = 32 * UNROLL; base + 32 * UNROLL <= k8; base += 32 * UNROLL)
      chunk<T, M_MAX, ROWS, UNROLL, false>(acc, wv, x, m, x_stride, base + lane, k8);
    if (base < k8) chunk<T, M_MAX, ROWS, UNROLL, true>(acc, wv, x, m, x_stride, base + lane, k8);
  } else {
    chunk<T, M_MAX, ROWS, UNROLL, true, true>(acc, wv, x, m, x_stride, lane, k8);
  }
  pdl_trigger();  // the weights are read: the next kernel's blocks may start
#pragma unroll
  for (int i = 0; i < M_MAX; ++i) {
    if (i >= m) break;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float v = acc[i][r];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      acc[i][r] = v;
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int row = row0 + r;
      if (row >= n) break;
      const float b = bias != nullptr ? to_float(bias[row]) : 0.f;
#pragma unroll
      for (int i = 0; i < M_MAX; ++i) {
        if (i >= m) break;
        store(out + i * out_stride + row, acc[i][r] + b);
      }
    }
  }
}

template <typename T, int M_MAX, int ROWS, int UNROLL>
int launch(const void* x, const void* w, const void* bias, void* out, int m, int n, int k, long long xs,
           long long os, cudaStream_t stream, int pdl, int prefetch) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((n + WARPS * ROWS - 1) / (WARPS * ROWS));
  cfg.blockDim = dim3(WARPS * 32);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, gemv_kernel<T, M_MAX, ROWS, UNROLL>, static_cast<const T*>(x),
                                             static_cast<const T*>(w), static_cast<const T*>(bias),
                                             static_cast<T*>(out), m, n, k, xs, os, prefetch);
  cudaGetLastError();  // (clears it: a failed launch must not fail the next CUDA call of the process too)
  return (int)err;
}

// The configs: (rows per warp, vectors per lane in flight). The Python side names them by index.
template <typename T, int M_MAX>
int launch_config(int config, const void* x, const void* w, const void* bias, void* out, int m, int n, int k,
                  long long xs, long long os, cudaStream_t stream, int pdl, int prefetch) {
  switch (config) {
    case 0: return launch<T, M_MAX, 1, 8>(x, w, bias, out, m, n, k, xs, os, stream, pdl, prefetch);
    case 1: return launch<T, M_MAX, 2, 4>(x, w, bias, out, m, n, k, xs, os, stream, pdl, prefetch);
    case 2: return launch<T, M_MAX, 4, 2>(x, w, bias, out, m, n, k, xs, os, stream, pdl, prefetch);
    case 3: return launch<T, M_MAX, 1, 4>(x, w, bias, out, m, n, k, xs, os, stream, pdl, prefetch);
    default: return -1;
  }
}

template <typename T>
int launch_rows(int config, const void* x, const void* w, const void* bias, void* out, int m, int n, int k,
                long long xs, long long os, cudaStream_t stream, int pdl, int prefetch) {
  if (m == 1) return launch_config<T, 1>(config, x, w, bias, out, m, n, k, xs, os, stream, pdl, prefetch);
  if (m == 2) return launch_config<T, 2>(config, x, w, bias, out, m, n, k, xs, os, stream, pdl, prefetch);
  if (m <= 4) return launch_config<T, 4>(config, x, w, bias, out, m, n, k, xs, os, stream, pdl, prefetch);
  return -1;
}

}  // namespace

extern "C" {

// The ABI version of kvgen_gemv's parameter list (the Python wrapper checks it).
int kvgen_abi_version(void) { return 3; }

const char* kvgen_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

// out[i, :] = x[i, :] @ w^T (+ bias) for i < m on `stream`; dtype 0 = float16, 1 = bfloat16; strides in elements;
// pdl != 0: launched with programmatic stream serialization (kvgen/engine/pdl.py; Hopper and newer); prefetch: the
// weight bytes a block asks L2 for before it waits (0: none).
// Returns 0, a CUDA error code, or -1 for an unknown config or m outside 1..4.
int kvgen_gemv(const void* x, const void* w, const void* bias, void* out, int m, int n, int k, long long x_stride,
               long long out_stride, int dtype, int config, void* stream, int pdl, int prefetch) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == 1)
    return launch_rows<__nv_bfloat16>(config, x, w, bias, out, m, n, k, x_stride, out_stride, s, pdl, prefetch);
  if (dtype == 0)
    return launch_rows<__half>(config, x, w, bias, out, m, n, k, x_stride, out_stride, s, pdl, prefetch);
  return -1;
}

}  // extern "C"
