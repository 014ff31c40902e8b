"""Lossless speculative decoding with an EAGLE-3 draft head on a target, batch size 1.

One *cycle* = draft a tree (or chain) of candidate tokens with the head, verify all of them in ONE
target forward with a tree attention mask, commit the accepted path plus the target's own next
token (the "bonus" / correction token), as in SafeAILab/EAGLE ``eagle/model/ea_model.py``.

Alignment (EAGLE-3): committed tokens x_0..x_m; the target's KV cache and its features f_t cover
positions 0..m-1 and x_m (the *root*) is not yet processed. The draft at position t reads
(fc(f_t), embedding(x_{t+1})) and predicts x_{t+2}; its pre-norm output is the feature of position
t+1 for the next draft step. The draft KV cache holds one entry per position 0..m-1 computed from
*target* features only ("draft extend" after every verification); tree-expansion KV is discarded.

Counting (eagle3.md 3.3, EAGLE's ``new_token += accept_length + 1`` per cycle):
``tau = tokens committed by cycles / target forwards after the prefill``. The prefill forward
and the first token it yields are excluded; a tie re-check forward (below) counts as a forward.
With every draft rejected each cycle commits exactly one token, so tau = 1.

Losslessness. T = 0: the accepted path is the longest one on which every draft token equals the
target's argmax, and the bonus is the target's argmax after it, so the output is the target's
greedy decoding. T > 0: EAGLE's multi-candidate rule with deterministic drafts: at a node, try the
children in draft-score order, accept child x with probability p(x) under the (renormalised)
target distribution, otherwise set p(x) = 0 and renormalise; when no child is accepted sample
the next token from what is left. Each committed token is therefore an exact sample of the
target distribution at temperature T.

Near ties. A multi-token verify forward (explicit tree mask, several rows) and HF's one-token
decode step run different float32 kernels: the logits differ by up to ~6e-5 on SmolLM2 (measured,
``benchmarks/near_ties.py``), and the KV rows they leave in the cache differ too, so re-running
just the last token alone does not reproduce HF. Where the target's top-2 gap is that small the
greedy argmax can flip. With ``tie_eps > 0`` (default :data:`DEFAULT_TIE_EPS`, ~17x the largest
difference seen, in float32; none in half precision, see :func:`default_tie_eps`), a path position whose top-2 gap is below ``tie_eps`` is decided by a *replay*:
the cache is cut back to the prompt (whose prefill is computed exactly as HF computes it) and every
generated token up to that position is re-run one at a time HF's way; that reproduces HF's logits
bit for bit on SmolLM2 (measured: max difference 0.0), so the decision is HF's. The replay costs
one forward per token generated so far; gaps below 1e-3 occur about once per ~2000 tokens, and
``DecodeResult.tie_rechecks`` counts the extra forwards (they count in tau). Exactness of the
replay holds while the context fits Gemma-3's 512-token sliding window (HF's sliding cache then
holds the same rows as ours).

Target attention: the target is called with an explicit 4D boolean mask (``sdpa``; an additive
float mask for ``eager``), and for models with sliding-window layers (Gemma-3) with a
``{"full_attention", "sliding_attention"}`` dict of masks, the sliding one cut to the window. The
target cache is a ``DynamicCache`` with plain full layers, so rows can be kept or dropped freely.
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

from ..errors import DecodeError
from ..packed import PackedLinears, packed_for, use_packing
from .baselines import greedy_generate, hf_generate
from .generation import DecodeResult, as_ids, check_decode_settings, eos_ids, finish_tokens, sample_token
from .guard import DraftGuard
from .head import DraftHead
from .lookup import NgramIndex, check_lookup_ngram
from .target_runner import TargetRunner
from .tree import DraftTree, TreeSpec, check_tree, make_tree, tree_mask

if TYPE_CHECKING:
    from ..models import Target

#: top-2 logit gap (logit units) below which a T=0 decision is re-made with a one-token forward.
DEFAULT_TIE_EPS = 1e-3


def default_tie_eps(target: Target, float32_eps: float = DEFAULT_TIE_EPS) -> float:
    """The near-tie threshold for ``target``'s dtype: ``float32_eps`` in float32, 0 (no
    replay) in bfloat16/float16. In half precision the logits are rounded to steps of 1/128 of their
    size, so exact top-2 ties are common, and a verify forward and HF's one-row step differ by whole
    rounding steps in the hidden states; a replay would fire every few tokens (measured on an H200:
    chain tau 4.85 in float32 fell to 1.05 in bfloat16) without making the output HF's, whose GPU
    kernels it does not reproduce. Half-precision decoding is then greedy on the verify logits, as
    in vLLM and SGLang: equal to HF greedy except where rounding flips an argmax."""
    dtype = next(target.model.parameters()).dtype
    return float32_eps if dtype == torch.float32 else 0.0


def check_confidence(min_confidence: Any) -> None:
    """Refuse a confidence threshold outside [0, 1) (0 = never stop drafting early)."""
    if isinstance(min_confidence, bool) or not isinstance(min_confidence, (int, float)) or not 0 <= min_confidence < 1:
        raise DecodeError(f"min_confidence={min_confidence!r} must be a number in [0, 1): the draft stops when "
                          "the estimated probability of the drafted path falls below it (0 = never)")


# ---------------------------------------------------------------------------------------------
# speculative decoding
class SpeculativeDecoder:
    """EAGLE-3 speculative decoding of one sequence with ``head`` on ``target``.

    Build once per (target, head, tree) and call :meth:`generate` per prompt.
    """

    def __init__(self, target: Target, head: DraftHead, tree: TreeSpec | None = None, *,
                 tie_eps: float | None = None, packed: bool | None = None, min_confidence: float = 0.0,
                 lookup_ngram: int = 0, guard: DraftGuard | None = None):
        head.config.check_target(target)
        if tie_eps is None:
            tie_eps = default_tie_eps(target)
        if isinstance(tie_eps, bool) or not isinstance(tie_eps, (int, float)) or not tie_eps >= 0:
            raise DecodeError(f"tie_eps={tie_eps!r} must be a number >= 0 (0 = no near-tie re-check; "
                              "None = the default for the target's dtype)")
        check_confidence(min_confidence)
        self.target, self.head = target, head.to(target.device).eval()
        self.tree = tree or TreeSpec.chain(4)
        self.lookup_ngram = check_lookup_ngram(lookup_ngram, tree=self.tree)
        if self.tree.top_k > head.config.draft_vocab_size:
            raise DecodeError(f"top_k={self.tree.top_k} is larger than the draft vocabulary "
                              f"({head.config.draft_vocab_size} ids); use top_k <= {head.config.draft_vocab_size}")
        if guard is not None:
            if not isinstance(guard, DraftGuard):
                raise DecodeError(f"guard={type(guard).__name__} must be a DraftGuard (or None)")
            if not self.tree.is_chain:
                raise DecodeError(f"guard prices chain cycles; the tree {self.tree.describe()} is not a chain")
            guard.costs.check_fits(target, self.tree.depth)
        self.guard = guard
        self.tie_eps = float(tie_eps)
        self.min_confidence = float(min_confidence)
        self._min_logp = math.log(min_confidence) if min_confidence > 0 else -math.inf
        self.embed = target.model.get_input_embeddings()
        self.d2t = head.draft_to_target.to(target.device)
        self.eos = eos_ids(target)
        packed = use_packing(packed, target.model)
        self.packed = packed_for(target.model, max(2, self.tree.total_tokens + 1)) if packed else None

    # ---- draft side ---------------------------------------------------------------------------
    def _draft_extend(self, feats: torch.Tensor, next_tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append draft KV for positions start.. from target features; return (log-probs over the
        draft vocabulary, pre-norm hidden) of the last position."""
        n = len(next_tokens)
        head, s = self.head, self.dk.shape[2] if self.dk is not None else 0
        hidden = head.fuse(feats[None].to(head.fc.weight.dtype))
        emb = self.embed(next_tokens[None])
        pos = torch.arange(start, start + n, device=feats.device)[None]
        mask = torch.cat([torch.ones(n, s, dtype=torch.bool, device=feats.device),
                          torch.ones(n, n, dtype=torch.bool, device=feats.device).tril()], dim=1)[None, None]
        st = head.step(hidden, emb, pos, mask, self.dk, self.dv)
        self.dk = st.k if self.dk is None else torch.cat([self.dk, st.k], dim=2)
        self.dv = st.v if self.dv is None else torch.cat([self.dv, st.v], dim=2)
        self.draft_steps += 1
        return torch.log_softmax(st.logits[0, -1].float(), -1), st.hidden[0, -1]

    def _draft_tree(self, root_logp: torch.Tensor, root_hidden: torch.Tensor, m: int,
                    forced: list[int] | None = None) -> DraftTree:
        """EAGLE-2 dynamic tree: expand the top_k best nodes per level, score by cumulative log-prob,
        keep the best ``total_tokens`` nodes (a set closed under parents). ``forced`` (a chain only):
        the first tokens of the chain, proposed by n-gram lookup; they add 0 to the score (the
        confidence threshold never cuts them) and the head drafts after them."""
        spec, head = self.tree, self.head
        k = spec.top_k
        dev = root_logp.device
        forced = forced or []
        if len(forced) >= spec.depth:  # lookup fills the whole chain: no head step needed
            return DraftTree.chain(forced[:spec.depth])
        lp, di = root_logp.topk(k)
        tokens = self.d2t[di].tolist()
        parent, level, score = [-1] * k, [1] * k, lp.tolist()
        if forced:
            tokens, score = [forced[0]], [0.0]
        ancestors: list[set[int]] = [{i} for i in range(k)]
        src_hidden = [root_hidden] * k  # hidden of the step that predicted each node
        draft_id = di.tolist()
        frontier = [c for c in range(k) if score[c] >= self._min_logp]
        exp_owner: list[int] = []  # node whose expansion produced each expansion key row
        ek = ev = None
        s = self.dk.shape[2]
        for lev in range(2, spec.depth + 1):
            f = len(frontier)
            if f == 0:  # every path is below the confidence threshold: stop drafting
                break
            hid = torch.stack([src_hidden[n] for n in frontier])[None]
            emb = self.embed(torch.tensor([tokens[n] for n in frontier], device=dev)[None])
            pos = torch.full((1, f), m + lev - 2, dtype=torch.long, device=dev)
            seen = torch.zeros(f, len(exp_owner) + f, dtype=torch.bool, device=dev)
            for qi, n in enumerate(frontier):
                for ki, owner in enumerate(exp_owner):
                    if owner in ancestors[n]:
                        seen[qi, ki] = True
                seen[qi, len(exp_owner) + qi] = True
            mask = torch.cat([torch.ones(f, s, dtype=torch.bool, device=dev), seen], dim=1)[None, None]
            pk = self.dk if ek is None else torch.cat([self.dk, ek], dim=2)
            pv = self.dv if ev is None else torch.cat([self.dv, ev], dim=2)
            st = head.step(hid, emb, pos, mask, pk, pv)
            self.draft_steps += 1
            ek = st.k if ek is None else torch.cat([ek, st.k], dim=2)
            ev = st.v if ev is None else torch.cat([ev, st.v], dim=2)
            exp_owner.extend(frontier)
            clp, cdi = torch.log_softmax(st.logits[0].float(), -1).topk(k, dim=-1)  # [f, k]
            children = []
            for qi, n in enumerate(frontier):
                for j in range(k):
                    c = len(tokens)
                    if lev <= len(forced):  # a chain (k = 1) whose token at this level lookup proposed
                        tokens.append(forced[lev - 1])
                        score.append(score[n])
                    else:
                        tokens.append(int(self.d2t[cdi[qi, j]]))
                        score.append(score[n] + float(clp[qi, j]))
                    draft_id.append(int(cdi[qi, j]))
                    parent.append(n)
                    level.append(lev)
                    ancestors.append(ancestors[n] | {c})
                    src_hidden.append(st.hidden[0, qi])
                    children.append(c)
            frontier = [c for c in sorted(children, key=lambda c: (-score[c], c))[:k] if score[c] >= self._min_logp]
        order = sorted(range(len(tokens)), key=lambda c: (-score[c], level[c], c))
        chosen: list[int] = []
        taken: set[int] = set()
        for c in order:
            if len(chosen) == spec.total_tokens or score[c] < self._min_logp:
                break  # scores fall along a path, so what is left is below the threshold too
            if parent[c] == -1 or parent[c] in taken:
                chosen.append(c)
                taken.add(c)
        chosen.sort(key=lambda c: (level[c], -score[c], c))
        new_index = {c: i for i, c in enumerate(chosen)}
        return DraftTree([tokens[c] for c in chosen], [new_index.get(parent[c], -1) for c in chosen],
                     [level[c] for c in chosen], [score[c] for c in chosen])

    # ---- verification -------------------------------------------------------------------------
    def _accept(self, logits: torch.Tensor, tree: DraftTree, temperature: float,
                gen: torch.Generator | None) -> tuple[list[int], int]:
        """Rows of the accepted path (0 = root, then tree rows) and the bonus token."""
        children: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parent):  # rows are i + 1, already in descending score per level
            children.setdefault(p + 1, []).append(i + 1)
        path, row = [0], 0
        while True:
            kids = children.get(row, [])
            if temperature == 0:
                y = int(torch.argmax(logits[row]))
                nxt = next((c for c in kids if tree.tokens[c - 1] == y), None)
                if nxt is None:
                    return path, y
            else:
                p = torch.softmax(logits[row].double().cpu() / temperature, dim=-1)  # the generator is on the CPU
                nxt = None
                for c in sorted(kids, key=lambda c: -tree.score[c - 1]):
                    x = tree.tokens[c - 1]
                    px = float(p[x])
                    if px > 0 and float(torch.rand((), generator=gen, dtype=torch.float64)) < px:
                        nxt = c
                        break
                    p[x] = 0.0
                    total = float(p.sum())
                    if total <= 0:  # cannot happen unless every token was drafted and rejected
                        break
                    p = p / total
                if nxt is None:
                    return path, int(torch.multinomial(p, 1, generator=gen))
            path.append(nxt)
            row = nxt

    # ---- the loop -----------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, input_ids: Any, max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids`` (1D ids, or [1, T])."""
        check_decode_settings(max_new_tokens, temperature)
        t0 = time.perf_counter()
        ids = as_ids(input_ids, self.target.device)
        dev = ids.device
        gen = torch.Generator(device="cpu").manual_seed(seed) if temperature > 0 else None
        runner = TargetRunner(self.target, self.head.config.layer_ids, self.packed)
        self.dk = self.dv = None
        self.draft_steps = 0
        cycles, accepted, rechecks, scores, lookup_drafted = [], [], 0, [], []
        try:
            n = len(ids)
            # the prefill exactly as HF computes it (its own causal masks, logits of the last row only)
            logits, feats = runner.forward(ids, torch.arange(n, device=dev), None, logits_rows=1)
            first = sample_token(logits[-1].cpu(), temperature, gen)
            produced, done = finish_tokens([first], [], self.eos, max_new_tokens)
            # target features f_0..f_{n-1} and the tokens that follow them x_1..x_n
            pend_feats, pend_next, start = feats, torch.cat([ids[1:], torch.tensor([first], device=dev)]), 0
            seq = torch.cat([ids, torch.tensor([first], device=dev)])
            index = NgramIndex(self.lookup_ngram, seq.tolist()) if self.lookup_ngram else None
            guard = self.guard
            if guard is not None:
                guard.reset()
            while not done:
                m = len(seq) - 1  # root x_m; target cache covers 0..m-1
                steps_before = self.draft_steps
                forced = index.draft(self.tree.depth) if index is not None else None
                head_on = guard is None or not guard.paused
                if head_on:
                    root_logp, root_h = self._draft_extend(pend_feats, pend_next, start)
                    tree = self._draft_tree(root_logp, root_h, m, forced)
                else:  # the guard paused the head: the root alone, or a lookup draft of a full-length match
                    if forced is not None and index.match_length < index.max_ngram:
                        forced = []
                    tree = DraftTree.chain(forced or [])
                if forced is not None:
                    lookup_drafted.append(len(forced))
                vids = torch.tensor([int(seq[-1])] + tree.tokens, device=dev)
                vpos = m + torch.tensor([0] + tree.level, device=dev)
                mask = None if self.tree.is_chain else tree_mask(tree, dev)  # a chain is plain causal order
                logits, feats = runner.forward(vids, vpos, mask, verify=True)
                path, bonus = self._accept(logits, tree, temperature, gen)
                did, new_feats = 0, None
                if temperature == 0 and self.tie_eps > 0:
                    path, bonus, new_feats, did = self._tie_replay(runner, logits, path, bonus, vids, seq, len(ids))
                    rechecks += did
                if new_feats is None:
                    rows = torch.tensor(path, device=dev)
                    runner.keep(m, rows)
                    new_feats = feats[rows]
                new_tokens = [int(vids[r]) for r in path[1:]] + [bonus]
                before = len(produced)
                produced, done = finish_tokens(new_tokens, produced, self.eos, max_new_tokens)
                cycles.append(len(produced) - before)
                cycles.extend([0] * did)  # a re-check forward commits no extra token but counts as a forward
                accepted.append(len(path) - 1)
                if self.tree.is_chain:
                    scores.append([round(x, 5) for x in tree.score])
                seq = torch.cat([seq, torch.tensor(new_tokens, device=dev)])
                if index is not None:
                    index.extend(new_tokens)
                if guard is not None:
                    guard.observe(len(tree.tokens), self.draft_steps - steps_before, len(new_tokens))
                if head_on:
                    pend_feats, pend_next, start = new_feats, torch.tensor(new_tokens, device=dev), m
                else:  # the head's cache falls behind: extend it over these positions when it drafts again
                    pend_feats = torch.cat([pend_feats, new_feats])
                    pend_next = torch.cat([pend_next, torch.tensor(new_tokens, device=dev)])
            forwards = runner.forwards
        finally:
            runner.close()
            self.dk = self.dv = None
        return DecodeResult(f"eagle3-{'chain' if self.tree.is_chain else 'tree'}", produced,
                            time.perf_counter() - t0, forwards, cycles, accepted, self.draft_steps, rechecks,
                            prompt_tokens=len(ids),
                            stopped="eos" if produced and produced[-1] in self.eos else "max_new_tokens",
                            draft_scores=scores, lookup_drafted=lookup_drafted,
                            paused_tokens=guard.paused_tokens if guard is not None else 0)

    def _tie_replay(self, runner: TargetRunner, logits: torch.Tensor, path: list[int], bonus: int,
                    vids: torch.Tensor, seq: torch.Tensor, n_prompt: int):
        """At T=0, find the first path row whose top-2 logit gap is below ``tie_eps``. There the
        verify forward's decision is not trusted: every generated token up to that row is re-run
        one at a time the way HF decodes (its own masks, one row), over the prompt's cache rows
        (computed by an HF-identical prefill), and the token after the row is that forward's argmax.
        Returns the path cut at the row, the decided token, the features of the new positions and
        the number of extra forwards (0 and ``None`` features when there is no near tie)."""
        for i, r in enumerate(path):
            top2 = logits[r].topk(2).values
            if float(top2[0] - top2[1]) >= self.tie_eps:
                continue
            dev = vids.device
            replay = torch.cat([seq[n_prompt:], vids[torch.tensor(path[1 : i + 1], dtype=torch.long, device=dev)]])
            runner.keep(n_prompt, torch.zeros(0, dtype=torch.long, device=dev))
            feats = []
            for j, tok in enumerate(replay):
                lg, f = runner.forward(tok.view(1), torch.tensor([n_prompt + j], device=dev), None)
                feats.append(f)
            new_feats = torch.cat(feats[-(i + 1):]) if feats[0] is not None else None
            return path[: i + 1], int(torch.argmax(lg[0])), new_feats, len(replay)
        return path, bonus, None, 0


def speculative_generate(target: Target, head: DraftHead, input_ids: Any, max_new_tokens: int, *,
                         mode: str = "chain", draft_len: int = 4, depth: int = 5, top_k: int = 4,
                         total_tokens: int = 16, temperature: float = 0.0, seed: int = 0,
                         tie_eps: float | None = None) -> DecodeResult:
    """One-call form of :class:`SpeculativeDecoder` (see there)."""
    tree = make_tree(mode, draft_len=draft_len, depth=depth, top_k=top_k, total_tokens=total_tokens)
    return SpeculativeDecoder(target, head, tree, tie_eps=tie_eps).generate(input_ids, max_new_tokens, temperature, seed)


__all__ = [
    "DEFAULT_TIE_EPS", "default_tie_eps", "DecodeError", "DecodeResult", "DraftTree", "PackedLinears", "SpeculativeDecoder",
    "TargetRunner", "TreeSpec", "as_ids", "check_decode_settings", "check_tree", "eos_ids", "finish_tokens",
    "sample_token", "tree_mask",
    "greedy_generate", "hf_generate", "make_tree", "speculative_generate",
]
