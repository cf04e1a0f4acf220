"""A Llama-shaped transformers model with random weights, timed with each attention
implementation in one run: torch SDPA, FlashAttention-4 (where installed) and this project.

    python -m hopper_attn.harness.models                    # train + generate + probe
    python -m hopper_attn.harness.models --quick            # small version (about a minute)
    python -m hopper_attn.harness.models --only train --seqlens 8192 --layers 4
    python -m hopper_attn.harness.models --out results/h200/models.json
    python -m hopper_attn.harness.models --only packed      # packed documents (about 2 min)

Needs transformers (`pip install .[models]`); nothing is downloaded: the model is
`LlamaForCausalLM(LlamaConfig(...))`, random bf16 weights on the GPU, built once and
switched between implementations with `model.set_attn_implementation` (same weights for
all). Default shape: 8 layers, hidden 2048, 16 query / 4 KV heads of 128, MLP 5632, vocab
32000.

Parts (`--only`, comma-separated):
- train: one training step (forward, loss, backward; batch 1, each of `--seqlens`),
  implementations interleaved round by round in a shuffled order, median of the rounds.
- generate: a `--prompt` token prompt, then `--new-tokens` greedy steps with the default
  KV cache (DynamicCache); prefill time, decode tokens/s, and whether the tokens match
  SDPA's (random weights: an early tie can make greedy paths part, the first step that
  differs is recorded); timed round-robin like train (host-bound: the host's drift stays out
  of the ratios).
- probe: the model's own attention calls alone: the training shape (GQA forward + backward,
  causal) and decode shapes (one query over a cache; TB/s = bytes of K and V read once /
  time), with the L2 cache flushed before each call.
- packed: one training step on one row of packed documents (lognormal lengths, median 1k,
  filling each of `--packed-tokens`), this project through the collator's kwargs and through
  position ids, FA4's varlen path, and SDPA per document and as a padded batch (the
  baselines) and with transformers' dense document mask; a loss/logits/gradient guard on a
  small config first (harness/models_packed.py). `--cpu-stand-in` runs it on the CPU, tiny,
  with an exact stand-in for this project's attention: the harness's plumbing only.

Implementations: "sdpa" (transformers' SDPA, torch's default backend choice), "fa4"
(transformers' own "flash_attention_4" when it finds flash-attn-4, else FA4's
`flash_attn_func` registered under "fa4" through the same AttentionInterface mapping as
this project), "hopper_attn" (hopper_attn.integrations.transformers), "sdpa_provider"
(transformers' sdpa again, with SDPA's flash backend selected and
hopper_attn.integrations.sdpa active: this project under SDPA; the JSON counts the calls it
ran and those that fell back). The JSON (`--out`, default $OUT/models.json when $OUT is set)
has the GPU, driver, torch, transformers, CuTe DSL and FA4 versions and the date.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

DEFAULT = dict(layers=8, hidden=2048, heads=16, kv_heads=4, head_dim=128, intermediate=5632,
               vocab=32000)


def _versions() -> dict:
    from hopper_attn.harness.env import _dist_version, environment
    info = environment()
    info["transformers"] = _dist_version("transformers")
    info["accelerate"] = _dist_version("accelerate")
    return info


def build_model(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                intermediate: int, vocab: int, seqlen: int, device="cuda"):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                         max_position_embeddings=max(seqlen, 4096), attention_dropout=0.0,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = None     # random weights: never stop early
    model.generation_config.pad_token_id = 0
    return model


def implementations(model, wanted) -> tuple:
    """name -> attn_implementation to set, and notes (what FA4 path, what is missing)."""
    import hopper_attn.integrations.transformers as hopper_tf
    impls, notes = {}, {}
    if "sdpa" in wanted:
        impls["sdpa"] = "sdpa"
    if "fa4" in wanted:
        try:
            from flash_attn.cute.interface import flash_attn_func, flash_attn_varlen_func
            try:
                model.set_attn_implementation("flash_attention_4")
                with torch.no_grad():                # a call, not just the setting
                    model(torch.zeros(1, 256, dtype=torch.long, device="cuda"))
                impls["fa4"] = "flash_attention_4"
                notes["fa4"] = "transformers attn_implementation='flash_attention_4'"
            except Exception as exc:  # noqa: BLE001 - transformers did not take it: ours

                def fa4(q, k, v, causal, softmax_scale, window_size=(-1, -1), softcap=0.0):
                    window = tuple(None if side < 0 else side for side in window_size)
                    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                           window_size=window, softcap=softcap)

                def fa4_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale,
                               window_size=(-1, -1), softcap=0.0):
                    window = tuple(None if side < 0 else side for side in window_size)
                    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                 max_seqlen_q=max_q, max_seqlen_k=max_k,
                                                 softmax_scale=softmax_scale, causal=causal,
                                                 window_size=window, softcap=softcap)
                    return out[0] if isinstance(out, tuple) else out
                impls["fa4"] = hopper_tf.register("fa4", backend=fa4, varlen_backend=fa4_varlen)
                notes["fa4"] = (f"flash_attn.cute.flash_attn_func registered as 'fa4' "
                                f"(flash_attention_4: {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0][:100] if str(exc) else ''})")
        except Exception as exc:  # noqa: BLE001 - no FA4 here
            notes["fa4"] = f"unavailable: {type(exc).__name__}: {str(exc)[:100]}"
    if "hopper_attn" in wanted:
        impls["hopper_attn"] = hopper_tf.register()
    if "sdpa_provider" in wanted:
        from hopper_attn.integrations import sdpa as hopper_sdpa
        if hopper_sdpa.available():
            impls["sdpa_provider"] = "sdpa"
            notes["sdpa_provider"] = ("transformers' sdpa, SDPA's flash backend selected, "
                                      "hopper_attn.integrations.sdpa active")
        else:
            notes["sdpa_provider"] = "unavailable: no register_flash_attention_impl in torch"
    model.set_attn_implementation("sdpa")
    return impls, notes


def select(model, name: str, impl: str) -> None:
    """Switch `model` to implementation `name` (outside any timing): the attention function,
    and the SDPA provider on for "sdpa_provider" only."""
    model.set_attn_implementation(impl)
    _provider_for(name)


def backend_context(name: str):
    """SDPA's flash backend for "sdpa_provider" (torch 2.11 prefers cuDNN on Hopper)."""
    import contextlib
    if name != "sdpa_provider":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def deselect_provider() -> None:
    from hopper_attn.integrations import sdpa as hopper_sdpa
    if hopper_sdpa.is_active():
        hopper_sdpa.deactivate()


