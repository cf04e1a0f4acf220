"""Baselines measured in the same run as the kernels: torch SDPA (FLASH and CUDNN backends)
and FlashAttention-4's CuTe DSL Hopper kernel when it is importable; forward, and backward
(`backward_available`: each baseline's own backward, through autograd)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _sdpa(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                  v.transpose(1, 2), is_causal=causal)
    return run


def fa4(**options):
    """FlashAttention-4's `flash_attn_func` as run(q, k, v, causal) -> the output (not the
    (out, lse) pair some versions return), with `options` (window_size=, softcap=, ...)
    passed through. Raises ImportError where FA4 is not installed."""
    from flash_attn.cute.interface import flash_attn_func

    def run(q, k, v, causal):
        out = flash_attn_func(q, k, v, causal=causal, **options)
        return out[0] if isinstance(out, tuple) else out
    return run


def _fa4():
    return fa4()


def _fa4_no_overlap():
    """FlashAttention-4's sm90 forward without its intra-warpgroup overlap
    (`intra_wg_overlap=False`): warp specialization, setmaxnreg and ping-pong between two
    consumer warpgroups, the design of this repository's k5 (docs/k5.md)."""
    from flash_attn.cute.interface import _flash_attn_fwd   # (raises if absent)

    def run(q, k, v, causal):
        return _flash_attn_fwd(q, k, v, causal=causal, intra_wg_overlap=False)[0]
    return run


class CudnnFp8:
    """cuDNN's FP8 attention (what TransformerEngine runs on Hopper), through the
    cudnn-frontend Python graph API (`pip install nvidia-cudnn-frontend`; on the GPU host
    `pack --with-cudnn-fe`). Per-tensor e4m3 scaling (scale = 448 / amax), FP8 output (on
    Hopper cuDNN has no bf16 output from FP8 inputs), P scaled by 448 inside. `prepare`
    quantizes outside the timing and returns the call to time; `output` dequantizes what it
    wrote, for the error on the same inputs."""

    def __init__(self):
        import cudnn
        self.cudnn = cudnn
        self.handle = cudnn.create_handle()
        self.graphs = {}

    def _graph(self, shape, kv_shape, causal):
        key = (shape, kv_shape, causal)
        if key in self.graphs:
            return self.graphs[key]
        cudnn = self.cudnn
        b, n, h, d = shape
        _, nk, hk, _ = kv_shape
        fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32,
                          handle=self.handle)

        def bnhd(name, nn, hh):          # a (B, N, H, d) buffer seen as (B, H, N, d)
            return g.tensor(name=name, dim=[b, hh, nn, d], stride=[nn * hh * d, d, hh * d, 1],
                            data_type=fp8)

        q, k, v = bnhd("q", n, h), bnhd("k", nk, hk), bnhd("v", nk, hk)
        scalars = [g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
                   for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s",
                                "scale_o")]
        o, _, amax_s, amax_o = g.sdpa_fp8(q, k, v, *scalars, generate_stats=False,
                                          attn_scale=d ** -0.5, use_causal_mask=causal)
        o.set_output(True).set_dim([b, h, n, d]).set_stride([n * h * d, d, h * d, 1]) \
            .set_data_type(fp8)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]) \
                .set_data_type(f32)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        workspace = torch.empty(g.get_workspace_size(), dtype=torch.uint8, device="cuda")
        self.graphs[key] = (g, (q, k, v), scalars, (o, amax_s, amax_o), workspace)
        return self.graphs[key]

    def prepare(self, q, k, v, causal):
        """Quantize q, k, v (per tensor) and build the graph; returns the callable to time
        (it leaves the FP8 output and its descale in `self.last`)."""
        g, (tq, tk, tv), scalars, (to, tas, tao), workspace = self._graph(
            tuple(q.shape), tuple(k.shape), causal)
        tensors, descales = [], []
        for x in (q, k, v):
            amax = x.abs().amax().float().clamp_min(1e-12)
            tensors.append((x.float() * (448.0 / amax)).to(torch.float8_e4m3fn))
            descales.append((amax / 448.0).reshape(1, 1, 1, 1))
        one = torch.ones(1, 1, 1, 1, device="cuda")
        scale_o = (1.0 / descales[2]).reshape(1, 1, 1, 1)      # |O| <= max |V|
        values = [*descales, one / 448.0, one * 448.0, scale_o]
        out = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device="cuda")
        amax_s, amax_o = (torch.empty(1, 1, 1, 1, device="cuda") for _ in range(2))
        pack = {tq: tensors[0], tk: tensors[1], tv: tensors[2], to: out, tas: amax_s,
                tao: amax_o, **dict(zip(scalars, values))}
        self.last = (out, descales[2], tensors, descales)

        def run():
            self.cudnn.set_stream(self.handle, torch.cuda.current_stream().cuda_stream)
            g.execute(pack, workspace, handle=self.handle)
            return out
        return run

    def output(self) -> torch.Tensor:
        """The last run's output, dequantized to fp32 (B, N, H, d)."""
        out, descale_v, _, _ = self.last
        return out.float() * descale_v.reshape(())


def _cudnn_fp8():
    return CudnnFp8()


BASELINES = {
    "sdpa_flash": lambda: _sdpa("FLASH_ATTENTION"),
    "sdpa_cudnn": lambda: _sdpa("CUDNN_ATTENTION"),
    "fa4": _fa4,
    "fa4_no_overlap": _fa4_no_overlap,
    "cudnn_fp8": _cudnn_fp8,
}


def runner(fn, q, k, v, causal):
    """A callable without arguments that runs baseline `fn` once on (q, k, v): what its
    `prepare` returns where it has one (cudnn_fp8 quantizes there, outside the timing), else
    the plain call."""
    if hasattr(fn, "prepare"):
        return fn.prepare(q, k, v, causal)
    return lambda: fn(q, k, v, causal)


def available(names=None) -> dict:
    """name -> callable(q, k, v, causal), for the baselines that run here (None: all of them;
    [] or `--baselines ""`: none); reasons for the rest."""
    found, missing = {}, {}
    for name in (BASELINES if names is None else names):   # [] means none
        try:
            fn = BASELINES[name]()
            q = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
            runner(fn, q, q, q, False)()
            torch.cuda.synchronize()
            found[name] = fn
        except Exception as exc:  # noqa: BLE001 - any failure means "not available here"
            missing[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    return found, missing


def _backward_of(forward):
    """fn(q, k, v, do, causal) -> a callable that runs the baseline's backward once: the
    forward runs once (outside the timing) with grad enabled, then each call is
    torch.autograd.grad of its output (the graph is kept), which launches only the backward."""
    def make(q, k, v, do, causal):
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out = forward(qg, kg, vg, causal)
        if isinstance(out, tuple):
            out = out[0]
        grad_out = do if out.shape == do.shape else do.transpose(1, 2)
        return lambda: torch.autograd.grad(out, (qg, kg, vg), grad_out, retain_graph=True)
    return make


def backward_available(names=None) -> tuple:
    """name -> make(q, k, v, do, causal) -> callable running one backward; reasons for the rest."""
    found, missing = {}, {}
    for name in (BASELINES if names is None else names):   # [] means none
        try:
            make = _backward_of(BASELINES[name]())
            q = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
            make(q, q, q, q, False)()
            torch.cuda.synchronize()
            found[name] = make
        except Exception as exc:  # noqa: BLE001 - any failure means "not available here"
            missing[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    return found, missing
