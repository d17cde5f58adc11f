// The AVX512-VNNI kernel path (built with AVX-512 F/BW/VL/VNNI beside AVX2, FMA and F16C;
// loaded only where the CPU has them all, which verispec/quant/kernels.py checks).

#include "avx512.h"
#include "rows.h"

vq::RowsFn vq::rows_for(int type) { return rows_table<Avx512Kernel>(type); }
const char* vq::path_name() { return "avx512"; }
vq::PanelFn vq::panels_for(int type) {
  switch (type) {
    case Q4_K: return &PanelKernel::rows<Q4_K>;
    case Q6_K: return &PanelKernel::rows<Q6_K>;
    case Q5_0: return &PanelKernel::rows<Q5_0>;
    case Q8_0: return &PanelKernel::rows<Q8_0>;
    default: return nullptr;
  }
}