def _timed(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def warm_and_time(model, impls: dict, select, step, rounds: int, seed: int, timed) -> tuple:
    """Each implementation selected and its `step(name)` (returning the loss) run twice
    (compiles, autotuning, allocator; a failure is recorded and the others go on), then
    every live one timed by `timed` in `rounds` shuffled rounds. Returns (losses, errors,
    times: name -> ms per round)."""
    from hopper_attn.harness.timing import round_orders
    times = {name: [] for name in impls}
    errors, losses = {}, {}
    for name, impl in impls.items():
        select(model, name, impl)
        try:
            for _ in range(2):
                losses[name] = float(torch.as_tensor(step(name)).detach())
        except Exception as exc:  # noqa: BLE001 - record and go on with the others
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            model.zero_grad(set_to_none=True)
    live = [name for name in impls if name not in errors]
    for order in round_orders(live, rounds, seed=seed):
        for name in order:
            select(model, name, impls[name])
            times[name].append(timed(lambda name=name: step(name)))
    return losses, errors, times


def bench_train(model, impls: dict, seqlens, rounds: int, vocab: int) -> list:
    model.train()
    rows = []
    for n in seqlens:
        ids = torch.randint(0, vocab, (1, n), device="cuda")

        def step(name):
            with backend_context(name):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
            model.zero_grad(set_to_none=True)
            return loss

        losses, errors, times = warm_and_time(model, impls, select, step, rounds, n, _timed)
        for name in impls:
            row = {"part": "train", "impl": name, "seqlen": n, "batch": 1}
            if name in errors:
                row["error"] = errors[name]
            else:
                ms = statistics.median(times[name])
                row.update(ms=ms, min_ms=min(times[name]), max_ms=max(times[name]),
                           rounds=rounds, tokens_per_s=n / (ms * 1e-3), loss=losses[name])
            rows.append(row)
        del ids
        torch.cuda.empty_cache()
    deselect_provider()
    model.eval()
    return rows


def bench_generate(model, impls: dict, prompt: int, new_tokens: int, rounds: int,
                   vocab: int) -> list:
    """Greedy generation per implementation: warmed up one after another, then timed in
    `rounds` shuffled rounds (a prefill of one new token, then the whole generation, per
    implementation and round), medians. Generation at this size is host-bound, and the
    host's speed drifts over a run: round-robin keeps that drift out of the ratios."""
    from hopper_attn.harness.timing import round_orders
    model.eval()
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, vocab, (1, prompt), device="cuda", generator=gen)
    kwargs = dict(do_sample=False, use_cache=True, attention_mask=torch.ones_like(ids))

    def run(name, tokens):
        with torch.no_grad(), backend_context(name):
            return model.generate(ids, max_new_tokens=tokens, **kwargs)

    errors, tokens = {}, {}
    for name, impl in impls.items():
        select(model, name, impl)
        try:
            tokens[name] = run(name, new_tokens)[0, prompt:].tolist()  # every length, once
            run(name, 1)
        except Exception as exc:  # noqa: BLE001
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    live = [name for name in impls if name not in errors]
    prefill, total = {name: [] for name in live}, {name: [] for name in live}
    for order in round_orders(live, rounds, seed=prompt):
        for name in order:
            select(model, name, impls[name])
            prefill[name].append(_wall(lambda name=name: run(name, 1)))
            total[name].append(_wall(lambda name=name: run(name, new_tokens)))
    rows, reference = [], None
    for name in impls:
        row = {"part": "generate", "impl": name, "prompt": prompt, "new_tokens": new_tokens}
        if name in errors:
            row["error"] = errors[name]
            rows.append(row)
            continue
        new = tokens[name]
        if reference is None:
            reference = new
        first_diff = next((i for i, (a, b) in enumerate(zip(new, reference)) if a != b), None)
        p, t = statistics.median(prefill[name]), statistics.median(total[name])
        per_round = [(new_tokens - 1) / (b - a) for a, b in zip(prefill[name], total[name])
                     if b > a]
        row.update(prefill_ms=p * 1e3, total_ms=t * 1e3,
                   decode_tokens_per_s=(new_tokens - 1) / (t - p) if t > p else None,
                   decode_tokens_per_s_rounds=per_round, rounds=rounds,
                   tokens_as_first_impl=first_diff is None, first_differing_step=first_diff)
        rows.append(row)
    deselect_provider()
    return rows


