// The emulated platform primitives on their own (tests/kernels/test_cuda_emu_primitives.py checks them against
// host math written independently): one warp, one block. Built with kvgen_emu.h like a rendered kernel.
#include "kvgen_emu.h"

struct PrimArgs {
  const uint32_t* a;   // [32][4] A fragments, float16
  const uint32_t* b;   // [32][2] B fragments, float16
  const float* c;      // [32][4] accumulators in
  float* d;            // [32][4] accumulators out
  const uint32_t* bf_a;  // the same for bfloat16
  const uint32_t* bf_b;
  float* bf_d;
  const uint32_t* t_in;  // [32] 8x8 16-bit fragments
  uint32_t* t_out;
  float* shfl;           // [32]: lane ^ 5's value
  int* votes;            // [32]: any(lane == 17) + 2 any(false)
  const unsigned char* src;  // 64 bytes
  unsigned char* before;     // [64]: shared memory after the copies are issued, before their wait
  unsigned char* after;      // [64]: after cp_async_wait<1> (the first group landed)
  unsigned char* final;      // [64]: after cp_async_wait<0>
  uint32_t* lop;             // [32]: lop3<0xEA>(x, mask, magic) and prmt
  const unsigned short* e4m3;  // [32] pairs of e4m3 codes
  uint32_t* e4m3_out;
};

__global__ void primitives(const PrimArgs p) {
  KVGEN_DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x;
  float acc[4] = {p.c[4 * lane], p.c[4 * lane + 1], p.c[4 * lane + 2], p.c[4 * lane + 3]};
  const uint32_t fa[4] = {p.a[4 * lane], p.a[4 * lane + 1], p.a[4 * lane + 2], p.a[4 * lane + 3]};
  mma_m16n8k16(acc, fa, p.b[2 * lane], p.b[2 * lane + 1], __half());
  for (int i = 0; i < 4; ++i) p.d[4 * lane + i] = acc[i];
  float bacc[4] = {p.c[4 * lane], p.c[4 * lane + 1], p.c[4 * lane + 2], p.c[4 * lane + 3]};
  const uint32_t fb[4] = {p.bf_a[4 * lane], p.bf_a[4 * lane + 1], p.bf_a[4 * lane + 2], p.bf_a[4 * lane + 3]};
  mma_m16n8k16(bacc, fb, p.bf_b[2 * lane], p.bf_b[2 * lane + 1], __nv_bfloat16());
  for (int i = 0; i < 4; ++i) p.bf_d[4 * lane + i] = bacc[i];

  p.t_out[lane] = transpose8x8(p.t_in[lane]);
  p.shfl[lane] = __shfl_xor_sync(0xffffffffu, float(lane) + 0.5f, 5);
  p.votes[lane] = __any_sync(0xffffffffu, lane == 17) + 2 * __any_sync(0xffffffffu, 0);
  p.lop[lane] = lop3<0xEA>(p.t_in[lane], 0x000F000Fu, 0x64006400u) ^
                __byte_perm(p.t_in[lane], p.t_in[31 - lane], 0x0415 + lane % 3);
  p.e4m3_out[lane] = cvt_e4m3x2_f16x2(p.e4m3[lane]);

  // lanes 0-3 copy 16 bytes each (lane 3's zero-filled): lanes 0-1 in their first group (then an empty one), lanes
  // 2-3 in their second (after an empty one), so a wait for all but one group lands lanes 0-1's copies alone
  if (lane < 2) {
    cp_async<16>(smem + 16 * lane, p.src + 16 * lane, true);
    cp_async_commit();
    cp_async_commit();
  } else if (lane < 4) {
    cp_async_commit();
    cp_async<16>(smem + 16 * lane, p.src + 16 * lane, lane != 3);
    cp_async_commit();
  }
  __syncwarp();
  if (lane == 0)
    for (int i = 0; i < 64; ++i) p.before[i] = smem[i];
  __syncwarp();
  cp_async_wait<1>();
  __syncwarp();
  if (lane == 0)
    for (int i = 0; i < 64; ++i) p.after[i] = smem[i];
  __syncwarp();
  cp_async_wait<0>();
  __syncwarp();
  if (lane == 0)
    for (int i = 0; i < 64; ++i) p.final[i] = smem[i];
}

extern "C" int run_primitives(const PrimArgs* p) {
  return int(launch_ex(primitives, dim3(1), dim3(32), 64, nullptr, false, *p));
}

// Shared-memory reads of known bank behaviour, one warp (the test reads kvgen_emu_lds_stats after it)
__global__ void bank_patterns() {
  KVGEN_DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x;
  uint32_t w[4];
  lds_words<4>(w, smem + 4 * lane);      // consecutive words: 1 pass, 1 wavefront
  lds_words<4>(w, smem + 128 * lane);    // 32 words on one bank: 32 wavefronts
  lds_words<4>(w, smem);                 // one word for all: a broadcast, 1 wavefront
  lds_words<16>(w, smem + 16 * lane);    // 4 quarter-warp passes of consecutive chunks: 4 wavefronts
  lds_words<16>(w, smem + 128 * lane);   // 4 passes, 8 lanes on banks 0-3 in each: 32 wavefronts
  lds_words<8>(w, smem + 8 * lane);      // 2 half-warp passes: 2 wavefronts
  lds_words<2>(w, smem + 2 * lane);      // two lanes a word: 1 wavefront
}

extern "C" int run_bank_patterns() {
  return int(launch_ex(bank_patterns, dim3(1), dim3(32), 4096, nullptr, false));
}
