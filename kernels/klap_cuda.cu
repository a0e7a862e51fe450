// KLAP launch aggregation on the GPU for the CSR-shaped apps (BFS, SSSP, SpMV, tree).
// A parent is a vertex/row/node; its child work is one thread per CSR item (edge/nonzero/
// child), in blocks of `cb` threads. See trims/kernels/klap.py for the index math.
//
//   child_<app>   the (aggregated) child kernel: its prologue finds the parent slot by binary
//                 search of the inclusive scan of child grid sizes and recovers its own block
//                 index; launched by the host (per parent or per group) or, with KLAP_CDP, by
//                 the parent kernels below.
//   flat_<app>    no child launches: each parent thread loops over its items.
//   parent_<app>_{perparent,warp,block}   (KLAP_CDP only: nvcc/NVRTC -rdc=true + cudadevrt)
//                 device-side launches: one per parent thread, or one aggregated launch per
//                 warp / block after a warp-shuffle / shared-memory scan of the grid sizes.
typedef long long i64;
typedef unsigned long long u64;

__device__ __forceinline__ int klap_find_parent(const i64* scan, int n, i64 block) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (scan[mid] > block) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

__device__ __forceinline__ i64 klap_grid(const i64* indptr, i64 v, int cb) {
  i64 count = indptr[v + 1] - indptr[v];
  return (count + cb - 1) / cb;
}

#define KLAP_UNPAREN(...) __VA_ARGS__

#define KLAP_CHILD(NAME, PARAMS, ...)                                                     \
  extern "C" __global__ void child_##NAME(const i64* scan, int nparents,                  \
                                          const int* parents, int cb, KLAP_UNPAREN PARAMS) { \
    int slot = klap_find_parent(scan, nparents, (i64)blockIdx.x);                         \
    i64 first = slot ? scan[slot - 1] : 0;                                                \
    i64 block = (i64)blockIdx.x - first;                                                  \
    i64 v = parents[slot];                                                                \
    i64 item = block * cb + threadIdx.x;                                                  \
    if (item >= indptr[v + 1] - indptr[v]) return;                                        \
    i64 e = indptr[v] + item;                                                             \
    __VA_ARGS__;                                                                          \
  }                                                                                       \
  extern "C" __global__ void flat_##NAME(int nparents, const int* parents,                \
                                         KLAP_UNPAREN PARAMS) {                         \
    int slot = blockIdx.x * blockDim.x + threadIdx.x;                                     \
    if (slot >= nparents) return;                                                         \
    i64 v = parents[slot];                                                                \
    for (i64 e = indptr[v]; e < indptr[v + 1]; ++e) {                                     \
      __VA_ARGS__;                                                                        \
    }                                                                                     \
  }