def _wall(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _attention_ops(names) -> dict:
    """name -> fn(q, k, v, causal) on (batch, seqlen, heads, head_dim) tensors, GQA."""
    import torch.nn.functional as F

    import hopper_attn
    ops = {}

    def sdpa(q, k, v, c):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=c,
                                              enable_gqa=True).transpose(1, 2)
    if "sdpa" in names:
        ops["sdpa"] = sdpa
    if "fa4" in names:
        try:
            from hopper_attn.harness.baselines import fa4
            ops["fa4"] = fa4()
        except Exception:  # noqa: BLE001
            pass
    if "hopper_attn" in names:
        ops["hopper_attn"] = lambda q, k, v, c: hopper_attn.attention(q, k, v, causal=c)
    if "sdpa_provider" in names:
        from hopper_attn.integrations import sdpa as hopper_sdpa
        if hopper_sdpa.available():
            def provider(q, k, v, c):
                with backend_context("sdpa_provider"):
                    return sdpa(q, k, v, c)
            ops["sdpa_provider"] = provider
    return ops


def bench_probe(names, heads: int, kv_heads: int, head_dim: int, seqlens, decode_shapes
                ) -> list:
    from hopper_attn.harness.timing import L2Flush, benchmark, tflops
    ops, flush, rows = _attention_ops(names), L2Flush(), []
    dt = torch.bfloat16
    for n in seqlens:                          # training: GQA forward + backward, causal
        q = torch.randn(1, n, heads, head_dim, device="cuda", dtype=dt, requires_grad=True)
        k = torch.randn(1, n, kv_heads, head_dim, device="cuda", dtype=dt, requires_grad=True)
        v = torch.randn(1, n, kv_heads, head_dim, device="cuda", dtype=dt, requires_grad=True)
        do = torch.randn(1, n, heads, head_dim, device="cuda", dtype=dt)
        flops = 3.5 * 2 * heads * n * n * head_dim       # causal: forward 2 GEMMs / 2, bwd 2.5x
        for name, op in ops.items():
            _provider_for(name)

            def step(op=op):
                op(q, k, v, True).backward(do)
                q.grad = k.grad = v.grad = None
            row = {"part": "probe_train", "impl": name, "batch": 1, "seqlen": n, "heads": heads,
                   "kv_heads": kv_heads, "head_dim": head_dim, "causal": True}
            try:
                r = benchmark(step, flush, target_ms=300)
                row.update(ms=r["ms"], reps=r["reps"], tflops=tflops(flops, r["ms"]))
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            rows.append(row)
        del q, k, v, do
    for batch, cache in decode_shapes:         # decode: one query over the cache
        q = torch.randn(batch, 1, heads, head_dim, device="cuda", dtype=dt)
        k = torch.randn(batch, cache, kv_heads, head_dim, device="cuda", dtype=dt)
        v = torch.randn_like(k)
        kv_bytes = 2 * k.numel() * k.element_size()
        for name, op in ops.items():
            _provider_for(name)
            row = {"part": "probe_decode", "impl": name, "batch": batch, "seqlen_q": 1,
                   "seqlen_k": cache, "heads": heads, "kv_heads": kv_heads,
                   "head_dim": head_dim}
            try:
                r = benchmark(lambda op=op: op(q, k, v, False), flush, target_ms=200)
                row.update(us=r["ms"] * 1e3, reps=r["reps"],
                           kv_tb_per_s=kv_bytes / (r["ms"] * 1e-3) / 1e12)
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            rows.append(row)
        del q, k, v
    deselect_provider()
    return rows


