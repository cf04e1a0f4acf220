// What do K/V loads cost at the power limit? The sustained GEMM + exp2 stream of
// 2026-11-26_overlap_roofline_sustained.cu (mode "mix": each of 2 consumer warpgroups issues a
// 64 x 192 x 128 FP8 WGMMA group, runs half of the exp2s, waits) now fed by bulk copies from
// L2, at k7's bytes per FLOP at d = 128: each iteration's B operand (192 x 128 B = 24 KiB, a K
// tile) is copied into a 6-slot SMEM ring by one producer thread (cp.async.bulk + mbarrier
// expect-tx, the consumers release a slot after their WGMMA has read it), as k7's producer
// warp does for K and V^T. Sources: an 8 MiB buffer (stays in L2); every CTA reads the same
// 24 KiB at the same step (`spread` 1: k7's m-blocks of one head; pairs of CTAs apart: spread
// up to 66).
//   mix          no copies (the B operand stays put): the baseline
//   mix+tma      each CTA copies its 24 KiB from L2 (k7 today: 3.5 TB/s L2 -> SMEM at 16k)
//   mix+mc2      clusters of 2: each CTA copies half (12 KiB) and multicasts it to both
//                (L2 reads halved, SMEM writes the same): what a 2-CTA cluster would save
//   tma / mc2    the copies alone (consumers wait and release, no math), as fast as they go
//   mix, bg copies   "mix" plus copies that nobody waits for (the producer alone, at most SLOTS in flight),
//                as fast as they go or one every 930 / 1860 ns per CTA (3.5 / 1.7 TB/s in all)
// Each mode is launched back to back for ~4 s; ms/launch from CUDA events after the first 1.5 s,
// SM clock and board power from nvidia-smi between batches of 20 launches (mean of the samples).
// nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -o tma_power 2026-11-26_tma_power.cu
#define main roofline_main
#include "2026-11-26_overlap_roofline.cu"
#undef main
#include <chrono>
#include <string>

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile("{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}\n"
               :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_cta(unsigned bar, unsigned rank) {
  // arrive on the barrier at the same offset in CTA `rank` of the cluster (as CUTLASS's
  // ClusterBarrier::arrive(cta_id): default .release.cta semantics)
  asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
               "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n"
               :: "r"(bar), "r"(rank) : "memory");
}
__device__ __forceinline__ void bulk_load(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_load_mc(unsigned dst, const void* src, unsigned bytes, unsigned bar,
                                             unsigned short mask) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
               " [%0], [%1], %2, [%3], %4;"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar), "h"(mask) : "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

constexpr int SLOTS = 6, SLOT_BYTES = 192 * 128, SRC_BYTES = 8 << 20;