#ifdef KLAP_CDP
// scratch[slot] holds the scan value of each parent slot (global memory, one per parent).
#define KLAP_PARENTS(NAME, PARAMS, ARGS)                                                  \
  extern "C" __global__ void parent_##NAME##_perparent(int nparents, const int* parents,  \
                                                       i64* scratch, int cb, KLAP_UNPAREN PARAMS) { \
    int slot = blockIdx.x * blockDim.x + threadIdx.x;                                     \
    if (slot >= nparents) return;                                                         \
    i64 grid = klap_grid(indptr, parents[slot], cb);                                      \
    scratch[slot] = grid;                                                                 \
    if (grid > 0)                                                                         \
      child_##NAME<<<(unsigned)grid, cb>>>(scratch + slot, 1, parents + slot, cb, KLAP_UNPAREN ARGS);  \
  }                                                                                       \
  extern "C" __global__ void parent_##NAME##_warp(int nparents, const int* parents,       \
                                                  i64* scratch, int cb, KLAP_UNPAREN PARAMS) { \
    int slot = blockIdx.x * blockDim.x + threadIdx.x;                                     \
    int lane = threadIdx.x % 32;                                                          \
    int warp_first = slot - lane;                                                         \
    if (warp_first >= nparents) return;                                                   \
    int in_warp = min(32, nparents - warp_first);                                         \
    unsigned mask = in_warp == 32 ? 0xffffffffu : ((1u << in_warp) - 1u);                 \
    if (lane >= in_warp) return;                                                          \
    i64 scan = klap_grid(indptr, parents[slot], cb);                                      \
    for (int d = 1; d < 32; d <<= 1) {                                                    \
      i64 up = __shfl_up_sync(mask, scan, d);                                             \
      if (lane >= d) scan += up;                                                          \
    }                                                                                     \
    scratch[slot] = scan;                                                                 \
    __threadfence();                                                                      \
    __syncwarp(mask);                                                                     \
    if (lane == in_warp - 1 && scan > 0)                                                  \
      child_##NAME<<<(unsigned)scan, cb>>>(scratch + warp_first, in_warp,                 \
                                           parents + warp_first, cb, KLAP_UNPAREN ARGS);               \
  }                                                                                       \
  extern "C" __global__ void parent_##NAME##_block(int nparents, const int* parents,      \
                                                   i64* scratch, int cb, KLAP_UNPAREN PARAMS) { \
    extern __shared__ i64 sums[];                                                         \
    int slot = blockIdx.x * blockDim.x + threadIdx.x;                                     \
    int block_first = blockIdx.x * blockDim.x;                                            \
    int in_block = min((int)blockDim.x, nparents - block_first);                          \
    sums[threadIdx.x] = slot < nparents ? klap_grid(indptr, parents[slot], cb) : 0;       \
    __syncthreads();                                                                      \
    for (int d = 1; d < (int)blockDim.x; d <<= 1) {                                       \
      i64 add = threadIdx.x >= d ? sums[threadIdx.x - d] : 0;                             \
      __syncthreads();                                                                    \
      sums[threadIdx.x] += add;                                                           \
      __syncthreads();                                                                    \
    }                                                                                     \
    if (slot < nparents) scratch[slot] = sums[threadIdx.x];                               \
    __threadfence();                                                                      \
    __syncthreads();                                                                      \
    if ((int)threadIdx.x == in_block - 1 && sums[threadIdx.x] > 0)                        \
      child_##NAME<<<(unsigned)sums[threadIdx.x], cb>>>(scratch + block_first, in_block,  \
                                                        parents + block_first, cb, KLAP_UNPAREN ARGS); \
  }
#else
#define KLAP_PARENTS(NAME, PARAMS, ARGS)
#endif

#define KLAP_APP(NAME, PARAMS, ARGS, ...) \
  KLAP_CHILD(NAME, PARAMS, __VA_ARGS__)   \
  KLAP_PARENTS(NAME, PARAMS, ARGS)

// BFS: mark unvisited neighbours with the next level (a benign race: all write one value).
KLAP_APP(bfs, (const i64* indptr, const int* indices, int* level, int depth),
         (indptr, indices, level, depth),
         { int u = indices[e]; if (level[u] < 0) level[u] = depth + 1; })

// SSSP (Bellman-Ford worklist): relax every edge of a frontier vertex with atomicMin.
KLAP_APP(sssp,
         (const i64* indptr, const int* indices, const i64* weights, const u64* before,
          u64* dist),
         (indptr, indices, weights, before, dist),
         { atomicMin(dist + indices[e], before[v] + (u64)weights[e]); })

// SpMV with one child thread per nonzero: atomicAdd into the row's result.
KLAP_APP(spmv,
         (const i64* indptr, const int* indices, const double* vals, const double* x,
          double* y),
         (indptr, indices, vals, x, y),
         { atomicAdd(y + v, vals[e] * x[indices[e]]); })

// Tree traversal: a child node's depth and root-path sum from its parent's.
KLAP_APP(tree,
         (const i64* indptr, const int* indices, const i64* weights, i64* depth, i64* path),
         (indptr, indices, weights, depth, path),
         { int c = indices[e]; depth[c] = depth[v] + 1; path[c] = path[v] + weights[e]; })
