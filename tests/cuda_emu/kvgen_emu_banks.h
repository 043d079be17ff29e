// The bank model of kvgen_emu.h: how the hardware serves one warp-wide shared-memory read (lds_words), and the
// counters tests/cuda_emu/emulate.py reads (EmulatedDecode.lds_stats). Plain C++, no state of the emulation.
#pragma once

#include <algorithm>
#include <cstdint>

namespace kvgen_emu {

// One warp-wide shared-memory read: each lane's byte offset into the block's shared memory.
struct LdsOp {
  int bytes = 0;
  int joined = 0;
  long long offset[32];
};

// Bank conflicts of the shared-memory reads (lds_words), counted as the hardware serves them: a read of 4 bytes or
// less a lane in one pass of the warp, of 8 bytes in two (half warps), of 16 in four (quarter warps); a pass takes
// as many wavefronts as its most-used bank has distinct 4-byte words (a word several lanes read is broadcast).
// `ideal` is the passes alone.
struct LdsStats {
  unsigned long long reads = 0, ideal = 0, wavefronts = 0;
};
inline LdsStats lds_stats[5];  // every read, then by width: 2, 4, 8, 16 bytes
inline int width_index(int bytes) { return bytes == 2 ? 1 : bytes == 4 ? 2 : bytes == 8 ? 3 : 4; }

inline void account(const LdsOp& op, int lanes) {
  const int per_pass = op.bytes <= 4 ? 32 : op.bytes == 8 ? 16 : 8;
  LdsStats& all = lds_stats[0];
  LdsStats& by_width = lds_stats[width_index(op.bytes)];
  ++all.reads;
  ++by_width.reads;
  for (int first = 0; first < lanes; first += per_pass) {
    long long words[32][32];  // per bank, the distinct words read
    int n[32] = {};
    for (int l = first; l < std::min(first + per_pass, lanes); ++l) {
      for (long long w = op.offset[l] / 4; w <= (op.offset[l] + op.bytes - 1) / 4; ++w) {
        const int bank = int(w % 32);
        bool seen = false;
        for (int i = 0; i < n[bank]; ++i) seen = seen || words[bank][i] == w;
        if (!seen && n[bank] < 32) words[bank][n[bank]++] = w;
      }
    }
    const int waves = std::max(1, *std::max_element(n, n + 32));
    ++all.ideal;
    ++by_width.ideal;
    all.wavefronts += waves;
    by_width.wavefronts += waves;
  }
}

}  // namespace kvgen_emu
