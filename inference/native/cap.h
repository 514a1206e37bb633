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

}  // namespace kvs
