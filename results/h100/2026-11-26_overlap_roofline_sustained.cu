// Sustained (power-limited) rates of the modes of 2026-11-26_overlap_roofline.cu (same folder):
// each mode launches back to back for ~4 s, nvidia-smi sampled from inside after 1.5 s.
// nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -o sustain 2026-11-26_overlap_roofline_sustained.cu
// Attention's exp2 share at d = 128 FP8 is 12 rounds here (1 exp2 per 512 FLOP).
#define main roofline_main
#include "2026-11-26_overlap_roofline.cu"
#undef main
#include <chrono>
#include <string>
static std::string smi() {
  FILE* f = popen("nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits", "r");
  char buf[256] = {0}; fgets(buf, sizeof buf, f); pclose(f);
  std::string s(buf); if (!s.empty() && s.back() == '\n') s.pop_back(); return s;
}
template <int KIND, int MODE>
void sustain(const char* name, int iters, int rounds, double flop_per_launch) {
  auto kern = bench<KIND, MODE>;
  int smem = 64 * 1024, sms = 132;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  float* sink; long long* clk; unsigned long long* ns;
  CK(cudaMalloc(&sink, 4096)); CK(cudaMalloc(&clk, sms * 8)); CK(cudaMalloc(&ns, sms * 8));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  auto t0 = std::chrono::steady_clock::now();
  std::string samples; int n = 0; float total = 0;
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 4.0) {
    CK(cudaEventRecord(e0));
    for (int i = 0; i < 40; ++i) kern<<<sms, 384, smem>>>(iters, rounds, sink, clk, ns);
    CK(cudaEventRecord(e1));
    double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::string s = smi();
    CK(cudaEventSynchronize(e1));
    float m; CK(cudaEventElapsedTime(&m, e0, e1));
    if (el > 1.5) { total += m; n += 40; samples += " [" + s + "]"; }
  }
  double ms = total / n;
  printf("%-14s rounds %2d: %.3f ms/launch, tensor %.1f TFLOP/s; MHz, W:%s\n", name, rounds, ms,
         flop_per_launch / ms * 1e-9, samples.substr(0, 200).c_str());
  CK(cudaFree(sink)); CK(cudaFree(clk)); CK(cudaFree(ns));
}
int main() {
  int iters = 4000;
  double flop = 132.0 * 2 * iters * 4 * 2.0 * 64 * 192 * 32;
  sustain<0, TC>("fp8_ss tc", iters, 12, flop);
  sustain<0, MIX>("fp8_ss mix", iters, 12, flop);
  sustain<0, BOTH>("fp8_ss both", iters, 12, flop);
  sustain<0, SFU>("fp8_ss sfu", iters, 12, 0);
  sustain<2, MIX>("fp8_rs mix", iters, 12, flop);
  double flop16 = 132.0 * 2 * (iters / 2) * 8 * 2.0 * 64 * 192 * 16;
  sustain<1, TC>("bf16_ss tc", iters / 2, 16, flop16);
  sustain<1, MIX>("bf16_ss mix16", iters / 2, 16, flop16);
  sustain<1, MIX>("bf16_ss mix32", iters / 2, 32, flop16);
  return 0;
}