def _provider_for(name: str) -> None:
    from hopper_attn.integrations import sdpa as hopper_sdpa
    if name == "sdpa_provider":
        if not hopper_sdpa.is_active():
            hopper_sdpa.activate()
    else:
        deselect_provider()


def _print_rows(rows) -> None:
    for r in rows:
        head = f"{r['part']:<13} {r['impl']:<13}"
        if "error" in r:
            print(f"{head} ERROR {r['error']}")
        elif r["part"] == "train":
            print(f"{head} N {r['seqlen']:>6}  {r['ms']:8.1f} ms/step  "
                  f"{r['tokens_per_s']:9.0f} tok/s  loss {r['loss']:.4f}")
        elif r["part"] == "generate":
            same = "same tokens" if r["tokens_as_first_impl"] else \
                f"tokens differ from step {r['first_differing_step']}"
            rate = r["decode_tokens_per_s"]
            print(f"{head} prompt {r['prompt']} + {r['new_tokens']}: prefill "
                  f"{r['prefill_ms']:7.1f} ms, decode "
                  f"{'-' if rate is None else f'{rate:6.1f}'} tok/s ({same})")
        elif r["part"] == "probe_train":
            print(f"{head} fwd+bwd N {r['seqlen']:>6} {r['heads']}/{r['kv_heads']} heads  "
                  f"{r['ms']:8.3f} ms  {r['tflops']:5.0f} TFLOP/s")
        else:
            print(f"{head} decode B {r['batch']:>2} x {r['seqlen_k']:>6} keys  "
                  f"{r['us']:8.1f} us  {r['kv_tb_per_s']:5.2f} TB/s")


def packed_forms(model, wanted, stand_in: bool) -> tuple:
    """The packed part's forms -> attn_implementation, and notes: implementations() for
    SDPA, FA4 and this project (or the CPU stand-in registered as "hopper_attn")."""
    import hopper_attn.integrations.transformers as hopper_tf
    from hopper_attn.harness import models_packed
    if stand_in:
        dense, varlen = models_packed.stand_in_backends()
        impls = {"hopper_attn": hopper_tf.register(backend=dense, varlen_backend=varlen)}
        notes = {"fa4": "not run (--cpu-stand-in)",
                 "hopper_attn": "CPU stand-in: exact fp32 attention, not this project's"}
        if "sdpa" in wanted:
            impls["sdpa"] = "sdpa"
    else:
        impls, notes = implementations(model, [w for w in wanted if w != "sdpa_provider"])
    forms = {}
    for form in models_packed.FORMS:
        source = "sdpa" if form.startswith("sdpa") else form.replace("_posids", "")
        if source in impls:
            forms[form] = impls[source]
    return forms, notes


