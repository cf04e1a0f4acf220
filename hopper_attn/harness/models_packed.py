"""The `packed` part of hopper_attn.harness.models: one training step (forward, loss,
backward) on ONE row of packed documents, the model of the `train` part.

The row: document lengths drawn lognormal (median 1k, capped at 16k; seed = tokens / 1024,
the mixes of tools/varlen_*_gpu_check.py) filling N tokens, position ids restarting at each
document, labels -100 on each document's first token (as `DataCollatorWithFlattening` makes
them: no document predicts the next one's first token). Forms, timed in the same rounds:

- "hopper_attn": this project, the collator's `cu_seq_lens_q/k` + `max_length_q/k` keyword
  arguments (and its position ids);
- "hopper_attn_posids": this project, position ids alone (the mask function finds the
  documents);
- "fa4": transformers' `flash_attention_4` (its varlen path, `flash_attn.cute
  .flash_attn_varlen_func`, taken when the call has the collator's kwargs), or FA4's
  functions through this project's mapping where that does not load; the kwargs route;
- "sdpa_per_doc": SDPA, each document its own forward and backward (batch 1, no mask; the
  gradients accumulate): the same tokens and the same attention work, in small GEMMs;
- "sdpa_padded": SDPA, the documents as a batch padded to the longest (a 2-D padding mask;
  labels -100 on the padding): what training without packing runs;
- "sdpa_doc_mask": SDPA on the packed row itself, position ids alone: transformers builds a
  dense block-causal (N x N) mask, and SDPA computes every masked block.

Every form's loss is the mean over the same N - documents predictions. Tokens/s counts the
N real tokens. The baselines are the two SDPA forms without a packed mask (per document and
padded); `vs_baseline` is the faster one's time / this form's. The per-document one is the
like-for-like baseline (same tokens, same attention FLOPs, nothing wasted); the padded one is
what a loop that does not pack runs.

Before timing, a guard on a small config (2 layers, hidden 1024, 8/2 heads of 128): the loss,
the logits and layer 0's q_proj gradient of each form in bf16 against per-document SDPA in
fp32, each within 3x (+ 2e-3, relative to the largest value) of bf16 per-document SDPA's
own error.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time

import torch

FORMS = ("hopper_attn", "hopper_attn_posids", "fa4", "sdpa_per_doc", "sdpa_padded",
         "sdpa_doc_mask")
BASELINES = ("sdpa_per_doc", "sdpa_padded")
GUARD = dict(layers=2, hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=2048,
             vocab=1024)


def document_lengths(total: int, seed: int, median: int = 1024, cap: int = 16384) -> list:
    """Lognormal document lengths filling `total` tokens (harness.varlen_reference); a last
    document of one token (it predicts nothing) is merged into the one before."""
    from hopper_attn.harness.varlen_reference import lognormal_lengths
    lengths = lognormal_lengths(total, seed, median=median, cap=cap)
    if len(lengths) > 1 and lengths[-1] < 2:
        lengths[-2] += lengths.pop()
    return lengths


@dataclasses.dataclass
class PackedRow:
    """One row of packed documents: (1, N) input ids, position ids restarting per
    document, labels (-100 on each document's first token), int32 cu_seqlens [0, l0,
    l0 + l1, ..., N] and the longest document."""
    lengths: list
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    max_length: int

    def flash_kwargs(self) -> dict:
        """The flattening collator's keyword arguments (return_flash_attn_kwargs=True)."""
        return dict(cu_seq_lens_q=self.cu_seqlens, cu_seq_lens_k=self.cu_seqlens,
                    max_length_q=self.max_length, max_length_k=self.max_length)

    def documents(self):
        """(start, end) of each document."""
        bounds = [0]
        for n in self.lengths:
            bounds.append(bounds[-1] + n)
        return list(zip(bounds[:-1], bounds[1:]))

    def predictions(self) -> int:
        return sum(self.lengths) - len(self.lengths)


