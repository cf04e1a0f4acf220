"""What order the compiled loop runs in: WGMMA groups and waits around the exp2s, from SASS.

The PTX says what a kernel asks for; ptxas decides the order and the grouping. Two facts
decide whether a warpgroup's softmax runs under its own PV (k6's overlap):

* **WGMMA groups.** `wgmma.commit_group` closes a group in the PTX; in the SASS a group ends
  at the `HGMMA` that carries `gsb0`. `wait_group(1)` waits until at most one group is in
  flight, so if ptxas splits PV into one group per k16 slice (each behind a
  `WARPGROUP.ARRIVE` of its own), "S ready, PV may still run" becomes "all of PV but its last
  slice done" (docs/lab/k6.md "One WGMMA group per P slice").
* **Where the waits land among the exp2s.** ptxas moves `WARPGROUP.DEPBAR` up as far as
  nothing stops it (docs/lab/k6.md "What the SASS says"); the number of `MUFU.EX2` between the
  `0x1` and the `0x0` wait is the part of the softmax that runs under PV.

    python -m hopper_attn.harness.sass_order k6 256 0          # groups, exp2 counts, loop order
    python -m hopper_attn.harness.sass_order "k6:pv_wait=after8,rescale=eager" 256 1
    python -m hopper_attn.harness.sass_order k7:pv_wait=free 128 0 --ptxas   # + ptxas's notes
    python -m hopper_attn.harness.sass_order k7 128 0 --stalls   # + cycles between exp2s
    python -m hopper_attn.harness.sass_order k6 64 1 --seqlen 16384   # the default there

No GPU needed (compiles for sm_90a). `tools/fa4_sass.py` prints the same for
FlashAttention-4's sm90 forward.
"""

from __future__ import annotations

import re

GMMA = re.compile(r"([HQ]GMMA)\.(\d+)x(\d+)x(\d+)\S*\s+R\d+,\s*(\S+?),")


def wgmma_groups(sass_text: str) -> list:
    """[(form, n, hgmmas)] in code order: form "rs" (A in registers, PV) or "ss" (A in shared
    memory), n the instruction's N, a group closing at an HGMMA with `gsb0`."""
    groups, size = [], 0
    for line in sass_text.splitlines():
        m = GMMA.search(line)
        if not m:
            continue
        size += 1
        if "gsb0" in line:
            groups.append(("rs" if m.group(5).startswith("R") else "ss", int(m.group(3)), size))
            size = 0
    return groups


def format_groups(groups) -> str:
    """e.g. `ss N80: 16 16 | rs N256: 1 1 1 1 1 5` (runs of the same form and N merged)."""
    runs = []
    for form, n, size in groups:
        label = f"{form} N{n}"
        if runs and runs[-1][0] == label:
            runs[-1][1].append(size)
        else:
            runs.append((label, [size]))
    return " | ".join(f"{label}: {' '.join(map(str, sizes))}" for label, sizes in runs)


def _instructions(sass_text: str):
    """[(address, text)] and {label: address of the next instruction}."""
    found, labels, pending = [], {}, []
    for line in sass_text.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if not m:
            continue
        address = int(m.group(1), 16)
        for name in pending:
            labels[name] = address
        pending = []
        found.append((address, m.group(2)))
    return found, labels


def _events(instructions) -> list:
    """exp2s, WGMMA fences, waits and HGMMAs, runs of the same event counted."""
    events = []
    for _, text in instructions:
        m = GMMA.search(text + ";")
        if "MUFU.EX2" in text:
            events.append("EX2")
        elif "WARPGROUP.DEPBAR" in text:
            events.append("DEPBAR " + text.split(",")[-1].strip())
        elif "WARPGROUP.ARRIVE" in text:
            events.append("ARRIVE")
        elif re.search(r"\bMEMBAR\b", text):
            events.append("MEMBAR")
        elif m:
            events.append(("HGMMA-rs" if m.group(5).startswith("R") else "HGMMA-ss")
                          + f".N{m.group(3)}" + (" gsb0" if "gsb0" in text else ""))
    out, previous, run = [], None, 0
    for event in events + [None]:
        if event == previous:
            run += 1
            continue
        if previous:
            out.append(f"{previous} x{run}" if run > 1 else previous)
        previous, run = event, 1
    return out


def loops(sass_text: str) -> list:
    """The innermost loops that hold a WGMMA: [(start, end, events)]. A loop is a backward
    branch; ranges that contain an EXIT are the mbarrier retry stubs ptxas places after the
    kernel's end, not loops."""
    instructions, labels = _instructions(sass_text)
    found = []
    for address, text in instructions:
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        if m and labels.get(m.group(1), 1 << 60) < address:
            body = [x for x in instructions if labels[m.group(1)] <= x[0] <= address]
            events = _events(body)
            if any("HGMMA" in e for e in events) and \
                    not any(re.search(r"\bEXIT\b", t) for _, t in body):
                found.append((labels[m.group(1)], address, events))
    return [r for r in found if not any(o is not r and o[1] - o[0] < r[1] - r[0]
                                        and o[0] <= r[1] and r[0] <= o[1] for o in found)]


def loop_body(sass_text: str, loop) -> list:
    """The instructions (text without address) of one of `loops`' results, in code order."""
    start, end, _ = loop
    return [text for address, text in _instructions(sass_text)[0] if start <= address <= end]


# `nvdisasm -hex`: each instruction's two 64-bit words, the second on the next line
_ENCODED = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* 0x[0-9a-f]{16} \*/\s*\n"
                      r"\s*/\* 0x([0-9a-f]{16}) \*/")


