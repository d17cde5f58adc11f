// The portable kernel path: plain C++ built without any instruction-set flag, for CPUs
// without AVX2 (and to check the AVX2 path, which gives the same bits).

#include "rows.h"

vq::RowsFn vq::rows_for(int type) { return rows_table<PortableKernel>(type); }
const char* vq::path_name() { return "scalar"; }
vq::PanelFn vq::panels_for(int) { return nullptr; }
