"""md5 of the PTX of backward (or forward) stages over head dims, masks, dtypes and lengths,
to show that a change leaves configurations' code identical (CPU only, sm_90a).

    PYTHONPATH=. python tools/ptx_md5.py OUT.json [NAME ...]     (from a worktree's root)

NAME: registry names with options (default: kb2, kb2:deterministic=1). Compare two OUT.json
files (e.g. from a worktree of the base commit and of the change) key by key.
"""

import hashlib
import itertools
import json
import sys

import torch

from hopper_attn.harness import registry
from hopper_attn.harness.compile_report import compile_artifacts


def main() -> int:
    out = {}
    names = sys.argv[2:] or ["kb2", "kb2:deterministic=1"]
    for name, d, causal, dtype, n in itertools.product(
            names, (64, 128), (False, True), (torch.bfloat16, torch.float16), (128, 8192)):
        if dtype == torch.float16 and n == 8192:
            continue
        art = compile_artifacts(registry.get(name), d, causal, dtype, seqlen=n)
        key = f"{name} d{d} causal{int(causal)} {str(dtype)[6:]} N{n}"
        out[key] = hashlib.md5(art["ptx"].encode()).hexdigest() if art["ok"] \
            else "FAIL " + art["error"]
        print(key, out[key][:60], flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
