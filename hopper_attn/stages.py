"""The stages by name, and how to build each one.

A name maps to a stage module (`hopper_attn/k4.py`, ...) plus compile options, so one module
can appear as several variants (k3_1, k3_2, k3_3 are k3 with 1, 2 and 5 pipeline stages).
A name may carry options after a colon, `k6:rescale=eager` or `k4:block_n=64,stages=3`
(integers, or named settings such as `k6:pv_wait=late`; option names are checked against the
stage's `compile_kernel`, values when it compiles), and `lab:<module>` names an
experiment kept in the top-level `lab/` folder (run from the repository root). A name that is
unknown or malformed raises `ValueError` saying what is wrong, before anything compiles.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect


@dataclasses.dataclass(frozen=True)
class KernelEntry:
    name: str
    module: str
    options: tuple = ()          # ((key, value), ...) passed to compile_kernel
    note: str = ""

    def load(self):
        return importlib.import_module(self.module)

    @property
    def spec(self):
        return self.load().SPEC

    def compile(self, problem, compile_options: str = ""):
        return self.load().compile_kernel(problem, compile_options=compile_options,
                                          **dict(self.options))

    def prepare(self, q, k, v) -> tuple:
        """The kernel's inputs made from bf16 q, k, v (outside any timing): k7 quantizes them
        to FP8 with descales (in the layout the entry's options ask for); the other stages
        take them as they are."""
        prepare = getattr(self.load(), "prepare_inputs", None)
        return tuple(prepare(q, k, v, **dict(self.options))) if prepare is not None \
            else (q, k, v)

    def logical(self, *tensors) -> tuple:
        """`prepare`'s q, k, v back as plain (batch, seqlen, heads, head_dim) tensors (k7
        with a packed V: unpacked), for references."""
        logical = getattr(self.load(), "logical_inputs", None)
        return tuple(logical(*tensors, **dict(self.options))) if logical is not None \
            else tuple(tensors)

    def output_for(self, handle, out):
        """The tensor the compiled kernel writes in place of `out` (the problem's dtype): `out`
        itself, or where the kernel's output has another dtype (k7:out_fp8=1, e4m3) a new one
        of out's shape, NaN-filled."""
        dtype = handle.spec.output_dtype
        if dtype is None or dtype == out.dtype:
            return out
        from hopper_attn.harness.inputs import guarded_empty
        return guarded_empty(tuple(out.shape), dtype, out.device)[1]

    def output_as_float(self, out, descales) -> "torch.Tensor":
        """The kernel's output in fp32: an e4m3 output times its descale (k7's
        `output_descale`, from the extra inputs), a 16-bit one as it is."""
        if out.element_size() != 1:
            return out.float()
        from hopper_attn.quantize import dequantize_fp8
        return dequantize_fp8(out, self.load().output_descale(descales[-1], out.shape[2]))

    def run(self, handle, *tensors):
        """Forward: (*prepare(q, k, v), out); backward: (q, k, v, o, do, lse, dq, dk, dv)."""
        self.load().run_kernel(handle, *tensors)


KERNELS = {e.name: e for e in [
    KernelEntry("k1", "hopper_attn.k1", note="naive, three kernels, N x N scores in memory"),
    KernelEntry("k2", "hopper_attn.k2", note="fused FA2, CUDA cores"),
    KernelEntry("k3_1", "hopper_attn.k3", (("stages", 1),), note="TMA, 1-stage pipeline"),
    KernelEntry("k3_2", "hopper_attn.k3", (("stages", 2),), note="TMA, 2-stage pipeline"),
    KernelEntry("k3_3", "hopper_attn.k3", (("stages", 5),), note="TMA, 5-stage pipeline"),
    KernelEntry("k4_qk", "hopper_attn.k4_qk", note="WGMMA for QK^T, S through SMEM"),
    KernelEntry("k4", "hopper_attn.k4", note="WGMMA for both GEMMs, P in registers"),
    KernelEntry("k5", "hopper_attn.k5", note="warp specialization, setmaxnreg, ping-pong"),
    KernelEntry("k6", "hopper_attn.k6", note="k5 + intra-warpgroup overlap, head dims 64-256, fp16, persistent"),
    KernelEntry("k7", "hopper_attn.k7", note="k6 in FP8 (e4m3): V transposed in SMEM, bf16 output"),
    KernelEntry("k8", "hopper_attn.k8", note="k7 + incoherent processing (Q, K rotated before FP8)"),
    KernelEntry("decode", "hopper_attn.decode", note="decode: packed GQA rows, split-KV combined by LSE"),
]}

# The backward stages: run_kernel(handle, q, k, v, o, do, lse, dq, dk, dv)
BACKWARD_KERNELS = {e.name: e for e in [
    KernelEntry("kb1", "hopper_attn.kb1", note="FA2 backward on WGMMA, dQ by fp32 reduce-adds"),
    KernelEntry("kb2", "hopper_attn.kb2", note="kb1 + warp specialization, setmaxnreg, dQ by bulk reduce-add"),
]}


def _parse_options(name: str, opts: str) -> dict:
    extra = {}
    for item in opts.split(","):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not key or not eq or not value:
            raise ValueError(f"stage {name!r}: options are written key=value, comma-separated, "
                             f"e.g. 'k4:block_n=64,stages=3' (got {item!r})")
        # an integer (booleans 0 or 1), or a named setting (k6:pv_wait=after7), which the
        # stage's compile_kernel checks
        extra[key] = int(value) if value.lstrip("-").isdigit() else value
    return extra


def _check_options(entry: KernelEntry, extra: dict) -> None:
    """Option names the stage's compile_kernel takes (ValueError naming the valid ones)."""
    module = entry.load()
    params = inspect.signature(module.compile_kernel).parameters
    valid = [p for p, v in params.items() if p not in ("problem", "compile_options")
             and v.kind is not inspect.Parameter.VAR_KEYWORD]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        if not hasattr(module, "OPTIONS"):      # a stage that checks its own
            return
        valid += list(module.OPTIONS)           # (k6, k7: the settings of their POLICY)
    unknown = sorted(set(extra) - set(valid))
    if unknown:
        raise ValueError(f"stage {entry.name!r}: unknown option(s) {', '.join(unknown)}; "
                         f"{entry.name.partition(':')[0]} takes: {', '.join(valid)}")


def get(name: str) -> KernelEntry:
    """A registered name, optionally with options: 'k4:block_n=64,stages=3',
    'k6:pv_wait=late,item_end=q_buffer'; or an experiment
    in lab/: 'lab:k6_example[:options]'. ValueError for an unknown or malformed name."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a stage name is a non-empty string, e.g. 'k6', got {name!r}")
    if name.startswith("lab:"):
        module, _, opts = name[len("lab:"):].partition(":")
        if not module.isidentifier():
            raise ValueError(f"{name!r}: 'lab:' names a module of lab/, e.g. 'lab:k6_example'")
        entry = KernelEntry(f"lab:{module}", f"lab.{module}", note="an experiment in lab/")
        try:
            entry.load()
        except ModuleNotFoundError as e:
            raise ValueError(f"{name!r}: no module lab/{module}.py (lab/ experiments run from "
                             f"the repository root): {e}") from None
    else:
        base, _, opts = name.partition(":")
        known = {**KERNELS, **BACKWARD_KERNELS}
        if base not in known:
            raise ValueError(f"unknown stage {base!r}; known: {', '.join(known)}")
        entry = known[base]
    if not opts:
        return entry
    extra = _parse_options(name, opts)
    _check_options(entry, extra)
    merged = tuple(sorted({**dict(entry.options), **extra}.items()))
    return dataclasses.replace(entry, name=name, options=merged)


def resolve(names) -> list[KernelEntry]:
    return [get(n) for n in names]
