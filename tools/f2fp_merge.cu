// How ptxas packs four e4m3 values into one 32-bit register (k7's P operand), on sm_90a.
// No GPU needed:
//   nvcc -arch=sm_90a -cubin -o /tmp/f2fp.cubin tools/f2fp_merge.cu
//   cuobjdump -sass /tmp/f2fp.cubin | grep -E "Function|MUFU|F2FP|PRMT"
// Seen with CUDA 13.0 (2026-11-28, docs/lab/k7.md "P's bytes, and exp2 in f16"):
// * from_fmul: F2FP...PACK_AB_MERGE_C twice, the second merging into the first (no PRMT);
// * from_exp2: the same PTX on MUFU.EX2 results: each pair converted on its own (MERGE_C
//   with RZ), then a PRMT per register; k7's loop has these 24 PRMTs per kv tile;
// * exp2_f16x2: ex2.approx.f16x2 is two MUFU.EX2.F16 and a PRMT, no cheaper than f32.

__device__ unsigned pack4(float a, float b, float c, float d) {
  unsigned r;
  asm("{\n.reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}" : "=r"(r) : "f"(a), "f"(b), "f"(c), "f"(d));
  return r;
}

__global__ void from_fmul(const float* in, unsigned* out) {
  int i = threadIdx.x;
  float v[8];
  for (int j = 0; j < 8; ++j) v[j] = in[i + 32 * j] * 3.0f;
  out[i] = pack4(v[0], v[1], v[2], v[3]);
  out[i + 32] = pack4(v[4], v[5], v[6], v[7]);
}

__global__ void from_exp2(const float* in, unsigned* out) {
  int i = threadIdx.x;
  float v[8];
  for (int j = 0; j < 8; ++j) v[j] = exp2f(in[i + 32 * j]);
  out[i] = pack4(v[0], v[1], v[2], v[3]);
  out[i + 32] = pack4(v[4], v[5], v[6], v[7]);
}

__global__ void exp2_f16x2(const unsigned* in, unsigned* out) {
  unsigned r;
  asm("ex2.approx.f16x2 %0, %1;" : "=r"(r) : "r"(in[threadIdx.x]));
  out[threadIdx.x] = r;
}
