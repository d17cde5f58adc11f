// What a kernel path exports to the module (module.cpp): for a GGUF type, the function that
// multiplies one weight row with a tile of activation rows (dot.h's order). Each path is its own
// translation unit (scalar.cpp, avx2.cpp, avx512.cpp), built without torch's headers: a kernel change
// rebuilds in seconds, and nothing compiled for AVX2 or AVX-512 leaks into code another path
// runs.

#pragma once

#include "dot.h"
#include "panels.h"

namespace vq {

// out[t * ldy] = activation row (r0 + t) . weight `row` (K values) for t < rows <= MAX_TILE.
using RowsFn = void (*)(const uint8_t* row, int64_t K, const Activations& x, int64_t r0,
                        int64_t rows, float* out, int64_t ldy);

RowsFn rows_for(int type);  // nullptr for a type without kernels

// out[t * ldy + 0 .. 15] = activation row (r0 + t) . the panel's 16 weight rows, in panels.h's
// order, for t < rows <= MAX_TILE.
using PanelFn = void (*)(const uint8_t* panel, int64_t K, const Activations& x,
                         const PanelSums& sums, int64_t r0, int64_t rows, float* out, int64_t ldy);

PanelFn panels_for(int type);  // nullptr where the path has no panel kernel for the type
const char* path_name();     // "scalar", "avx2" or "avx512"

template <class Kernel>
RowsFn rows_table(int type) {
  switch (type) {
    case Q4_0: return &Kernel::template rows<Q4_0>;
    case Q4_1: return &Kernel::template rows<Q4_1>;
    case Q5_0: return &Kernel::template rows<Q5_0>;
    case Q5_1: return &Kernel::template rows<Q5_1>;
    case Q8_0: return &Kernel::template rows<Q8_0>;
    case Q4_K: return &Kernel::template rows<Q4_K>;
    case Q5_K: return &Kernel::template rows<Q5_K>;
    case Q6_K: return &Kernel::template rows<Q6_K>;
    default: return nullptr;
  }
}

// The panel kernel's `rows` for every type with a panel layout (nullptr for the others).
template <class Kernel>
PanelFn panel_table(int type) {
  PanelFn kernel = nullptr;
  if (has_panels(type))
    with_panel_type(type, [&](auto t) { kernel = &Kernel::template rows<decltype(t)::value>; });
  return kernel;
}

}  // namespace vq
