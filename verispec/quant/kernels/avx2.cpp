// The AVX2 kernel path (built with -mavx2 -mfma -mf16c; loaded only where the CPU has all
// three, which verispec/quant/quant_kernels.py checks).

#include "avx2.h"
#include "rows.h"

vq::RowsFn vq::rows_for(int type) { return rows_table<Avx2Kernel>(type); }
const char* vq::path_name() { return "avx2"; }
vq::PanelFn vq::panels_for(int type) { return panel_table<Avx2PanelKernel>(type); }
