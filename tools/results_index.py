"""Which files under results/ does the project cite, and which cited paths do not exist?

    python tools/results_index.py            # report; exit 1 if a file is neither cited nor in
                                             # results/README.md, or results/ is over 6 MB
    python tools/results_index.py --uncited  # only the uncited files, one path a line (for git rm)
    python tools/results_index.py --who results/h200/2026-11-28_k6   # who cites these files
    python tools/results_index.py --who docs/kb2.md                   # the files a page cites
    python tools/results_index.py --compress # store results JSON over 4 KB as .json.xz

A results file counts as cited when README.md, docs/**, hopper_attn/**, tests/**, bench.py,
ref_check.py or tools/** name it, in any of these forms:

- its path or its file name (`results/h100/2026-11-26_k6_d64.json`, `2026-11-26_k6_d64.json`,
  `profiles/2026-11-22_ncu_k1.csv.xz`); a file stored compressed (`X.json.xz`) is also cited
  by its uncompressed name (`X.json`): see results/README.md;
- a pattern: `*` and `?` globs and `{a,b}` alternatives (`results/h100/2026-11-26_k6_peel_*.json`,
  `results/h100/profiles/2026-11-26_ncu{,src}_{k6,fa4}_d256.csv.xz`); a dated name without an
  extension (`2026-11-26_k6_exp_first_error`) matches that name with any extension;
- a sibling written after a full path in the same paragraph, as the tail that replaces the
  path's name from one of its underscores on (`results/h100/2026-11-26_k6_stream_k_d128.json
  and _d64.json` cites `2026-11-26_k6_stream_k_d64.json`);
- a repeat of a cited measurement: `X_run2.json` when `X.json` is cited;
- a folder two levels down, written as one (`results/h100/timeline/`): every file in it.

A pattern for any date (`*_bench_*.json`, `*_ref_check*.json`: what report.py reads) cites
every file it matches: the generated tables take each configuration's or case's newest
result, and the older files stay as the record of the claims made from them at the time.

results/README.md (the index) is not a citing source here: a file only it names is reported as
uncited. The test (tests/test_results_index.py) accepts those too: a file is either cited by
the project or listed in the index (by name or pattern), and results/ stays under 6 MB.
Runs in well under a second: it reads only text files, no git.
"""

from __future__ import annotations

import argparse
import lzma
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = "results"
SOURCES = ["README.md", "docs", "hopper_attn", "tests", "bench.py", "ref_check.py", "tools"]
TEXT_EXT = (".md", ".py", ".txt", ".cu", ".toml", ".cfg", ".sh")
INDEX = os.path.join(RESULTS, "README.md")
SIZE_LIMIT = 6_000_000
COMPRESS_OVER = 4096            # bytes: smaller JSON stay plain, readable in place
SELF = {"results_index.py", "test_results_index.py"}
# paths written in usage lines as examples of where output could go, not results files
EXAMPLES = {"results/x.json", "results/mine.json", "results/h100/power.json",
            "results/h100/overhead.json", "results/h100/gqa.json",
            "results/h100/DATE_fp8_error.json", "results/h100/timeline_k4",
            "results/h100/timeline_k4/k4.trace.json.xz"}

# a token that may name a results file: a results/ path, a dated name, a `_tail` with an
# extension, or a name with a results extension
TOKEN = re.compile(r"[\w./*?{},+-]*(?:results/|\d{4}-\d\d-\d\d_|\.json|\.txt|\.csv|\.xz|\.cu\b)"
                   r"[\w./*?{},+-]*")
# a backticked tail without an extension: `_d64_1k_causal`, `_pingpong_1_`
TAIL = re.compile(r"`(_[A-Za-z0-9]\w*(?:[.*{},]+\w*)*\*?)`")
EXT = re.compile(r"\.(json|txt|csv|xz|cu)$")
DATED = re.compile(r"\d{4}-\d\d-\d\d_")


def results_files(root=ROOT) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(os.path.join(root, RESULTS)):
        for n in names:
            out.append(os.path.relpath(os.path.join(dirpath, n), root).replace(os.sep, "/"))
    return sorted(f for f in out if f != INDEX)


def source_files(root=ROOT) -> list[str]:
    out = []
    for s in SOURCES:
        p = os.path.join(root, s)
        if os.path.isfile(p):
            out.append(p)
        for dirpath, dirs, names in os.walk(p):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "img")]
            out += [os.path.join(dirpath, n) for n in names if n.endswith(TEXT_EXT)]
    # this checker and its test write example names, not citations
    return sorted(p for p in out if os.path.basename(p) not in SELF)


