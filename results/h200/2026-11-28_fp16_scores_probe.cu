// Can the SFU (MUFU.EX2) and the tensor pipe (WGMMA) run at full rate at the same time on
// one SM? A roofline for attention's two halves on Hopper. Plain CUDA C++ with inline PTX
// (no torch, CuTe DSL or FA4): one CTA of 3 warpgroups per SM on every SM, operands in SMEM
// (128-byte swizzle, K-major, pseudo-random finite data), accumulators in registers.
//   tc     warpgroups 1-2 issue WGMMA m64n192 (K = 128 per commit group: Q K^T of a 64 x 192 tile at d = 128)
//   sfu    warpgroup 0 issues MUFU.EX2 (8 chains per thread: x = 2^(-x), an FFMA and a MUFU)
//   both   tc and sfu at once, in different warpgroups
//   mix    warpgroups 1-2 each: issue a WGMMA group, run half of sfu's exp2s, wait (the
//          intra-warpgroup overlap of FA3 / k6)
//   sfu2   warpgroups 1-2 issue the exp2s of sfu (two warps per SM sub-partition)
// Clock: clock64 against %globaltimer in thread 0 of every CTA (the SM clock under load).
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); exit(1); } } while (0)

__device__ __forceinline__ void mma_fp8ss(float* d, const unsigned* a, unsigned long long da, unsigned long long db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\nwgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1;\n}\n"
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
    : "l"(da), "l"(db), "r"(1));
}
__device__ __forceinline__ void mma_bf16ss(float* d, const unsigned* a, unsigned long long da, unsigned long long db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\nwgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1, 0, 0;\n}\n"
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
    : "l"(da), "l"(db), "r"(1));
}
__device__ __forceinline__ void mma_fp8rs(float* d, const unsigned* a, unsigned long long da, unsigned long long db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\nwgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, p, 1, 1;\n}\n"
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
__device__ __forceinline__ void mma_bf16rs(float* d, const unsigned* a, unsigned long long da, unsigned long long db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\nwgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, p, 1, 1, 0;\n}\n"
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

__device__ __forceinline__ void mma_fp8ss_f16(unsigned* d, unsigned long long da, unsigned long long db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\nwgmma.mma_async.sync.aligned.m64n192k32.f16.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, %48, %49, p, 1, 1;\n}\n"
    : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47])
    : "l"(da), "l"(db), "r"(1));
}

__device__ __forceinline__ unsigned long long gtimer() {
  unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t;
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
__device__ __forceinline__ unsigned long long desc(unsigned addr) {
  // K-major, 128-byte swizzle: start >> 4, LBO 1 (unused), SBO 1024 bytes (8 rows of 128 B)
  return (unsigned long long)((addr >> 4) & 0x3FFF) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

template <int EXK> __device__ __forceinline__ void sfu_round(float* x) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (EXK == 0)
      asm volatile("{\n.reg .f32 t;\nfma.rn.f32 t, %0, 0fBF800000, 0f00000000;\nex2.approx.ftz.f32 %0, t;\n}\n" : "+f"(x[i]));
    else if (EXK == 1)   // f16x2: two values per register
      asm volatile("{\n.reg .b32 t, c, z;\nmov.b32 c, 0xBC00BC00;\nmov.b32 z, 0;\nfma.rn.f16x2 t, %0, c, z;\nex2.approx.f16x2 %0, t;\n}\n" : "+r"(*(unsigned*)&x[i]));
    else
      asm volatile("{\n.reg .b32 t, c, z;\nmov.b32 c, 0xBF80BF80;\nmov.b32 z, 0x80008000;\nfma.rn.bf16x2 t, %0, c, z;\nex2.approx.ftz.bf16x2 %0, t;\n}\n" : "+r"(*(unsigned*)&x[i]));
  }
}

enum { TC = 0, SFU = 1, BOTH = 2, MIX = 3, SFU2 = 4 };

