"""One correctness check: fresh random inputs inside NaN guards, NaN-poisoned output, fp32
reference, verdict; plus: nothing written outside `out`, and a second run gives the same bits."""

from __future__ import annotations

import torch

from hopper_attn.quantize import E4M3_MAX, dequantize_fp8

from .inputs import guarded_empty, guarded_like, guards_intact, make_inputs, poison
from .reference import error_stats, judge, reference_attention, torch_lowp_attention


class ReferenceCase:
    """Inputs for one problem plus the fp32 reference and torch's bf16 error on them."""

    def __init__(self, problem, seed: int, scale: float = 1.0):
        self.problem = problem
        self.q, self.k, self.v, self.out, self.buffers = make_inputs(problem, seed, scale,
                                                                      with_buffers=True)
        self.ref = reference_attention(self.q, self.k, self.v, problem.causal)
        self.torch_err = error_stats(torch_lowp_attention(self.q, self.k, self.v, problem.causal),
                                     self.ref)

    def check(self, entry, handle) -> dict:
        if entry.spec.input_dtype is not None:
            return self.check_fp8(entry, handle)
        self.out.fill_(float("nan"))
        entry.run(handle, self.q, self.k, self.v, self.out)
        torch.cuda.synchronize()
        verdict = judge(error_stats(self.out, self.ref), self.torch_err, self.ref)
        first = self.out.clone()
        self.out.fill_(float("nan"))
        entry.run(handle, self.q, self.k, self.v, self.out)
        torch.cuda.synchronize()
        # bitwise: compare the raw 16-bit patterns (NaN != NaN as floats)
        verdict["same_bits"] = bool(torch.equal(first.view(torch.int16), self.out.view(torch.int16)))
        verdict["guards_intact"] = all(guards_intact(b) for b in self.buffers)
        verdict["ok"] = verdict["ok"] and verdict["same_bits"] and verdict["guards_intact"]
        return verdict

    def check_fp8(self, entry, handle) -> dict:
        """An FP8 stage (k7): its inputs are the quantized q, k, v (each copied into a buffer
        whose neighbouring bytes are e4m3 NaN) and their descales. Its own error is measured
        against the fp32 reference on the *dequantized* inputs and judged against the error
        of an FP8 emulation in torch on the same inputs (P rounded to e4m3 as the kernel
        does, everything else fp32): at most ERROR_RATIO_LIMIT x that. The error against the
        bf16-input reference (end to end: input quantization included) is reported too. An
        e4m3 output (k7:out_fp8=1) is read through its descale, and the emulation's output
        rounded to e4m3 the same way."""
        q8, k8, v8, *descales = entry.prepare(self.q, self.k, self.v)
        views, buffers = [], list(self.buffers[3:])          # out's guards stay checked
        for t in (q8, k8, v8):
            buffer, view = guarded_like(t)
            view.copy_(t)
            views.append(view)
            buffers.append(buffer)
        deq = [dequantize_fp8(t, s) for t, s in zip(entry.logical(q8, k8, v8), descales)]
        causal = self.problem.causal
        ref = reference_attention(*deq, causal)
        emulated = reference_attention(*deq, causal, fp8_probs=True).to(self.out.dtype).float()
        out = self.out
        if handle.spec.output_dtype is not None:     # an e4m3 output (k7:out_fp8=1) ...
            out_buffer, out = guarded_empty(self.problem.shape, handle.spec.output_dtype,
                                            self.out.device)
            buffers[0] = out_buffer
            # ... emulated too: rounded to e4m3 in the descale's units (at most 448: O is
            # a convex combination of v8's rows)
            descale_o = entry.load().output_descale(descales[-1], self.problem.heads)
            emulated = dequantize_fp8((emulated / descale_o[:, None, :, None]).clamp(
                -E4M3_MAX, E4M3_MAX).to(out.dtype), descale_o)
        runs = []
        for _ in range(2):
            entry.run(handle, *views, *descales, poison(out))
            torch.cuda.synchronize()
            runs.append(out.clone())
        result = entry.output_as_float(runs[0], descales)
        verdict = judge(error_stats(result, ref), error_stats(emulated, ref), ref)
        verdict["end_to_end"] = error_stats(result, self.ref)            # vs bf16 inputs
        verdict["torch_bf16_max_abs"] = self.torch_err["max_abs"]
        verdict["same_bits"] = bool(torch.equal(runs[0].view(torch.uint8),
                                                runs[1].view(torch.uint8)))
        verdict["guards_intact"] = all(guards_intact(b) for b in buffers)
        verdict["ok"] = verdict["ok"] and verdict["same_bits"] and verdict["guards_intact"]
        return verdict