def expand(token: str) -> list[str]:
    """`a{b,c}d{,e}` -> abd, abde, acd, acde."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [x for alt in m.group(1).split(",")
            for x in expand(token[:m.start()] + alt + token[m.end():])]


def names_of(path: str) -> list[str]:
    """The names a stored file answers to: itself and, compressed, its uncompressed name."""
    return [path, path[:-3]] if path.endswith(".xz") else [path]


class Citations:
    def __init__(self, files: list[str], generic: bool = True):
        self.files = files
        self.generic = generic      # whether `*_bench_*.json` (any date, any name) cites
        # every name a file answers to, full (results/h100/X.json) and base (X.json)
        self.lines = {full: sorted({n if full else n.rsplit("/", 1)[-1]
                                    for f in files for n in names_of(f)})
                      for full in (True, False)}
        self.owners = {}            # name (full or base) -> the files answering to it
        for f in files:
            for n in names_of(f):
                self.owners.setdefault((True, n), set()).add(f)
                self.owners.setdefault((False, n.rsplit("/", 1)[-1]), set()).add(f)
        self.memo = {}
        self.cited = {}             # file -> first citing source
        self.dangling = []          # (source, token, files it was taken to mean)

    def _match(self, pattern: str, full: bool) -> set[str]:
        if not any(c in pattern for c in "*?[") and not (DATED.search(pattern) and "." not in
                                                            pattern.rsplit("/", 1)[-1]):
            return set(self.owners.get((full, pattern), ()))
        if "." not in pattern.rsplit("/", 1)[-1]:
            pattern += ".*"                        # a dated name without its extension
        if (pattern, full) not in self.memo:
            rx = re.compile("".join(".*" if ch == "*" else "." if ch == "?" else re.escape(ch)
                                    for ch in pattern), re.S)
            literal = max(re.split(r"[*?]", pattern), key=len)     # a cheap first filter
            self.memo[pattern, full] = {f for n in self.lines[full] if literal in n
                                        and rx.fullmatch(n) for f in self.owners[full, n]}
        return set(self.memo[pattern, full])

    def _near(self, pattern: str, full: bool) -> set[str]:
        """A name that matches nothing: the files it abbreviates (`X.json` for `X_d64.json`)."""
        m = EXT.search(pattern)
        if not m or "*" in pattern:
            return set()
        stem = pattern[:m.start()].replace(".trace", "")
        return self._match(stem + "_*" + pattern[len(stem):], full)

    def _siblings(self, anchor: str, tail: str) -> set[str]:
        folder, name = anchor.rsplit("/", 1)
        stem = EXT.sub("", EXT.sub("", name.replace(".trace.json", "")))
        hits = set()
        for i, c in enumerate(stem + "_"):
            if c == "_":
                hits |= self._match(f"{folder}/{stem[:i]}{tail}", full=True)
        return hits

    def scan(self, source: str, text: str):
        # the names a tail (`_d64.json`) may continue, newest first: those of this paragraph,
        # then the last one before it
        anchors = []
        for para in re.split(r"\n\s*\n", text):
            anchors = anchors[:1]
            found = [(m.start(), m.group()) for m in TOKEN.finditer(para)]
            found += [(m.start(), m.group(1)) for m in TAIL.finditer(para)]
            for _, token in sorted(found):
                token = token.strip(",;:)")
                token = token.rstrip(".") if not token.endswith(".*") else token
                if "results/" in token:
                    token = token[token.index("results/"):]
                if re.fullmatch(r"results/[^/*]+/[^/*]+/", token):   # a folder: all of it
                    for f in self._match(token + "*", full=True):
                        self.cited.setdefault(f, source)
                    continue
                bare_tail = token.startswith("_") and not EXT.search(token)
                if bare_tail:       # `_d64_1k_causal`, `_pingpong_1_`, `_k7_items_..._4k.*`
                    self._bare_tail(source, token, anchors)
                    continue
                if not EXT.search(token) and "results/" not in token and not DATED.search(token):
                    continue
                token = token.lstrip(".").replace("...", "*")   # `..._sanitizer_k6.txt`
                for t in expand(token):
                    if not self.generic and t.lstrip("/").startswith("*"):
                        continue
                    if t.startswith("_"):
                        hits = set()
                        for group in anchors:
                            hits = {f for a in group for f in self._siblings(a, t)}
                            if hits:
                                break
                        hits |= self._match(f"????-??-??{t}", full=False)
                        if not hits and EXT.search(t):
                            if t.count("_") >= 3:          # a distinctive tail: any date, any name
                                hits = self._match(f"*{t}", full=False)
                            hits = hits or self._near(f"????-??-??{t}", full=False)
                            self.dangling.append((source, t, sorted(hits)))
                    elif t.startswith("results/"):
                        hits = self._match(t, full=True)
                        folder, name = t.rsplit("/", 1)
                        if not hits and not DATED.match(name):     # cited without its date
                            hits = self._match(f"{folder}/????-??-??_{name}", full=True)
                        if not hits and t.rstrip("/") not in EXAMPLES and (
                                EXT.search(t) or "*" in t):
                            hits = self._near(t, full=True)
                            self.dangling.append((source, t, sorted(hits)))
                    else:
                        hits = self._match(t.rsplit("/", 1)[-1], full=False)
                    for f in hits:
                        self.cited.setdefault(f, source)
                    if hits and not any(ch in t for ch in "*?"):
                        anchors.insert(0, hits)
                    elif t.startswith("results/"):   # a pattern (`X_d*.json`, then `_run2.json`)
                        anchors.insert(0, {t})
                    elif t.startswith("_"):             # a pattern, or a name that is not there
                        anchors.insert(0, {f"*/????-??-??{t}"})

    def _bare_tail(self, source, token, anchors):
        """A tail without an extension: the names it continues, with any extension."""
        hits = set()
        for t in expand(token):
            pats = [t if t.endswith("*") else t + ".*"] + ([t + "*"] if t.endswith("_") else [])
            for p in pats:
                for group in anchors:
                    hits |= {f for a in group for f in self._siblings(a, p)}
                    if hits:
                        break
                hits |= self._match(f"????-??-??{p}", full=False)
                if not hits and t.count("_") >= 3:
                    hits = self._match(f"*{p}", full=False)
        for f in hits:
            self.cited.setdefault(f, source)

    def repeats(self):
        """X_run2.json (X_run3...) counts as cited when X.json is."""
        plain = {n: f for f in self.cited for n in names_of(f)}
        for f in self.files:
            m = re.match(r"(.*)_run\d+(\..*?)(\.xz)?$", f)
            if m and f not in self.cited and m.group(1) + m.group(2) in plain:
                self.cited[f] = self.cited[plain[m.group(1) + m.group(2)]]


def citations(root=ROOT, sources=None, files=None) -> Citations:
    files = results_files(root) if files is None else files
    c = Citations(files)
    for path in (source_files(root) if sources is None else sources):
        with open(path, errors="replace") as f:
            c.scan(os.path.relpath(path, root), f.read())
    c.repeats()
    return c


def index_listed(root=ROOT, files=None) -> set[str]:
    """The files results/README.md names (by name or pattern)."""
    files = results_files(root) if files is None else files
    c = Citations(files, generic=False)     # the index's name patterns (`*_bench_*`) list nothing
    path = os.path.join(root, INDEX)
    if os.path.exists(path):
        with open(path) as f:
            c.scan(INDEX, f.read())
    c.repeats()
    return set(c.cited)


def size(root=ROOT, files=None) -> int:
    files = results_files(root) if files is None else files
    return sum(os.path.getsize(os.path.join(root, f)) for f in files + [INDEX]
               if os.path.exists(os.path.join(root, f)))


def compress(root=ROOT, files=None, over=COMPRESS_OVER) -> list[str]:
    """Store every results JSON larger than `over` bytes as `X.json.xz` (xz -9e), removing
    `X.json`; returns the new files. The readers (hopper_attn/harness/report.py) take
    `X.json` from `X.json.xz`, and the index and the docs keep citing `X.json`."""
    files = results_files(root) if files is None else files
    written = []
    for f in files:
        path = os.path.join(root, f)
        if f.endswith(".json") and os.path.getsize(path) > over:
            with open(path, "rb") as src:
                data = src.read()
            with open(path + ".xz", "wb") as dst:
                dst.write(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
            os.remove(path)
            written.append(f + ".xz")
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--uncited", action="store_true",
                    help="print only the files neither cited nor listed in results/README.md")
    ap.add_argument("--who", nargs="*", metavar="PATH",
                    help="for each results file (all without PATH) the pages and code citing it; "
                         "a PATH under results/ names files, any other PATH a citing page")
    ap.add_argument("--compress", action="store_true",
                    help=f"store results JSON over {COMPRESS_OVER} bytes as .json.xz")
    args = ap.parse_args(argv)
    files = results_files()
    if args.who is not None:
        by = {}
        for src in source_files():
            rel = os.path.relpath(src, ROOT)
            for hit in citations(sources=[src], files=files).cited:
                by.setdefault(hit, []).append(rel)
        pick = [p for p in args.who if p.startswith(RESULTS)]
        pages = [p for p in args.who if not p.startswith(RESULTS)]
        for f in files:
            if (not pick or any(f.startswith(p) for p in pick)) and (
                    not pages or set(pages) & set(by.get(f, []))):
                print(f"{f}\t{' '.join(by.get(f, ['-']))}")
        return 0
    if args.compress:
        for f in compress(files=files):
            print(f"compressed: {f}")
        return 0
    c = citations(files=files)
    uncited = [f for f in files if f not in c.cited]
    listed = index_listed(files=files)
    if args.uncited:
        print("\n".join(f for f in uncited if f not in listed))
        return 0
    total = size(files=files)
    print(f"results/: {len(files)} files, {total / 1e6:.2f} MB (limit {SIZE_LIMIT / 1e6:.2f} MB); "
          f"{len(files) - len(uncited)} cited by the project")
    for f in uncited:
        print(f"uncited{' (listed in results/README.md)' if f in listed else ''}: {f}")
    for source, token, near in sorted({(s, t, tuple(n)) for s, t, n in c.dangling}):
        print(f"missing: {token} (cited in {source})"
              + (f"; counted as citing {', '.join(near)}" if near else ""))
    # a dangling citation is the citing page's to fix; an unlisted file or the size is ours
    return 1 if any(f not in listed for f in uncited) or total > SIZE_LIMIT else 0


if __name__ == "__main__":
    sys.exit(main())
