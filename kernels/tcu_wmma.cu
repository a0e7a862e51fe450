// Reduction and scan as 16x16 matrix multiplications on tensor cores (WMMA, sm_70+).
// One warp per tile (segment 16) or per segment (multiple of 256). The constant matrices
// P (ones in row 0), P^T, U (upper-triangular ones incl. diagonal), L (strictly lower) and
// O (all ones) live in shared memory, built once per block. Acc is the accumulator type:
// __half (fp16-in/fp16-acc) or float (fp16-in/fp32-acc). See trims/kernels/tcu.py.
#include <cuda_fp16.h>
#include <mma.h>

using namespace nvcuda;

#define WARPS 4
#define TILE 256

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> FragA;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> FragB;

__device__ __forceinline__ float as_float(float v) { return v; }
__device__ __forceinline__ float as_float(__half v) { return __half2float(v); }
template <typename Acc> __device__ __forceinline__ Acc from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half(v);
}

enum { MAT_P = 0, MAT_PT = 1, MAT_U = 2, MAT_L = 3, MAT_O = 4, MAT_COUNT = 5 };

// Every thread of the block helps; the caller syncs the block afterwards.
__device__ void build_constants(__half (*m)[TILE]) {
  for (int i = threadIdx.x; i < MAT_COUNT * TILE; i += blockDim.x) {
    int which = i / TILE, r = (i % TILE) / 16, c = i % 16;
    float v = 0.0f;
    if (which == MAT_P) v = (r == 0);
    if (which == MAT_PT) v = (c == 0);
    if (which == MAT_U) v = (r <= c);
    if (which == MAT_L) v = (r > c);
    if (which == MAT_O) v = 1.0f;
    m[which][i % TILE] = __float2half(v);
  }
}

// V = A P^T: column 0 of V holds the 16 row sums of the tile.
template <typename Acc>
__device__ void reduce16(const __half* x, Acc* out, long long ntiles) {
  __shared__ __align__(32) __half m[MAT_COUNT][TILE];
  __shared__ __align__(32) Acc stage[WARPS][TILE];
  build_constants(m);
  __syncthreads();
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  long long tile = (long long)blockIdx.x * WARPS + warp;
  if (tile >= ntiles) return;
  FragA a;
  FragB pt;
  wmma::fragment<wmma::accumulator, 16, 16, 16, Acc> v;
  wmma::load_matrix_sync(a, x + tile * TILE, 16);
  wmma::load_matrix_sync(pt, m[MAT_PT], 16);
  wmma::fill_fragment(v, from_float<Acc>(0.0f));
  wmma::mma_sync(v, a, pt, v);
  wmma::store_matrix_sync(stage[warp], v, 16, wmma::mem_row_major);
  __syncwarp();
  if (lane < 16) out[tile * 16 + lane] = stage[warp][lane * 16];
}

// V += P A_j over the k tiles of a segment, then (V as fp16) P^T: V[0,0] is the sum.
template <typename Acc>
__device__ void reduce256n(const __half* x, Acc* out, long long nseg, int k) {
  __shared__ __align__(32) __half m[MAT_COUNT][TILE];
  __shared__ __align__(32) Acc stage[WARPS][TILE];
  __shared__ __align__(32) __half hstage[WARPS][TILE];
  build_constants(m);
  __syncthreads();
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  long long seg = (long long)blockIdx.x * WARPS + warp;
  if (seg >= nseg) return;
  FragA p, vh;
  FragB tile, pt;
  wmma::fragment<wmma::accumulator, 16, 16, 16, Acc> v, w;
  wmma::load_matrix_sync(p, m[MAT_P], 16);
  wmma::load_matrix_sync(pt, m[MAT_PT], 16);
  wmma::fill_fragment(v, from_float<Acc>(0.0f));
  const __half* base = x + seg * (long long)k * TILE;
  for (int j = 0; j < k; ++j) {
    wmma::load_matrix_sync(tile, base + (long long)j * TILE, 16);
    wmma::mma_sync(v, p, tile, v);
  }
  wmma::store_matrix_sync(stage[warp], v, 16, wmma::mem_row_major);
  __syncwarp();
  for (int i = lane; i < TILE; i += 32) hstage[warp][i] = __float2half(as_float(stage[warp][i]));
  __syncwarp();
  wmma::load_matrix_sync(vh, hstage[warp], 16);
  wmma::fill_fragment(w, from_float<Acc>(0.0f));
  wmma::mma_sync(w, vh, pt, w);
  wmma::store_matrix_sync(stage[warp], w, 16, wmma::mem_row_major);
  __syncwarp();
  if (lane == 0) out[seg] = stage[warp][0];
}

