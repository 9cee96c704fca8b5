// Exit with the failing call, file and line: the standalone GPU probes (stream_floor.cu,
// wgmma_equiv.cu, ddtree_phases.cu) have no error handling beyond this. Copied beside them into
// .gpu/ by bundle.mjs.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t e = (x);                                                                \
    if (e != cudaSuccess) {                                                             \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)
