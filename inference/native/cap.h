// The widest build a native loop may run: the CPU's own, capped by torch's own ATEN_CPU_CAPABILITY (default | avx2 |
// avx512), so that a test or a benchmark runs this CPU as a narrower one (with ONEDNN_MAX_CPU_ISA for oneDNN).
#pragma once

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>

namespace kvs {

// 0 generic, 1 avx2, 2 avx512 (read once)
inline int capability_cap() {
  static const int cap = [] {
    const char* raw = std::getenv("ATEN_CPU_CAPABILITY");
    std::string v = raw ? raw : "";
    v.erase(std::remove_if(v.begin(), v.end(), [](unsigned char c) { return std::isspace(c); }), v.end());
    std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
    return v == "default" ? 0 : v == "avx2" ? 1 : 2;
  }();
  return cap;
}

// 0 generic, 1 avx2 (with fma, bmi2), 2 avx512 (f, dq, vl, bw, with fma, bmi2): the widest this CPU runs, no wider
// than capability_cap(); the attention and argmax loops are built for exactly these
inline int best_simd() {
  int cpu = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
  cpu = avx512 ? 2 : avx2 ? 1 : 0;
#endif
  return std::min(cpu, capability_cap());
}

}  // namespace kvs