// S = A U: every row of the tile is scanned.
template <typename Acc>
__device__ void scan16(const __half* x, Acc* out, long long ntiles) {
  __shared__ __align__(32) __half m[MAT_COUNT][TILE];
  build_constants(m);
  __syncthreads();
  int warp = threadIdx.x / 32;
  long long tile = (long long)blockIdx.x * WARPS + warp;
  if (tile >= ntiles) return;
  FragA a;
  FragB u;
  wmma::fragment<wmma::accumulator, 16, 16, 16, Acc> s;
  wmma::load_matrix_sync(a, x + tile * TILE, 16);
  wmma::load_matrix_sync(u, m[MAT_U], 16);
  wmma::fill_fragment(s, from_float<Acc>(0.0f));
  wmma::mma_sync(s, a, u, s);
  wmma::store_matrix_sync(out + tile * TILE, s, 16, wmma::mem_row_major);
}

// Per tile S_j = A_j U + (L A_j) O + carry, carry = last element of S_{j-1} (broadcast).
template <typename Acc>
__device__ void scan256n(const __half* x, Acc* out, long long nseg, int k) {
  __shared__ __align__(32) __half m[MAT_COUNT][TILE];
  __shared__ __align__(32) Acc stage[WARPS][TILE];
  __shared__ __align__(32) __half hstage[WARPS][TILE];
  build_constants(m);
  __syncthreads();
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  long long seg = (long long)blockIdx.x * WARPS + warp;
  if (seg >= nseg) return;
  FragA a, l, th;
  FragB u, o, ab;
  wmma::fragment<wmma::accumulator, 16, 16, 16, Acc> s, t;
  wmma::load_matrix_sync(l, m[MAT_L], 16);
  wmma::load_matrix_sync(u, m[MAT_U], 16);
  wmma::load_matrix_sync(o, m[MAT_O], 16);
  float carry = 0.0f;
  for (int j = 0; j < k; ++j) {
    const __half* tile = x + (seg * (long long)k + j) * TILE;
    wmma::load_matrix_sync(a, tile, 16);
    wmma::load_matrix_sync(ab, tile, 16);
    wmma::fill_fragment(s, from_float<Acc>(carry));
    wmma::mma_sync(s, a, u, s);
    wmma::fill_fragment(t, from_float<Acc>(0.0f));
    wmma::mma_sync(t, l, ab, t);
    wmma::store_matrix_sync(stage[warp], t, 16, wmma::mem_row_major);
    __syncwarp();
    for (int i = lane; i < TILE; i += 32) hstage[warp][i] = __float2half(as_float(stage[warp][i]));
    __syncwarp();
    wmma::load_matrix_sync(th, hstage[warp], 16);
    wmma::mma_sync(s, th, o, s);
    wmma::store_matrix_sync(stage[warp], s, 16, wmma::mem_row_major);
    __syncwarp();
    Acc* dst = out + (seg * (long long)k + j) * TILE;
    for (int i = lane; i < TILE; i += 32) dst[i] = stage[warp][i];
    carry = as_float(stage[warp][TILE - 1]);
    __syncwarp();
  }
}

#define EXPORT(NAME, ACC, ACCNAME, ...)                                               \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                            \
      NAME##_##ACCNAME(const __half* x, ACC* out, long long n, ##__VA_ARGS__)

EXPORT(reduce16, __half, fp16) { reduce16<__half>(x, out, n); }
EXPORT(reduce16, float, fp32) { reduce16<float>(x, out, n); }
EXPORT(reduce256n, __half, fp16, int k) { reduce256n<__half>(x, out, n, k); }
EXPORT(reduce256n, float, fp32, int k) { reduce256n<float>(x, out, n, k); }
EXPORT(scan16, __half, fp16) { scan16<__half>(x, out, n); }
EXPORT(scan16, float, fp32) { scan16<float>(x, out, n); }
EXPORT(scan256n, __half, fp16, int k) { scan256n<__half>(x, out, n, k); }
EXPORT(scan256n, float, fp32, int k) { scan256n<float>(x, out, n, k); }