def run_packed(args, shape: dict, wanted, totals, rounds: int, stand_in: bool) -> list:
    from hopper_attn.harness import models_packed as mp
    device = "cpu" if stand_in else "cuda"
    rows = []
    model = build_model(**shape, seqlen=max(totals), device=device)
    forms, notes = packed_forms(model, wanted, stand_in)
    for name, note in notes.items():
        print(f"  {name}: {note}")
    rows.append({"part": "packed_setup", "forms": forms, "notes": notes})
    if not args.no_guard:
        guard_shape = dict(shape if stand_in else mp.GUARD)
        guard_tokens, guard_median = (256, 32) if stand_in else (2048, 256)
        lengths = mp.document_lengths(guard_tokens, 2, median=guard_median, cap=guard_tokens)
        guard_rows = mp.guard(lambda: build_model(**guard_shape, seqlen=guard_tokens,
                                                  device=device),
                              forms, select, lengths, guard_shape["vocab"], device)
        mp.print_rows(guard_rows)
        rows += guard_rows
    packed_rows = mp.bench_packed(model, forms, select, totals, rounds, shape["vocab"], device,
                                  median=args.doc_median, cap=args.doc_cap)
    mp.print_rows(packed_rows)
    rows += packed_rows
    del model
    if not stand_in:
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="train,generate,probe",
                        help="comma-separated parts: train, generate, probe, packed")
    parser.add_argument("--impls", default="sdpa,fa4,hopper_attn,sdpa_provider",
                        help="sdpa, fa4, hopper_attn (transformers' attention interface), "
                             "sdpa_provider (transformers' sdpa, SDPA's flash backend, "
                             "hopper_attn.integrations.sdpa active)")
    parser.add_argument("--layers", type=int, default=DEFAULT["layers"])
    parser.add_argument("--hidden", type=int, default=DEFAULT["hidden"])
    parser.add_argument("--heads", type=int, default=DEFAULT["heads"])
    parser.add_argument("--kv-heads", type=int, default=DEFAULT["kv_heads"])
    parser.add_argument("--head-dim", type=int, default=DEFAULT["head_dim"])
    parser.add_argument("--intermediate", type=int, default=DEFAULT["intermediate"])
    parser.add_argument("--vocab", type=int, default=DEFAULT["vocab"])
    parser.add_argument("--seqlens", default=None, help="training lengths (default 8192,16384)")
    parser.add_argument("--rounds", type=int, default=None, help="training rounds (default 5)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 2048)")
    parser.add_argument("--new-tokens", type=int, default=None, help="greedy steps (default 256)")
    parser.add_argument("--decode-shapes", default=None,
                        help="probe decode shapes BATCHxKEYS,... (default 1x2304,1x32768,"
                             "1x131072,16x4096)")
    parser.add_argument("--packed-tokens", default=None,
                        help="packed part: tokens in the row (default 8192,16384)")
    parser.add_argument("--doc-median", type=int, default=1024,
                        help="packed part: median document length (lognormal, sigma 1)")
    parser.add_argument("--doc-cap", type=int, default=16384,
                        help="packed part: longest document")
    parser.add_argument("--no-guard", action="store_true",
                        help="packed part: skip the small-config correctness guard")
    parser.add_argument("--cpu-stand-in", action="store_true",
                        help="packed part on the CPU: a tiny model, an exact fp32 stand-in "
                             "for hopper_attn, no FA4 (checks the harness, times nothing)")
    parser.add_argument("--quick", action="store_true",
                        help="N 4096, 3 rounds, prompt 512 + 32 steps, two decode shapes")
    parser.add_argument("--out", default=None, help="JSON path (default $OUT/models.json)")
    args = parser.parse_args(argv)

    try:
        from transformers.utils import logging as transformers_logging
        transformers_logging.set_verbosity_error()     # the timings, not generate()'s notes
    except ImportError:
        print("hopper_attn.harness.models needs transformers: pip install '.[models]'")
        return 2
    stand_in = args.cpu_stand_in
    if not torch.cuda.is_available() and not stand_in:
        print("hopper_attn.harness.models needs a CUDA GPU (or --only packed --cpu-stand-in)")
        return 2
    quick = args.quick
    seqlens = [int(s) for s in (args.seqlens or ("4096" if quick else "8192,16384")).split(",")]
    rounds = args.rounds or (3 if quick else 5)
    prompt = args.prompt or (512 if quick else 2048)
    new_tokens = args.new_tokens or (32 if quick else 256)
    shapes = args.decode_shapes or ("1x2304,1x32768" if quick else
                                    "1x2304,1x32768,1x131072,16x4096")
    decode_shapes = [tuple(int(x) for x in s.split("x")) for s in shapes.split(",")]
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = set(parts) - {"train", "generate", "probe", "packed"}
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)} (train, generate, probe, packed)")
    if stand_in and parts != ["packed"]:
        parser.error("--cpu-stand-in runs --only packed")
    packed_tokens = [int(s) for s in (args.packed_tokens or
                                      ("4096" if quick else "8192,16384")).split(",")]
    wanted = [s.strip() for s in args.impls.split(",") if s.strip()]

    shape = dict(layers=args.layers, hidden=args.hidden, heads=args.heads,
                 kv_heads=args.kv_heads, head_dim=args.head_dim,
                 intermediate=args.intermediate, vocab=args.vocab)
    if stand_in:
        shape = dict(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256,
                     vocab=128)
        packed_tokens = [512]
        args.doc_median, args.doc_cap = 64, 512
    result = {"env": _versions(), "model": {"kind": "LlamaForCausalLM, random weights, bf16",
                                             **shape},
              "settings": {"parts": parts, "seqlens": seqlens, "rounds": rounds,
                           "prompt": prompt, "new_tokens": new_tokens,
                           "decode_shapes": decode_shapes, "quick": quick,
                           "packed": {"tokens": packed_tokens, "doc_median": args.doc_median,
                                      "doc_cap": args.doc_cap, "lognormal_sigma": 1.0,
                                      "seed": "tokens // 1024", "stand_in": stand_in}},
              "rows": []}
    env = result["env"]
    if stand_in:
        env["gpu"] = env.get("gpu") or "none (--cpu-stand-in)"
    print(f"models: {env.get('gpu')} driver {env.get('driver')} torch {env['torch']} "
          f"transformers {env['transformers']} cutlass-dsl {env['cutlass_dsl']} "
          f"fa4 {env['flash_attn_4']}")
    t_start = time.perf_counter()
    impls, notes = {}, {}
    if "train" in parts or "generate" in parts:
        model = build_model(**shape, seqlen=max(seqlens + [prompt + new_tokens]))
        impls, notes = implementations(model, wanted)
        result["implementations"] = {name: {"attn_implementation": impl,
                                            "note": notes.get(name)}
                                     for name, impl in impls.items()}
        for name, note in notes.items():
            if name not in impls:
                print(f"  {name}: {note}")
        if "train" in parts:
            rows = bench_train(model, impls, seqlens, rounds, args.vocab)
            _print_rows(rows)
            result["rows"] += rows
        if "generate" in parts:
            rows = bench_generate(model, impls, prompt, new_tokens, rounds, vocab=args.vocab)
            _print_rows(rows)
            result["rows"] += rows
        del model
        torch.cuda.empty_cache()
    if "packed" in parts:
        result["rows"] += run_packed(args, shape, wanted, packed_tokens, rounds, stand_in)
    if "probe" in parts:
        rows = bench_probe(wanted, args.heads, args.kv_heads, args.head_dim, seqlens,
                           decode_shapes)
        _print_rows(rows)
        result["rows"] += rows
    if "sdpa_provider" in wanted and set(parts) - {"packed"}:
        from hopper_attn.integrations import sdpa as hopper_sdpa
        result["sdpa_provider_counts"] = hopper_sdpa.counts()   # ran here / fell back
        counts = result["sdpa_provider_counts"]
        print(f"sdpa_provider: {counts.get('forward', 0)} forward and "
              f"{counts.get('backward', 0)} backward calls ran hopper_attn, "
              f"{counts.get('forward_fallback', 0)} + {counts.get('backward_fallback', 0)} "
              "fell back to torch's flash kernel")
    result["seconds"] = round(time.perf_counter() - t_start, 1)

    out = args.out or (os.path.join(os.environ["OUT"], "models.json")
                       if os.environ.get("OUT") else None)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"models: {result['seconds']} s, JSON in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