// CL: cluster size (1 or 2); MATH: WGMMA + exp2s in the consumers; COPY: the ring is fed
template <int CL, bool MATH, bool COPY, bool READ = true, int BG = 0>
__global__ void __launch_bounds__(384, 1) fed(int iters, int sfu_rounds, const unsigned char* src, float* sink, int spread, unsigned long long* copies) {
  extern __shared__ unsigned char smem_raw[];
  unsigned base = (unsigned)__cvta_generic_to_shared(smem_raw);
  unsigned pad = ((base + 1023) & ~1023u) - base;
  unsigned char* smem = smem_raw + pad;
  unsigned a_addr = base + pad;                       // A: 64 x 128 B
  unsigned ring = a_addr + 64 * 128 + 192 * 128;      // after A and a fixed B (the no-copy mode's)
  unsigned bars = ring + SLOTS * SLOT_BYTES;          // full[SLOTS], empty[SLOTS]
  for (int i = threadIdx.x; i < (64 + 192) * 128 / 4; i += blockDim.x)
    reinterpret_cast<unsigned*>(smem)[i] = ((unsigned)i * 2654435761u) & 0xB6B6B6B6u;
  unsigned rank = CL > 1 ? cluster_rank() : 0;
  if (threadIdx.x == 0) {
    *reinterpret_cast<volatile unsigned*>(smem + (bars + 8 * 2 * SLOTS - a_addr)) = 0;
    for (int s = 0; s < SLOTS; ++s) { mbar_init(bars + 8 * s, 1); mbar_init(bars + 8 * (SLOTS + s), 2 * CL); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (CL > 1) cluster_sync();
  int wg = threadIdx.x / 128;
  unsigned long long da = desc(a_addr), db_fixed = desc(a_addr + 64 * 128);
  float d[96];
#pragma unroll
  for (int i = 0; i < 96; ++i) d[i] = 0.f;
  unsigned a[4] = {0, 0, 0, 0};
  float x[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = 0.5f + 0.01f * i;
  int pair = blockIdx.x / 2;
  if (wg == 0) {
    if (BG && threadIdx.x == 0) {
      // background copies, not read by anyone: one 24 KiB copy per slot, at most SLOTS in flight,
      // one issued every BG ns (BG = 1: as fast as they go) until the consumers are done
      volatile unsigned* done = reinterpret_cast<volatile unsigned*>(smem + (bars + 8 * 2 * SLOTS - a_addr));
      unsigned long long next = gtimer(); int it = 0;
      while (!*done) {
        int s = it % SLOTS; unsigned ph = (it / SLOTS) & 1;
        if (it >= SLOTS) mbar_wait(bars + 8 * s, ph ^ 1);
        if (BG > 1) { while (gtimer() < next) __nanosleep(64); next += BG; }
        mbar_expect(bars + 8 * s, SLOT_BYTES);
        size_t off = (size_t)(((pair % spread) * 97 + it) % (SRC_BYTES / SLOT_BYTES)) * SLOT_BYTES;
        bulk_load(ring + s * SLOT_BYTES, src + off, SLOT_BYTES, bars + 8 * s);
        ++it;
      }
      for (int j = it - SLOTS > 0 ? it - SLOTS : 0; j < it; ++j) mbar_wait(bars + 8 * (j % SLOTS), (j / SLOTS) & 1);
      copies[blockIdx.x] = it;
    }
    if (COPY && threadIdx.x == 0) {
      for (int it = 0; it < iters; ++it) {
        int s = it % SLOTS; unsigned ph = (it / SLOTS) & 1;
        mbar_wait(bars + 8 * (SLOTS + s), ph ^ 1);    // every consumer of the slot (both CTAs) is done
        mbar_expect(bars + 8 * s, SLOT_BYTES);
        size_t off = (size_t)(((pair % spread) * 97 + it) % (SRC_BYTES / SLOT_BYTES)) * SLOT_BYTES;
        unsigned dst = ring + s * SLOT_BYTES;
        if (CL == 1) bulk_load(dst, src + off, SLOT_BYTES, bars + 8 * s);
        else bulk_load_mc(dst + rank * (SLOT_BYTES / 2), src + off + rank * (SLOT_BYTES / 2),
                          SLOT_BYTES / 2, bars + 8 * s, (unsigned short)3);
      }
    }
  } else {
    if (MATH) wg_fence();
#pragma unroll 1
    for (int it = 0; it < iters; ++it) {
      int s = it % SLOTS; unsigned ph = (it / SLOTS) & 1;
      unsigned long long db = db_fixed;
      if (COPY) { mbar_wait(bars + 8 * s, ph); if (READ) db = desc(ring + s * SLOT_BYTES); }
      if (MATH) {
        group<0>(d, a, da, db);
        for (int r = 0; r < sfu_rounds / 2; ++r) sfu_round(x);
        wg_wait<0>();
      }
      if (COPY && threadIdx.x % 128 == 0)
        for (unsigned c = 0; c < CL; ++c) {
          if (CL == 1) mbar_arrive(bars + 8 * (SLOTS + s));
          else mbar_arrive_cta(bars + 8 * (SLOTS + s), c);
        }
    }
  }
  if (BG && wg > 0) {
    asm volatile("bar.sync 1, 256;" ::: "memory");   // both consumer warpgroups are done
    if (threadIdx.x == 128) *reinterpret_cast<volatile unsigned*>(smem + (bars + 8 * 2 * SLOTS - a_addr)) = 1;
  }
  __syncthreads();
  if (CL > 1) cluster_sync();   // no CTA leaves while its peer may still write into it
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 96; ++i) sum += d[i];
#pragma unroll
  for (int i = 0; i < 8; ++i) sum += x[i];
  if (sum == 12345.f) sink[threadIdx.x] = sum;
}

static std::string smi() {
  FILE* f = popen("nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits", "r");
  char buf[256] = {0}; fgets(buf, sizeof buf, f); pclose(f);
  return std::string(buf);
}

template <int CL, bool MATH, bool COPY, bool READ = true, int BG = 0>
void sustain(const char* name, int ctas, int iters, int rounds, const unsigned char* src, int spread = 1) {
  auto kern = fed<CL, MATH, COPY, READ, BG>;
  int smem = 1024 + (64 + 192) * 128 + SLOTS * SLOT_BYTES + 256;  // + barriers and the done flag
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = CL; attr[0].val.clusterDim.y = 1; attr[0].val.clusterDim.z = 1;
  cfg.gridDim = dim3(ctas); cfg.blockDim = dim3(384); cfg.dynamicSmemBytes = smem;
  cfg.attrs = attr; cfg.numAttrs = 1;
  int max_clusters = 0;
  CK(cudaOccupancyMaxActiveClusters(&max_clusters, kern, &cfg));
  float* sink; CK(cudaMalloc(&sink, 4096));
  unsigned long long* copies; CK(cudaMalloc(&copies, ctas * 8)); CK(cudaMemset(copies, 0, ctas * 8));
  double ncopies = 0;
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  auto t0 = std::chrono::steady_clock::now();
  int n = 0, ns = 0; float total = 0; double mhz = 0, watt = 0;
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 4.0) {
    CK(cudaEventRecord(e0));
    for (int i = 0; i < 20; ++i) CK(cudaLaunchKernelEx(&cfg, kern, iters, rounds, src, sink, spread, copies));
    CK(cudaEventRecord(e1));
    double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::string s = smi();
    CK(cudaEventSynchronize(e1));
    float m; CK(cudaEventElapsedTime(&m, e0, e1));
    if (el > 1.5) {
      total += m; n += 20;
      if (BG) { std::vector<unsigned long long> c(ctas); CK(cudaMemcpy(c.data(), copies, ctas * 8, cudaMemcpyDeviceToHost));
                for (auto v : c) ncopies += 20.0 * v; }
      double c, w; if (sscanf(s.c_str(), "%lf, %lf", &c, &w) == 2) { mhz += c; watt += w; ++ns; }
    }
  }
  CK(cudaGetLastError());
  double ms = total / n, flop = MATH ? (double)ctas * 2 * iters * 4 * 2.0 * 64 * 192 * 32 : 0;
  double bytes_l2 = COPY ? (double)ctas * iters * SLOT_BYTES / CL : BG ? ncopies / n * SLOT_BYTES : 0;
  double bytes_smem = COPY ? (double)ctas * iters * SLOT_BYTES : BG ? ncopies / n * SLOT_BYTES : 0;
  mhz /= ns; watt /= ns;
  printf("%-24s rounds %2d spread %2d ctas %3d (clusters of %d, %3d fit): %7.3f ms  tensor %7.1f TFLOP/s  L2->SMEM %5.2f TB/s read, %5.2f TB/s written"
         "  %6.0f MHz %5.1f W  %5.1f TFLOP/s/GHz\n",
         name, rounds, spread, ctas, CL, max_clusters, ms, flop / ms * 1e-9, bytes_l2 / ms * 1e-9, bytes_smem / ms * 1e-9,
         mhz, watt, flop / ms * 1e-9 / (mhz * 1e-3));
  fflush(stdout);
  CK(cudaFree(sink));
}

int main(int argc, char** argv) {
  cudaDeviceProp p; CK(cudaGetDeviceProperties(&p, 0));
  int iters = argc > 1 ? atoi(argv[1]) : 4000;
  int ctas = p.multiProcessorCount & ~1;
  printf("# %s, %d SMs; FP8 64 x 192 x 128 WGMMA groups + 6 exp2 rounds per iteration and warpgroup\n",
         p.name, p.multiProcessorCount);
  unsigned char* src; CK(cudaMalloc(&src, SRC_BYTES));
  std::vector<unsigned> h(SRC_BYTES / 4);
  for (size_t i = 0; i < h.size(); ++i) h[i] = ((unsigned)i * 2654435761u + 12345u) & 0xB6B6B6B6u;
  CK(cudaMemcpy(src, h.data(), SRC_BYTES, cudaMemcpyHostToDevice));
  for (int rounds : {12, 24}) {
    sustain<1, true, false>("mix", ctas, iters, rounds, src);
    sustain<1, true, true, true>("mix+tma", ctas, iters, rounds, src);
    sustain<2, true, true, true>("mix+mc2", ctas, iters, rounds, src);
    sustain<1, true, false, false, 1>("mix, bg copies max", ctas, iters, rounds, src);
    sustain<1, true, false, false, 930>("mix, bg copies /930ns", ctas, iters, rounds, src);
    sustain<1, true, false, false, 1860>("mix, bg copies /1860ns", ctas, iters, rounds, src);
  }
  sustain<1, false, true>("tma", ctas, iters * 4, 12, src);
  sustain<2, false, true>("mc2", ctas, iters * 4, 12, src);
  return 0;
}