template <int KIND>   // 0 fp8 SS, 1 bf16 SS, 2 fp8 RS, 3 bf16 RS
__device__ __forceinline__ void group(float* d, const unsigned* a, unsigned long long da, unsigned long long db) {
  // one commit group: K = 128 (4 k32 e4m3 or 8 k16 bf16 WGMMAs, +32 bytes each along K)
  constexpr int KB = (KIND == 1 || KIND == 3) ? 8 : 4;
#pragma unroll
  for (int k = 0; k < KB; ++k) {
    // the k-th 32-byte slice of each 128-byte row: bf16 needs K = 128 * 2 bytes, so its
    // second half wraps around (same bytes again: only the rate matters here)
    unsigned long long off = (unsigned long long)((k % 4) * 2);
    if (KIND == 4 || KIND == 7) mma_fp8ss_f16((unsigned*)d, da + off, db + off);
    else if (KIND == 0 || KIND == 5 || KIND == 6) mma_fp8ss(d, a, da + off, db + off);
    else if (KIND == 1) mma_bf16ss(d, a, da + off, db + off);
    else if (KIND == 2) mma_fp8rs(d, a, da + off, db + off);
    else mma_bf16rs(d, a, da + off, db + off);
  }
  wg_commit();
}

template <int KIND, int MODE>
__global__ void __launch_bounds__(384, 1) bench(int iters, int sfu_rounds, float* sink,
                                                 long long* clk, unsigned long long* ns) {
  extern __shared__ unsigned char smem_raw[];
  unsigned base = (unsigned)__cvta_generic_to_shared(smem_raw);
  unsigned pad = ((base + 1023) & ~1023u) - base;
  unsigned char* smem = smem_raw + pad;
  // A: 64 x 128 B, B: 192 x 128 B; pseudo-random finite e4m3 / bf16 bytes
  for (int i = threadIdx.x; i < (64 + 192) * 128 / 4; i += blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u;
    unsigned w = (KIND != 1 && KIND != 3) ? (h & 0xB6B6B6B6u)          // |e4m3| < 1, no NaN
                                          : ((h & 0x807F807Fu) | 0x3C003C00u);   // bf16 ~ 2^-7
    reinterpret_cast<unsigned*>(smem)[i] = w;
  }
  __syncthreads();
  unsigned a_addr = base + pad, b_addr = a_addr + 64 * 128;
  unsigned long long da = desc(a_addr), db = desc(b_addr);
  int wg = threadIdx.x / 128;
  float d[96];
#pragma unroll
  for (int i = 0; i < 96; ++i) d[i] = 0.f;
  unsigned a[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = ((KIND == 2) ? 0x36363636u : 0x3C003C00u) ^ (threadIdx.x * 0x01010101u & 0x80808080u);
  float x[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = 0.5f + 0.01f * i;

  long long c0 = clock64(); unsigned long long t0 = gtimer();
  bool tc_wg = (MODE == TC || MODE == BOTH || MODE == MIX) && wg >= 1;
  bool sfu_wg = ((MODE == SFU || MODE == BOTH) && wg == 0) || (MODE == SFU2 && wg >= 1);
  if (tc_wg) {
    wg_fence();
    if (MODE == MIX) {
      #pragma unroll 1
      for (int it = 0; it < iters; ++it) {
        group<KIND>(d, a, da, db);
        for (int r = 0; r < sfu_rounds / 2; ++r) sfu_round<(KIND == 4 || KIND == 5) ? 1 : KIND == 6 ? 2 : 0>(x);
        wg_wait<0>();
      }
    } else {
      #pragma unroll 1
      for (int it = 0; it < iters; ++it) {
        group<KIND>(d, a, da, db);
        wg_wait<1>();
      }
      wg_wait<0>();
    }
  } else if (sfu_wg) {
    int rounds = iters * (MODE == SFU2 ? sfu_rounds / 2 : sfu_rounds);
    for (int r = 0; r < rounds; ++r) sfu_round<(KIND == 4 || KIND == 5) ? 1 : KIND == 6 ? 2 : 0>(x);
  }
  __syncthreads();
  long long c1 = clock64(); unsigned long long t1 = gtimer();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 96; ++i) s += d[i];
#pragma unroll
  for (int i = 0; i < 8; ++i) s += x[i];
  if (s == 12345.f) sink[threadIdx.x] = s;   // keep the work
  if (threadIdx.x == 0) { clk[blockIdx.x] = c1 - c0; ns[blockIdx.x] = t1 - t0; }
}

template <int KIND, int MODE>
void run(const char* kind, const char* mode, int sms, int iters, int sfu_rounds, double* ms_out) {
  auto kern = bench<KIND, MODE>;
  int smem = 64 * 1024;   // 41 KiB used; more keeps one CTA per SM
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  float* sink; long long* clk; unsigned long long* ns;
  CK(cudaMalloc(&sink, 4096)); CK(cudaMalloc(&clk, sms * 8)); CK(cudaMalloc(&ns, sms * 8));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  for (int w = 0; w < 3; ++w) kern<<<sms, 384, smem>>>(iters, sfu_rounds, sink, clk, ns);
  CK(cudaDeviceSynchronize());
  std::vector<float> t;
  double mhz_sum = 0;
  for (int rep = 0; rep < 9; ++rep) {
    CK(cudaEventRecord(e0));
    kern<<<sms, 384, smem>>>(iters, sfu_rounds, sink, clk, ns);
    CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
    float m; CK(cudaEventElapsedTime(&m, e0, e1)); t.push_back(m);
    std::vector<long long> hc(sms); std::vector<unsigned long long> hn(sms);
    CK(cudaMemcpy(hc.data(), clk, sms * 8, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hn.data(), ns, sms * 8, cudaMemcpyDeviceToHost));
    double mhz = 0; for (int i = 0; i < sms; ++i) mhz += (double)hc[i] / hn[i] * 1e3; mhz_sum += mhz / sms;
  }
  std::sort(t.begin(), t.end());
  double ms = t[t.size() / 2], mhz = mhz_sum / 9;
  bool has_tc = MODE == TC || MODE == BOTH || MODE == MIX;
  bool has_sfu = MODE != TC;
  int k = (KIND == 1 || KIND == 3) ? 16 : 32, kb = (KIND == 1 || KIND == 3) ? 8 : 4;
  double flop = has_tc ? (double)sms * 2 * iters * kb * 2.0 * 64 * 192 * k : 0;
  double ex2 = has_sfu ? (double)sms * 128 * iters * sfu_rounds * 8 * ((KIND >= 4 && KIND <= 6) ? 2 : 1) : 0;
  double cycles = ms * 1e-3 * mhz * 1e6;
  printf("%-7s %-5s iters %5d sfu_rounds %3d: %8.3f ms  %7.1f MHz  tensor %7.1f TFLOP/s (%6.0f FLOP/clk/SM)  ex2 %5.2f /clk/SM\n",
         kind, mode, iters, sfu_rounds, ms, mhz, flop / ms * 1e-9, flop / sms / cycles, ex2 / sms / cycles);
  *ms_out = ms;
  CK(cudaFree(sink)); CK(cudaFree(clk)); CK(cudaFree(ns));
}

template <int KIND>
void suite(const char* kind, int sms, int iters, int sfu_rounds) {
  double tc, sfu, both, mix, sfu2;
  run<KIND, TC>(kind, "tc", sms, iters, sfu_rounds, &tc);
  run<KIND, SFU>(kind, "sfu", sms, iters, sfu_rounds, &sfu);
  run<KIND, SFU2>(kind, "sfu2", sms, iters, sfu_rounds, &sfu2);
  run<KIND, BOTH>(kind, "both", sms, iters, sfu_rounds, &both);
  run<KIND, MIX>(kind, "mix", sms, iters, sfu_rounds, &mix);
  double mx = std::max(tc, sfu), sum = tc + sfu;
  printf("%-7s sfu_rounds %3d: both = %.2fx max(tc, sfu), %.2fx (tc + sfu); mix = %.2fx max, %.2fx sum\n",
         kind, sfu_rounds, both / mx, both / sum, mix / mx, mix / sum);
}

int main(int argc, char** argv) {
  int dev = 0; cudaDeviceProp p; CK(cudaGetDeviceProperties(&p, dev));
  int sms = argc > 1 ? atoi(argv[1]) : p.multiProcessorCount;
  int iters = argc > 2 ? atoi(argv[2]) : 4000;
  printf("# %s, %d SMs used of %d\n", p.name, sms, p.multiProcessorCount);
  // equal SFU and tensor time at the nominal rates (16 exp2 / clk, 8192 FP8 / 4096 bf16 FLOP
  // / clk per SM): FP8 at d = 128 (16 rounds), bf16 at d = 64 (32) and at d = 128 (16)
  // f32 accumulator and f32 exp2 (today's k7), then the same number of exp2 *values* as f16x2
  // (8 rounds of 8 registers x 2 values) with an f16 / f32 accumulator, and bf16x2
  suite<0>("f32acc_f32ex", sms, iters, 16);
  suite<4>("f16acc_f16ex", sms, iters, 8);
  suite<7>("f16acc_f32ex", sms, iters, 16);
  suite<5>("f32acc_f16ex", sms, iters, 8);
  suite<6>("f32acc_bf16ex", sms, iters, 8);
  return 0;
}
