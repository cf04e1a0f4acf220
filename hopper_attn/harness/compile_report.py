"""Compile kernels for sm_90a (no GPU needed) and report what the binary shows.

For each kernel and configuration: compile seconds, registers / stack / local memory per
thread from the cubin (`cuobjdump --dump-resource-usage`), dynamic shared memory from the
kernel's SharedStorage, and register spills (ptxas runs with --warn-on-spills
--warning-as-error, so a spill fails the compile and is reported as such). The PTX is kept
so tests can assert what each stage is about (TMA, mbarrier waits, WGMMA, ...).
"""

from __future__ import annotations

import itertools
import re
import subprocess
import tempfile
import time

import torch

from hopper_attn.common.contract import DTYPE_NAMES, Problem

SPILLS_AS_ERRORS = "--ptxas-options='--warn-on-spills --warning-as-error'"


def compile_artifacts(entry, head_dim: int, causal: bool, dtype=torch.bfloat16,
                      seqlen: int = 128, heads: int = 2, heads_kv: int = 0,
                      window: tuple = (-1, -1), head_dim_v: int = 0) -> dict:
    """Fresh compile (no cache) with PTX and cubin kept in memory (k6's defaults depend on
    the length: `seqlen` picks which; kb2's on whether k/v have fewer heads: `heads_kv`;
    `head_dim_v`: v's head dim where it is not head_dim)."""
    problem = Problem(2, heads, seqlen, head_dim, causal, dtype, heads_kv=heads_kv,
                      window_left=window[0], window_right=window[1], head_dim_v=head_dim_v)
    with tempfile.TemporaryDirectory() as dump:
        opts = f"--keep-ptx --keep-cubin --dump-dir={dump} {SPILLS_AS_ERRORS}"
        t0 = time.perf_counter()
        try:
            handle = entry.compile(problem, compile_options=opts)
        except Exception as exc:  # noqa: BLE001 - report, the caller decides
            message = str(exc)
            spills = "spill" in message.lower()
            first = next((ln for ln in message.splitlines() if "error" in ln.lower()), message[:200])
            return {"ok": False, "spills": spills, "error": first.strip()[:400],
                    "compile_s": time.perf_counter() - t0}
        seconds = time.perf_counter() - t0
        ptx, cubin = handle.compiled.__ptx__, handle.compiled.__cubin__
    if not isinstance(ptx, str) or not isinstance(cubin, (bytes, bytearray)):
        raise RuntimeError("CuTe DSL did not return PTX/cubin in memory (dump dir missing?)")
    return {"ok": True, "spills": False, "compile_s": seconds, "ptx": ptx.rstrip("\0"),
            "cubin": bytes(cubin), "kernel": handle.describe()}


def _cubin_tool(tool: str, cubin: bytes, *args) -> str:
    """Run a CUDA binary utility (from its pip wheel) on a cubin; return its stdout."""
    from cuda.pathfinder import find_nvidia_binary_utility
    path = find_nvidia_binary_utility(tool)
    if path is None:
        raise RuntimeError(f"{tool} not found: pip install nvidia-cuda-{tool}")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([path, *args, f.name], capture_output=True, text=True,
                              check=True).stdout


