// The AVX512-VNNI kernel path (built with AVX-512 F/BW/VL/VNNI beside AVX2, FMA and F16C;
// loaded only where the CPU has them all, which verispec/quant/quant_kernels.py checks).

#include "avx512.h"
#include "rows.h"

vq::RowsFn vq::rows_for(int type) { return rows_table<Avx512Kernel>(type); }
const char* vq::path_name() { return "avx512"; }
vq::PanelFn vq::panels_for(int type) { return panel_table<PanelKernel>(type); }
