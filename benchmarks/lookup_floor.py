"""How far does copying go on the target's own answers? Scores n-gram lookup drafting
(``wavesurf.drafter.acceptance.lookup_drafts``: find the most recent earlier occurrence of the last
n generated tokens, n = 3, 2, 1, and propose the tokens that followed it) by exact greedy chain acceptance over a distilled
corpus, for draft lengths 1..6. The speed table's ``lookup`` floor (``lookup_acceptance``) scores
the same rule on the held-out feature store, prompts included in the context.

    python benchmarks/lookup_floor.py --model smollm2-135m --split heldout --max-tokens 4000

The context a lookup may copy from is the conversation's earlier answers and the answer so far
(user prompts are left out, so this is a lower bound on what prompt lookup sees). Needs the
corpus distilled first (``wavesurf distill``; the speed table does it). No model forward runs.
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def chain_tau(conversations: list[list[list[int]]], draft_len: int) -> tuple[float, int]:
    """Tokens per verify cycle of chain decoding with lookup drafts (greedy: a draft token is
    accepted while it equals the stored greedy answer; every cycle adds one target token)."""
    from wavesurf.drafter.acceptance import lookup_drafts

    tokens = cycles = 0
    for answers in conversations:
        # a draft depends only on its context, and every committed token is the stored one: the
        # drafts after each prefix of the whole conversation, computed once, serve every cycle
        drafts = lookup_drafts([t for answer in answers for t in answer], draft_len)
        context: list[int] = []
        for answer in answers:
            i = 0
            while i < len(answer):
                draft = drafts[len(context) - 1] if context else []
                hits = 0
                while hits < len(draft) and i + hits < len(answer) and draft[hits] == answer[i + hits]:
                    hits += 1
                step = min(hits + 1, len(answer) - i)
                context += answer[i:i + step]
                i += step
                tokens, cycles = tokens + step, cycles + 1
    return tokens / max(cycles, 1), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--split", default="heldout", help="ShareGPT split the answers were distilled for")
    ap.add_argument("--max-tokens", type=int, default=4000, help="the distilled corpus's answer-token budget")
    ap.add_argument("--max-draft-len", type=int, default=6)
    args = ap.parse_args()

    from wavesurf.distill import distill_corpus
    from wavesurf.models import load_target

    target = load_target(args.model)
    corpus = distill_corpus(target, "sharegpt", split=args.split, max_tokens=args.max_tokens, progress=False)
    conversations = [ex.meta["answer_token_ids"] for ex in corpus.examples]
    for d in range(1, args.max_draft_len + 1):
        tau, tokens = chain_tau(conversations, d)
        print(json.dumps({"draft_len": d, "lookup_tau": round(tau, 4), "answer_tokens": tokens,
                          "conversations": len(conversations), "corpus": f"{corpus.name}#{corpus.info['key']}"}))


if __name__ == "__main__":
    main()