def ptxas_notes(ptx: str, arch: str = "sm_90a") -> list[str]:
    """ptxas's performance notes on a kernel's PTX (`ptxas -v`, from the CUDA toolkit on
    PATH), e.g. `(C7514) ... wgmma.mma_async instructions are serialized ...`: the reason
    when every WGMMA of a kernel is followed by its own wait (docs/lab/k7.md "QK one tile
    ahead"). [] when ptxas says nothing of the kind."""
    import shutil
    path = shutil.which("ptxas")
    if path is None:
        raise RuntimeError("ptxas not found on PATH (a CUDA toolkit's bin/)")
    with tempfile.TemporaryDirectory() as tmp:
        src = f"{tmp}/kernel.ptx"
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([path, f"-arch={arch}", "-v", src, "-o", f"{tmp}/k.cubin"],
                              capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed: {done.stderr.strip()[:500]}")
    return [line.split("in the function")[0].strip()
            for line in (done.stdout + done.stderr).splitlines()
            if re.search(r"\(C75\d\d\)|Potential Performance Loss", line)]


def resource_usage(cubin: bytes) -> list[dict]:
    """Per-function REG / STACK / SHARED / LOCAL from cuobjdump."""
    out = _cubin_tool("cuobjdump", cubin, "--dump-resource-usage")
    rows = []
    for name, body in re.findall(r"Function (\S+):\s*\n\s*(REG:.*)", out):
        fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", body))
        short = re.sub(r"^kernel_cutlass_", "", name).split("_kernels")[0].split("_hopper_attn")[0]
        rows.append({"function": short, "registers": int(fields["REG"]),
                     "stack": int(fields["STACK"]), "local": int(fields["LOCAL"]),
                     "static_smem": int(fields["SHARED"])})
    return rows


def sass(cubin: bytes, encoding: bool = False) -> str:
    """Disassembly (nvdisasm) of a cubin; `encoding`: with each instruction's two 64-bit
    words (`-hex`), which hold its control bits (sass_order.control_bits)."""
    return _cubin_tool("nvdisasm", cubin, *(["-hex"] if encoding else []))


def report(entries, head_dims=(64, 128), causals=(False, True),
           dtypes=(torch.bfloat16,)) -> list[dict]:
    rows = []
    for entry in entries:
        for dtype, d, causal in itertools.product(dtypes, head_dims, causals):
            reason = entry.spec.unsupported_reason(Problem(2, 2, 128, d, causal, dtype))
            if reason:                      # a row that says why, instead of none
                rows.append({"kernel": entry.name, "head_dim": d, "causal": causal,
                             "dtype": DTYPE_NAMES[dtype], "ok": True, "skipped": reason,
                             "spills": False})
                continue
            art = compile_artifacts(entry, d, causal, dtype)
            row = {"kernel": entry.name, "head_dim": d, "causal": causal,
                   # FP8 stages: the inputs they compute from (the problem itself is bf16)
                   "dtype": "e4m3" if entry.spec.input_dtype is not None else DTYPE_NAMES[dtype],
                   "compile_s": round(art["compile_s"], 2), "ok": art["ok"],
                   "spills": art["spills"]}
            if art["ok"]:
                usage = resource_usage(art["cubin"])
                row["functions"] = usage
                row["registers"] = max(u["registers"] for u in usage)
                row["local_bytes"] = max(u["local"] for u in usage)
                row["smem_bytes"] = art["kernel"].get("smem_bytes")
            else:
                row["error"] = art["error"]
            rows.append(row)
    return rows


def format_rows(rows) -> str:
    lines = [f"{'kernel':8} {'dtype':5} {'d':>4} {'causal':>6} {'compile s':>9} {'regs':>5} {'local B':>7} "
             f"{'SMEM KiB':>8}  spills"]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"{r['kernel']:8} {r.get('dtype', 'bf16'):5} {r['head_dim']:>4} "
                         f"{int(r['causal']):>6} skipped: {r['skipped']}")
            continue
        if not r["ok"]:
            lines.append(f"{r['kernel']:8} {r.get('dtype', 'bf16'):5} {r['head_dim']:>4} {int(r['causal']):>6} "
                         f"{r['compile_s']:>9} FAILED: {r['error'].splitlines()[-1][:80]}")
            continue
        smem = r.get("smem_bytes")
        lines.append(f"{r['kernel']:8} {r.get('dtype', 'bf16'):5} {r['head_dim']:>4} {int(r['causal']):>6} {r['compile_s']:>9} "
                     f"{r['registers']:>5} {r['local_bytes']:>7} "
                     f"{(smem / 1024 if smem else 0):>8.1f}  {'YES' if r['spills'] else 'no'}")
    return "\n".join(lines)
