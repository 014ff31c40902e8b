"""Where we stand against what a CPU practitioner would use: HF greedy ``generate``, HF prompt-lookup
decoding and llama.cpp (the ``llama-cpp-python`` bindings) on the same prompts, tokens/s ratios
measured in one run, methods interleaved per prompt, one warm-up prompt excluded.

llama.cpp runs the very GGUF the embedded model ships in (SmolLM2: Q4_1, Gemma-3: Q4_K_M; wavesurf
dequantizes it to float32 for its own target) and a float32 GGUF made from that same file by
dequantizing every tensor with the ``gguf`` package (cached under ``~/.cache/wavesurf/anchors``),
each plain (greedy) and with llama.cpp's own prompt-lookup drafting
(``llama_cpp.llama_speculative.LlamaPromptLookupDecoding``). With ``--drafter DIR`` a trained
EAGLE-3 head runs too (our chain decoding, ``--draft-len``; ``--lookup-ngram 3`` drafts by n-gram
lookup first and lets the head continue; ``--auto`` picks the chain length and confidence threshold
from measured costs on 2 further prompts, as ``wavesurf bench --mode auto`` does). Speedups are against HF greedy
``generate`` with 95% bootstrap intervals over prompts, paired per prompt
(``wavesurf.bench.speedup_interval``); "same as HF" counts outputs token-identical to HF greedy
(quantized weights change the greedy path; that is not a bug of either). llama.cpp's extra buffer
types (AMX and repacked-Q4 kernels) are off unless ``--extra-bufts``: on this sandboxed Sapphire
Rapids machine its AMX Q4_1 matmul segfaults (gdb: ``ggml_backend_amx_mul_mat``).

llama-cpp-python is not a wavesurf dependency; it builds from source (CMake, a C++ compiler):

    .venv/bin/pip install llama-cpp-python==0.3.36        # ~10-20 min compile on 2 cores
    .venv/bin/python benchmarks/anchors.py --n-prompts 8   # both cores
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def float32_gguf(src: Path, dst: Path) -> Path:
    """Write ``src`` with every tensor dequantized to float32 (metadata copied, file type ALL_F32).
    Built once, atomically (a temporary name renamed into place)."""
    import gguf

    if dst.is_file():
        return dst
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".partial")
    writer = gguf.GGUFWriter(tmp, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            writer.add_key_value(key, int(gguf.LlamaFileType.ALL_F32), gguf.GGUFValueType.UINT32)
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype("float32", copy=False)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    return dst


def llama_cpp_run(llm, prompt: list[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], float]:
    """Greedy tokens from llama.cpp for ``prompt`` (KV cache reset first) and the wall seconds."""
    llm.reset()
    out: list[int] = []
    t0 = time.perf_counter()
    for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if tok in eos or len(out) >= max_new_tokens:
            break
    return out, time.perf_counter() - t0


def main() -> None:
    import torch

    from wavesurf.assets import EMBEDDED_MODELS, embedded_gguf
    from wavesurf.bench import bench_prompts, prompt_ids, speedup_interval
    from wavesurf.drafter.decode import SpeculativeDecoder, TreeSpec, hf_generate
    from wavesurf.drafter.generation import eos_ids
    from wavesurf.models import configure_torch, load_target, processor_name

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(EMBEDDED_MODELS))
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--lookup-tokens", type=int, default=4, help="draft tokens of the prompt-lookup methods")
    ap.add_argument("--drafter", default=None, help="a trained head directory (wavesurf train) to run too")
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--lookup-ngram", type=int, default=0, help="with --drafter: n-gram lookup first (0 = the head alone)")
    ap.add_argument("--auto", action="store_true", help="with --drafter: adaptive draft length tuned on 2 more prompts")
    ap.add_argument("--no-guard", action="store_true", help="with --auto: no run-time pause of a losing head")
    ap.add_argument("--extra-bufts", action="store_true",
                    help="let llama.cpp repack weights into its extra buffer types (AMX / repacked Q4); off by "
                         "default because its AMX Q4_1 kernel segfaults on this machine (ggml_backend_amx_mul_mat)")
    args = ap.parse_args()
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as exc:
        raise SystemExit(f"llama-cpp-python is not installed ({exc}); see this script's docstring") from None

    if not args.extra_bufts:
        low = llama_cpp.llama_cpp
        default_params = low.llama_model_default_params

        def without_extra_bufts():
            params = default_params()
            params.use_extra_bufts = False
            return params

        low.llama_model_default_params = without_extra_bufts
    configure_torch()
    threads = torch.get_num_threads()
    target = load_target(args.model, device="cpu")
    eos = eos_ids(target)
    cache = Path(os.environ.get("WAVESURF_CACHE", Path.home() / ".cache" / "wavesurf")) / "anchors"
    cache.mkdir(parents=True, exist_ok=True)
    shipped = embedded_gguf(args.model, cache)
    ggufs = {"q": shipped, "f32": float32_gguf(shipped, cache / f"{args.model}-f32.gguf")}
    quant = EMBEDDED_MODELS[args.model].gguf_filename.rsplit(".", 2)[-2]
    llms = {}
    for tag, path in ggufs.items():
        for lookup in (False, True):
            name = f"llama.cpp {quant if tag == 'q' else 'F32'}" + (" + prompt lookup" if lookup else "")
            draft = LlamaPromptLookupDecoding(num_pred_tokens=args.lookup_tokens) if lookup else None
            llms[name] = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_batch=512, n_threads=threads,
                                         n_threads_batch=threads, draft_model=draft, verbose=False, seed=0)
    spec, spec_name, setting = None, "", None
    prompts = bench_prompts(args.dataset, args.n_prompts + 1 + (2 if args.auto else 0), target)
    if args.drafter:
        from wavesurf.drafter.adaptive import adaptive_decoder, tune
        from wavesurf.drafter.head import load_head
        head, _ = load_head(args.drafter, target)
        if args.auto:
            calibration, prompts = prompts[args.n_prompts + 1:], prompts[:args.n_prompts + 1]
            setting, costs = tune(target, head, [prompt_ids(target, p, []) for p in calibration], max_draft_len=args.draft_len,
                                  max_new_tokens=args.max_new_tokens, lookup_ngram=args.lookup_ngram)
            spec = adaptive_decoder(target, head, setting, args.lookup_ngram, costs=None if args.no_guard else costs)
        else:
            spec = SpeculativeDecoder(target, head, TreeSpec.chain(args.draft_len), lookup_ngram=args.lookup_ngram)
        spec_name = (f"wavesurf EAGLE-3 {'auto <= ' if args.auto else 'chain '}{args.draft_len}"
                     + (f" + lookup {args.lookup_ngram}" if args.lookup_ngram else ""))

    rows: list[dict] = []
    same: dict[str, int] = {}
    for i, p in enumerate(prompts):
        ids = prompt_ids(target, p, [])
        ref = hf_generate(target, ids, args.max_new_tokens)
        runs = {"hf_generate": (ref.tokens, ref.seconds)}
        r = hf_generate(target, ids, args.max_new_tokens, prompt_lookup_num_tokens=args.lookup_tokens)
        runs["hf prompt lookup"] = (r.tokens, r.seconds)
        if spec is not None:
            r = spec.generate(ids, args.max_new_tokens)
            runs[spec_name] = (r.tokens, r.seconds)
        for name, llm in llms.items():
            runs[name] = llama_cpp_run(llm, [int(t) for t in ids], args.max_new_tokens, eos)
        again = hf_generate(target, ids, args.max_new_tokens)  # timed again after the others
        runs["hf_generate"] = (ref.tokens, (ref.seconds + again.seconds) / 2)
        if i == 0:
            continue  # warm-up
        for name, (toks, secs) in runs.items():
            rows.append({"prompt_id": i, "method": name, "tokens_per_second": len(toks) / secs})
            same[name] = same.get(name, 0) + (toks == ref.tokens)
    base = [r["tokens_per_second"] for r in rows if r["method"] == "hf_generate"]
    out = {"model": target.name, "processor": processor_name(), "threads": threads, "llama_cpp_extra_bufts": args.extra_bufts, "load_1min": round(os.getloadavg()[0], 2),
           "dataset": args.dataset, "prompts": args.n_prompts, "max_new_tokens": args.max_new_tokens,
           "llama_cpp_python": llama_cpp.__version__, "torch": torch.__version__,
           "hf_tokens_per_second": round(sum(base) / len(base), 2),
           "adaptive_choice": setting.describe() if setting is not None else None, "methods": {}}
    for name in same:
        tps = [r["tokens_per_second"] for r in rows if r["method"] == name]
        ci = speedup_interval(rows, name) if name != "hf_generate" else None
        out["methods"][name] = {"tokens_per_second": round(sum(tps) / len(tps), 2),
                                "speedup_vs_hf": round(sum(tps) / sum(base), 2),
                                "speedup_ci95": [round(x, 2) for x in ci] if ci else None,
                                "same_as_hf_greedy": f"{same[name]}/{args.n_prompts}"}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
