// jllama's CPU kernels as one translation unit: the source `jllama.kernels.library` compiles.
// The parts are files by job (kernels.h says which). Compiled as five sources they took about 19 s
// of CPU to build against 13 for this one: each source parses XLA FFI's headers again and compiles
// the code it instantiates from them.

#include "matvec.cc"
#include "ggml_products.cc"
#include "attention.cc"
#include "attention_decode.cc"
#include "sampling.cc"
#include "batch.cc"
#include "threads.cc"
#include "repack.cc"
