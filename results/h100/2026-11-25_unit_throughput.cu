// MUFU.EX2 vs FFMA issue throughput on one SM: clock64 cycles per warp-instruction
#include <cstdio>
#include <cuda_runtime.h>
template <int OP>
__global__ void k(float* out, long long* cyc, int iters) {
  float a[8];
  for (int i = 0; i < 8; ++i) a[i] = -0.001f * (threadIdx.x + i);
  __syncthreads();
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (OP == 0) asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(a[i]));
      else if (OP == 1) asm volatile("fma.rn.f32 %0, %0, 0f3F7FFFFF, 0fBA83126F;" : "+f"(a[i]));
      else if (OP == 2) { asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(a[i]));
             asm volatile("fma.rn.f32 %0, %0, 0f3F7FFFFF, 0fBF000000;" : "+f"(a[i])); }
      else if (OP == 3) {  // cvt.rn.bf16x2.f32 (F2FP), result fed back as a float
        unsigned r; asm volatile("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(r) : "f"(a[i]));
        asm volatile("mov.b32 %0, %1;" : "=f"(a[i]) : "r"(r)); }
      else if (OP == 4) {  // F2FP + ex2 on independent values: do they share a unit?
        unsigned r; asm volatile("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(r) : "f"(a[i]));
        asm volatile("mov.b32 %0, %1;" : "=f"(a[i]) : "r"(r));
        asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(a[(i + 4) % 8])); }
      else {  // two integer adds + prmt (bf16 pack by bits)
        unsigned r; asm volatile("{.reg .b32 x, y; mov.b32 x, %1; add.u32 x, x, 0x8000; add.u32 y, x, 0x8000; prmt.b32 %0, x, y, 0x7632;}" : "=r"(r) : "f"(a[i]));
        asm volatile("mov.b32 %0, %1;" : "=f"(a[i]) : "r"(r)); }
    }
  }
  long long t1 = clock64();
  float s = 0; for (int i = 0; i < 8; ++i) s += a[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x % 32 == 0) cyc[threadIdx.x / 32] = t1 - t0;
}
int main() {
  float* out; long long* cyc; cudaMalloc(&out, 1 << 20); cudaMalloc(&cyc, 1024);
  const char* names[6] = {"ex2", "ffma", "ex2+ffma", "f2fp", "f2fp+ex2", "2iadd+prmt"};
  int iters = 4096;
  for (int op = 0; op < 6; ++op)
    for (int warps = 1; warps <= 16; warps *= 2) {
      void (*f)(float*, long long*, int) = op == 0 ? k<0> : op == 1 ? k<1> : op == 2 ? k<2> : op == 3 ? k<3> : op == 4 ? k<4> : k<5>;
      f<<<1, 32 * warps>>>(out, cyc, iters); cudaDeviceSynchronize();
      f<<<1, 32 * warps>>>(out, cyc, iters); cudaDeviceSynchronize();
      long long h[16]; cudaMemcpy(h, cyc, 8 * warps, cudaMemcpyDeviceToHost);
      long long mx = 0; for (int w = 0; w < warps; ++w) mx = h[w] > mx ? h[w] : mx;
      double per_instr = (double)mx / (iters * 8.0);           // cycles per instr of one warp
      int per_smsp = (warps + 3) / 4;                             // warps sharing an SMSP
      printf("%-9s warps %2d: %.2f cycles per warp-instr per warp, %.2f per SMSP-instr\n",
             names[op], warps, per_instr, per_instr / per_smsp);
    }
  return 0;
}