def control_bits(sass_hex: str) -> list:
    """[(address, text, stall, write_sb, read_sb, wait_mask)] per instruction, from
    `compile_report.sass(cubin, encoding=True)`. Since Volta each instruction carries its
    schedule in bits 105-125: `stall`, the cycles the warp waits before it issues its next
    instruction (set by ptxas for fixed-latency dependencies and for pacing a pipe);
    `write_sb` / `read_sb`, the scoreboard a variable-latency result (MUFU, loads) sets
    (7: none); `wait_mask`, the scoreboards this instruction waits for."""
    out = []
    for m in _ENCODED.finditer(sass_hex):
        ctrl = int(m.group(3), 16) >> 41
        out.append((int(m.group(1), 16), m.group(2), ctrl & 0xF, (ctrl >> 5) & 7,
                    (ctrl >> 8) & 7, (ctrl >> 11) & 0x3F))
    return out


def exp2_gaps(sass_hex: str) -> list:
    """Per innermost loop: the static issue cycles between consecutive `MUFU.EX2` (the
    stall counts from one to the next), i.e. how fast one warp alone could issue its exp2s
    as ptxas scheduled them (docs/lab/k7.md "Where the phases line up": 8 cycles each in k7's
    loop, the SFU rate of one SM sub-partition)."""
    coded = control_bits(sass_hex)
    result = []
    for start, end, _ in loops(sass_hex):
        body = [c for c in coded if start <= c[0] <= end]
        at = [i for i, c in enumerate(body) if "MUFU.EX2" in c[1]]
        result.append([sum(c[2] for c in body[a:b]) for a, b in zip(at, at[1:])])
    return result


WARPGROUP_OPS = re.compile(r"\bWARPGROUP\.|\b[HQ]GMMA\.")


WARP_VOTE = r"VOTE\.(?:ANY|ALL)\S*\s+(P\d)\b"
# a named barrier's reduction (bar.red.or / .and .pred): its result predicate, the same
# for every thread the barrier counts (a warpgroup's 128: common/warp_roles.barrier_any)
BARRIER_VOTE = r"B2R\.RESULT\s+RZ,\s*(P\d)\b"


def warpgroup_ops_under_warp_votes(sass_text: str, vote_pattern: str = WARP_VOTE) -> list:
    """[(vote address, branch address, [(address, text) of each WARPGROUP.* / HGMMA that
    the branch skips])] for every forward branch on a `VOTE.ANY`'s / `VOTE.ALL`'s
    predicate. A vote is per warp, so such a branch may split a warpgroup's four warps;
    the WGMMA instructions are .sync.aligned: all four must execute each one at the same pc
    (compute-sanitizer synccheck: "Mismatching warpgroup instruction pc between warps").
    vote_pattern=BARRIER_VOTE: the same for branches on a barrier reduction's result."""
    instructions, labels = _instructions(sass_text)
    found = []
    for i, (vote_at, text) in enumerate(instructions):
        vote = re.match(vote_pattern, text)
        if not vote:
            continue
        pred = vote.group(1)
        for branch_at, branch in instructions[i + 1:]:
            if re.match(rf"@!?{pred}\s", branch) and " BRA " in f" {branch} ":
                target = re.search(r"`\((\.L_x_\d+)\)", branch)
                end = labels.get(target.group(1), -1) if target else -1
                skipped = [(a, t) for a, t in instructions
                           if branch_at < a < end and WARPGROUP_OPS.search(t)]
                found.append((vote_at, branch_at, skipped))
                break
            if re.match(rf"(@!?P\d\s+)?\S+\s+(PT,\s*)?{pred},", branch):
                break                               # the predicate written again
    return found


def summary(ptx: str, sass_text: str) -> str:
    lines = [f"ex2: {ptx.count('ex2.approx')} in the PTX, {sass_text.count('MUFU.EX2')} "
             f"MUFU.EX2 in the SASS",
             f"WGMMA groups: {format_groups(wgmma_groups(sass_text))}"]
    for start, end, events in loops(sass_text):
        lines.append(f"loop {start:#x}-{end:#x}: " + " ; ".join(events))
    return "\n".join(lines)


def main(argv=None):
    import argparse

    import torch

    from hopper_attn.harness import registry
    from hopper_attn.harness.compile_report import compile_artifacts, sass
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", help="a registry name, options allowed (k6:pv_wait=late)")
    parser.add_argument("head_dim", type=int)
    parser.add_argument("causal", type=int, choices=(0, 1))
    parser.add_argument("--seqlen", type=int, default=128,
                        help="the length compiled for (k6's defaults depend on it)")
    parser.add_argument("--ptxas", action="store_true",
                        help="also ptxas's notes (serialized WGMMAs and why; needs ptxas)")
    parser.add_argument("--stalls", action="store_true",
                        help="also the static cycles between the loops' exp2s (control bits)")
    args = parser.parse_args(argv)
    art = compile_artifacts(registry.get(args.kernel), args.head_dim, bool(args.causal),
                            torch.bfloat16, seqlen=args.seqlen)
    if not art["ok"]:
        raise RuntimeError(f"compile failed: {art['error']}")
    print(summary(art["ptx"], sass(art["cubin"])))
    if args.stalls:
        for i, gaps in enumerate(exp2_gaps(sass(art["cubin"], encoding=True))):
            if gaps:
                ordered = sorted(gaps)
                print(f"loop {i}: {len(gaps) + 1} exp2s, static cycles between two: median "
                      f"{ordered[len(ordered) // 2]}, min {ordered[0]}, max {ordered[-1]}; "
                      f"{sum(gaps)} from the first to the last")
    if args.ptxas:
        from hopper_attn.harness.compile_report import ptxas_notes
        print("\n".join(ptxas_notes(art["ptx"])) or "ptxas: no performance notes")


if __name__ == "__main__":
    main()
