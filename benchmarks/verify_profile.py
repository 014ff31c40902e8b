"""Where the time of one target decode step and one K-token verify pass goes, on this CPU.

For an HF decode step (one token, HF's own masks) and for our verify forward of K tokens over a
cached context (K = 1 root + K-1 drafts), each run as a *chain* (causal order: no explicit mask,
the path HF's own decode step takes) and as a *tree* (explicit boolean [K, past+K] mask), the
forward is split with module hooks into: embedding, q/k/v/o projections, attention core (rotary +
scaled-dot-product attention + cache append), MLP, norms, the lm_head (``logits_rows`` rows or all
K), and the rest of the model call (mask construction, position ids, Python). Every verify of more
than one token is timed twice: with the plain ``nn.Linear`` weights ("before") and with the
oneDNN-packed weights that ``SpeculativeDecoder`` uses for verify passes (``_packed``, "after"). Outside the forward:
trimming the KV cache after a partial acceptance (``keep``), building the tree mask, and one draft
head step. Times are medians over ``--repeats`` runs (milliseconds), all variants interleaved per
repeat so the machine's drift falls on every variant alike; the thread count and the 1-minute load
are printed.

    python benchmarks/verify_profile.py --threads 1 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class _ModuleTimer:
    """perf_counter around chosen submodules (pre/post forward hooks), summed per category."""

    def __init__(self, model):
        self.totals: dict[str, float] = defaultdict(float)
        self.handles = []
        self._start: dict[int, float] = {}
        for name, mod in model.named_modules():
            cat = self._category(name)
            if cat is None:
                continue
            self.handles.append(mod.register_forward_pre_hook(self._pre))
            self.handles.append(mod.register_forward_hook(self._post(cat)))

    @staticmethod
    def _category(name: str) -> str | None:
        last = name.rsplit(".", 1)[-1]
        if last in ("q_proj", "k_proj", "v_proj", "o_proj"):
            return "qkvo_proj"
        if last == "self_attn":
            return "self_attn_total"
        if last == "mlp":
            return "mlp"
        if last.endswith("layernorm") or last in ("norm", "q_norm", "k_norm") and "self_attn" not in name:
            return "norms"
        if last == "embed_tokens":
            return "embedding"
        if last == "lm_head":
            return "lm_head"
        return None

    def _pre(self, mod, args):
        self._start[id(mod)] = time.perf_counter()

    def _post(self, cat):
        def hook(mod, args, out):
            self.totals[cat] += time.perf_counter() - self._start.pop(id(mod))
        return hook

    def take(self) -> dict[str, float]:
        out = dict(self.totals)
        self.totals.clear()
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def main() -> None:
    import torch
    from transformers import DynamicCache

    from wavesurf.drafter.target_runner import TargetRunner
    from wavesurf.packed import PackedLinears, packing_available
    from wavesurf.drafter.head import DraftConfig, DraftHead, init_head
    from wavesurf.models import load_target, processor_name

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=256, help="cached context tokens (default 256)")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 5, 9], help="tokens per verify (root + drafts)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    target = load_target(args.model, device="cpu")
    model = target.model
    torch.manual_seed(0)
    ctx = torch.randint(100, 5000, (args.context,))
    head = init_head(DraftHead(DraftConfig.for_target(target, target.default_layer_ids(), min(32000, target.vocab_size))))
    report: dict = {"model": target.name, "processor": processor_name(), "context": args.context, "load_1min": round(os.getloadavg()[0], 2),
                    "cpus": os.cpu_count(), "results": {}}

    for threads in args.threads:
        torch.set_num_threads(threads)
        timer = _ModuleTimer(model)
        packed = PackedLinears(model, rows=min(args.ks[1:] or [5])) if packing_available(model) else None
        runner = TargetRunner(target, target.default_layer_ids(), packed=packed)
        samples: dict[str, list[dict[str, float]]] = defaultdict(list)
        with torch.inference_mode():
            runner.forward(ctx, torch.arange(args.context), None)
            hf_cache = DynamicCache(config=model.config)
            model(input_ids=ctx[None], cache=hf_cache, use_cache=True)

            def run(name, fn):
                timer.take()
                t0 = time.perf_counter()
                fn()
                total = time.perf_counter() - t0
                parts = timer.take()
                parts["total"] = total
                samples[name].append(parts)

            def hf_step():
                extra = hf_cache.get_seq_length() - args.context
                if extra > 0:
                    hf_cache.crop(-extra)
                model(input_ids=ctx[-1:][None], cache=hf_cache, use_cache=True)

            variants = {"hf_decode_step": hf_step}
            for k in args.ks:
                ids = torch.randint(100, 5000, (k,))
                pos = args.context + torch.arange(k)
                tril = torch.ones(k, k, dtype=torch.bool).tril()
                for mode, tree in (("chain", None), ("tree", tril)):
                    def verify(ids=ids, pos=pos, tree=tree):
                        runner.forward(ids, pos, tree)
                    variants[f"verify{k}_{mode}"] = verify
                    if packed is not None and k > 1:
                        def verify_packed(ids=ids, pos=pos, tree=tree):
                            runner.forward(ids, pos, tree, verify=True)
                        variants[f"verify{k}_{mode}_packed"] = verify_packed
                    if k > 1:
                        def keep_partial(ids=ids, pos=pos, tree=tree, k=k):
                            runner.forward(ids, pos, tree)
                            t0 = time.perf_counter()
                            runner.keep(args.context, torch.tensor([0, 1]))
                            samples[f"keep_after_verify{k}_{mode}"].append({"total": time.perf_counter() - t0})
                        variants[f"_keep{k}_{mode}"] = keep_partial
            h = head.config.hidden_size
            kv = torch.zeros(1, head.config.num_key_value_heads, args.context, head.config.head_dim)
            hid, emb = torch.randn(1, 1, h), torch.randn(1, 1, h)
            dpos = torch.full((1, 1), args.context)
            dmask = torch.ones(1, 1, 1, args.context + 1, dtype=torch.bool)
            variants["draft_step"] = lambda: head.step(hid, emb, dpos, dmask, kv, kv)

            for name, fn in variants.items():  # warm-up
                fn()
                runner.keep(args.context, torch.zeros(0, dtype=torch.long))
            samples.clear()
            for _ in range(args.repeats):
                for name, fn in variants.items():
                    if name.startswith("_"):
                        fn()
                    else:
                        run(name, fn)
                    runner.keep(args.context, torch.zeros(0, dtype=torch.long))
        runner.close()
        timer.remove()
        packed_ratios = packed.ratios if packed is not None else None
        packed = None

        table = {}
        for name, rows in samples.items():
            keys = sorted({k for r in rows for k in r})
            med = {k: statistics.median(r.get(k, 0.0) for r in rows) * 1e3 for k in keys}
            if "self_attn_total" in med:
                med["attention_core"] = med.pop("self_attn_total") - med.get("qkvo_proj", 0.0)
                accounted = sum(v for k, v in med.items() if k != "total")
                med["mask_rotary_python_rest"] = med["total"] - accounted
            table[name] = {k: round(v, 2) for k, v in med.items()}
        step = table["hf_decode_step"]["total"]
        ratios = {n: round(v["total"] / step, 3) for n, v in table.items() if n.startswith("verify")}
        report["results"][f"threads={threads}"] = {
            "ms": table, "verify_over_hf_step": ratios,
            "packed_over_plain_by_shape": {f"{o}x{i}": round(r, 2) for (o, i), r in (packed_ratios or {}).items()}}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
