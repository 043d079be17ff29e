// Cooperative fibers for kvgen_emu.h: every CUDA thread of a block is a fiber with its own stack, all run on
// the calling host thread, and a fiber gives way only where it waits at a barrier (a warp collective or
// __syncthreads). An OS thread a lane spent ~30 us in the kernel on each warp barrier; a fiber switch is a few
// nanoseconds on x86-64 (hand-written: callee-saved registers and the stack pointer) and a swapcontext elsewhere.
//
// Contract: run(n, entry) runs entry() on n fibers until every one has returned; entry may call Barrier::arrive,
// which returns once `expected` fibers have arrived at that barrier. A round in which no fiber arrives anywhere
// and none returns is a deadlock (some fiber waits at a barrier the others never reach): fail() is called.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

// KVGEN_EMU_UCONTEXT: take the portable switch on x86-64 too (the test of the fallback)
#if defined(__x86_64__) && !defined(KVGEN_EMU_UCONTEXT)
#define KVGEN_EMU_ASM_SWITCH 1
#else
#define KVGEN_EMU_ASM_SWITCH 0
#include <ucontext.h>
#endif

namespace kvgen_emu {

// A broken contract of the emulated code: one line, then abort (there is no returning from inside a grid).
[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "kvgen CUDA emulation: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

#if KVGEN_EMU_ASM_SWITCH
// kvgen_emu_switch(save, load): push the callee-saved registers, store the stack pointer in *save, load `load`
// as the stack pointer, pop that stack's registers and return into it (System V ABI; hidden: each emulation
// library binds its own copy)
extern "C" void kvgen_emu_switch(void** save, void* load);
asm(R"(
  .text
  .globl kvgen_emu_switch
  .hidden kvgen_emu_switch
  .type kvgen_emu_switch, @function
kvgen_emu_switch:
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
  .size kvgen_emu_switch, .-kvgen_emu_switch
)");

struct Context {
  void* sp = nullptr;
  // a fresh context that enters entry() (which must never return) on the stack [base, base + size)
  void make(unsigned char* base, size_t size, void (*entry)()) {
    auto top = reinterpret_cast<uintptr_t>(base + size) & ~uintptr_t(15);
    auto* frame = reinterpret_cast<void**>(top - 64);  // 6 registers, entry's address, a dummy return address
    for (int i = 0; i < 6; ++i) frame[i] = nullptr;
    frame[6] = reinterpret_cast<void*>(entry);
    frame[7] = nullptr;  // entry sees rsp = top - 8, as after a call
    sp = frame;
  }
};
inline void switch_context(Context& from, Context& to) { kvgen_emu_switch(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
  void make(unsigned char* base, size_t size, void (*entry)()) {
    getcontext(&uc);
    uc.uc_stack.ss_sp = base;
    uc.uc_stack.ss_size = size;
    uc.uc_link = nullptr;
    makecontext(&uc, entry, 0);
  }
};
inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

struct Fiber {
  Context ctx;
  unsigned char* stack = nullptr;
  bool done = true;
  void* user = nullptr;  // the caller's state of this fiber (kvgen_emu.h: the CUDA thread it plays)
};

struct Scheduler {
  static constexpr size_t kStack = 512 * 1024;  // per fiber; a guard page below each catches an overflow
  static constexpr size_t kGuard = 4096;
  std::vector<Fiber> fibers;
  unsigned char* arena = nullptr;
  Context main;
  Fiber* current = nullptr;
  const std::function<void()>* entry = nullptr;
  unsigned long long arrivals = 0, returns = 0;

  explicit Scheduler(int n) : fibers(n) {
    const size_t bytes = size_t(n) * (kStack + kGuard);
    void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) fail("cannot map the fibers' stacks");
    arena = static_cast<unsigned char*>(mem);
    for (int i = 0; i < n; ++i) {
      unsigned char* slot = arena + size_t(i) * (kStack + kGuard);
      mprotect(slot, kGuard, PROT_NONE);
      fibers[i].stack = slot + kGuard;
    }
  }
  ~Scheduler() { munmap(arena, fibers.size() * (kStack + kGuard)); }
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  static Scheduler*& active() {
    static Scheduler* s = nullptr;
    return s;
  }
  static void trampoline() {
    Scheduler& s = *active();
    (*s.entry)();
    s.current->done = true;
    ++s.returns;
    switch_context(s.current->ctx, s.main);
    fail("a finished fiber was resumed");
  }
  // run fn on every fiber until all have returned
  void run(const std::function<void()>& fn) {
    entry = &fn;
    Scheduler* outer = active();
    active() = this;
    for (auto& f : fibers) {
      f.ctx.make(f.stack, kStack, &Scheduler::trampoline);
      f.done = false;
    }
    for (bool live = true; live;) {
      const unsigned long long a0 = arrivals, r0 = returns;
      live = false;
      for (auto& f : fibers) {
        if (f.done) continue;
        current = &f;
        switch_context(main, f.ctx);
        current = nullptr;
        live = live || !f.done;
      }
      if (live && arrivals == a0 && returns == r0)
        fail("deadlock: every live CUDA thread waits at a barrier the others never reach");
    }
    active() = outer;
  }
  void yield() { switch_context(current->ctx, main); }
};

// A barrier of `expected` fibers, reusable: the last to arrive opens it for the others.
struct Barrier {
  explicit Barrier(int n) : expected(n) {}
  int expected;
  int count = 0;
  unsigned phase = 0;
  void arrive() {
    Scheduler& s = *Scheduler::active();
    ++s.arrivals;
    const unsigned mine = phase;
    if (++count == expected) {
      count = 0;
      ++phase;
      return;
    }
    while (phase == mine) s.yield();
  }
};

}  // namespace kvgen_emu