def packed_row(lengths, vocab: int, device="cpu", seed: int = 0) -> PackedRow:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    ids = torch.randint(0, vocab, (1, total), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    labels = ids.clone()
    labels[0, cu[:-1].long()] = -100
    return PackedRow(list(lengths), ids.to(device), pos.to(device), labels.to(device),
                     cu.to(device), max(lengths))


def padded_batch(row: PackedRow) -> tuple:
    """The row's documents as a (documents, longest) batch, right-padded: input ids (0 on
    the padding), the 2-D attention mask, labels (-100 on the padding and first tokens)."""
    docs, longest = len(row.lengths), row.max_length
    device = row.input_ids.device
    ids = torch.zeros(docs, longest, dtype=row.input_ids.dtype, device=device)
    mask = torch.zeros(docs, longest, dtype=torch.long, device=device)
    labels = torch.full((docs, longest), -100, dtype=row.labels.dtype, device=device)
    for b, (start, end) in enumerate(row.documents()):
        ids[b, :end - start] = row.input_ids[0, start:end]
        mask[b, :end - start] = 1
        labels[b, :end - start] = row.labels[0, start:end]
    return ids, mask, labels


def run_form(model, form: str, row: PackedRow, padded=None, keep_logits: bool = False):
    """One forward + backward of `model` (its attention already selected) on `row` in the
    way `form` runs it; returns (loss, logits (N, vocab) in the row's token order or None)."""
    logits = None
    if form == "sdpa_per_doc":
        total, parts = 0.0, []
        for start, end in row.documents():
            ids = row.input_ids[:, start:end]
            out = model(input_ids=ids, labels=ids, use_cache=False)
            weight = (end - start - 1) / row.predictions()
            (out.loss * weight).backward()
            total = total + out.loss.detach().float() * weight
            if keep_logits:
                parts.append(out.logits[0].detach())
        return total, (torch.cat(parts) if keep_logits else None)
    if form == "sdpa_padded":
        ids, mask, labels = padded if padded is not None else padded_batch(row)
        out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
        if keep_logits:
            logits = torch.cat([out.logits[b, :n].detach() for b, n in enumerate(row.lengths)])
        return out.loss.detach().float(), logits
    kwargs = row.flash_kwargs() if form in ("hopper_attn", "fa4") else {}
    out = model(input_ids=row.input_ids, position_ids=row.position_ids, labels=row.labels,
                use_cache=False, **kwargs)
    out.loss.backward()
    return out.loss.detach().float(), (out.logits[0].detach() if keep_logits else None)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


def guard(build_model, impls: dict, select, lengths, vocab: int, device) -> list:
    """The correctness guard: rows of (form, loss, errors against fp32 per-document SDPA,
    the bf16 per-document SDPA's errors, ok)."""
    model = build_model().float().train()
    row = packed_row(lengths, vocab, device, seed=1)
    probe = "model.layers.0.self_attn.q_proj.weight"

    def measure(m, form, impl):
        select(m, form, impl)
        m.zero_grad(set_to_none=True)
        loss, logits = run_form(m, form, row, keep_logits=True)
        grad = dict(m.named_parameters())[probe].grad.detach().clone()
        m.zero_grad(set_to_none=True)
        return {"loss": loss.reshape(1), "logits": logits, "grad_q_proj_0": grad}

    truth = measure(model, "sdpa_per_doc", "sdpa")
    model = model.to(torch.bfloat16)
    results = {}
    for form, impl in impls.items():
        try:
            results[form] = measure(model, form, impl)
        except Exception as exc:  # noqa: BLE001 - recorded, the others go on
            results[form] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    base = results.get("sdpa_per_doc")
    rows = []
    for form, got in results.items():
        row_out = {"part": "packed_guard", "impl": form, "lengths": lengths,
                   "config": "guard"}
        if isinstance(got, str):
            row_out["error"] = got
        else:
            errors = {what: _relative_error(got[what], truth[what]) for what in truth}
            limits = {what: 3 * _relative_error(base[what], truth[what]) + 2e-3
                      for what in truth} if isinstance(base, dict) else {}
            row_out.update(loss=float(got["loss"]), loss_fp32=float(truth["loss"]),
                           errors=errors, limits=limits,
                           ok=bool(limits) and all(errors[w] <= limits[w] for w in errors))
        rows.append(row_out)
    del model
    return rows


def _timer(device):
    """The training benchmark's CUDA-event timer (ms) on a GPU; wall clock on the CPU."""
    if torch.device(device).type == "cuda":
        from hopper_attn.harness.models import _timed
        return _timed

    def timed_cpu(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return timed_cpu


def bench_packed(model, impls: dict, select, totals, rounds: int, vocab: int, device,
                 median: int = 1024, cap: int = 16384) -> list:
    """Rows of the packed part: each form's median step time over `rounds` rounds (forms
    shuffled each round) per total N, tokens/s, the ratio to the faster baseline."""
    from hopper_attn.harness.models import warm_and_time
    timed = _timer(device)
    model.train()
    rows = []
    for total in totals:
        seed = max(1, total // 1024)
        lengths = document_lengths(total, seed, median=median, cap=cap)
        row = packed_row(lengths, vocab, device, seed=seed)
        padded = padded_batch(row) if "sdpa_padded" in impls else None

        def step(form):
            loss, _ = run_form(model, form, row, padded)
            model.zero_grad(set_to_none=True)
            return loss

        losses, errors, times = warm_and_time(model, impls, select, step, rounds, total,
                                              timed)
        live = [form for form in impls if form not in errors]
        medians = {form: statistics.median(times[form]) for form in live}
        baseline = min((f for f in BASELINES if f in medians), key=medians.get, default=None)
        for form in impls:
            out = {"part": "packed", "impl": form, "tokens": total, "documents": len(lengths),
                   "max_length": row.max_length, "seed": seed, "lengths": lengths}
            if form == "sdpa_padded":
                out["padded_tokens"] = len(lengths) * row.max_length
            if form in errors:
                out["error"] = errors[form]
            else:
                ms = medians[form]
                out.update(ms=ms, min_ms=min(times[form]), max_ms=max(times[form]),
                           rounds=rounds, tokens_per_s=total / (ms * 1e-3),
                           loss=losses[form], baseline=baseline,
                           vs_baseline=None if baseline is None else medians[baseline] / ms)
            rows.append(out)
        del row, padded
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    model.eval()
    return rows


def stand_in_backends():
    """An exact fp32 attention for the CPU dry run (`--cpu-stand-in`): (backend,
    varlen_backend) for hopper_attn.integrations.transformers.make_attention_forward."""
    import torch.nn.functional as F

    def dense(q, k, v, causal, softmax_scale, **features):
        # (batch, seqlen, heads, d), GQA by repeating k, v; bottom-right causal
        group = q.shape[2] // k.shape[2]
        qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))
        kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
        mask = None
        if causal:
            nq, nk = q.shape[1], k.shape[1]
            mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=softmax_scale)
        return out.transpose(1, 2).to(q.dtype)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, **features):
        cq, ck = cu_q.tolist(), cu_k.tolist()
        outs = [dense(q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]],
                      v[None, ck[i]:ck[i + 1]], causal, softmax_scale)[0]
                for i in range(len(cq) - 1)]
        return torch.cat(outs)
    return dense, varlen


def print_rows(rows) -> None:
    for r in rows:
        head = f"{r['part']:<13} {r['impl']:<19}"
        if "error" in r:
            print(f"{head} ERROR {r['error']}")
        elif r["part"] == "packed_guard":
            worst = max(r["errors"], key=lambda w: r["errors"][w] / max(r["limits"].get(w, 1),
                                                                        1e-12))
            print(f"{head} {'ok  ' if r['ok'] else 'FAIL'} loss {r['loss']:.4f} (fp32 "
                  f"{r['loss_fp32']:.4f}); worst {worst} {r['errors'][worst]:.2e} "
                  f"<= {r['limits'].get(worst, float('nan')):.2e}")
        else:
            ratio = r["vs_baseline"]
            print(f"{head} N {r['tokens']:>6} ({r['documents']} docs) {r['ms']:8.1f} ms/step "
                  f"{r['tokens_per_s']:9.0f} tok/s  x{'-' if ratio is None else f'{ratio:.3f}'}"
                  f" vs {r['baseline']}  loss {r['loss']:.4f}")
