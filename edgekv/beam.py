"""Beam search with Hugging Face transformers' semantics (BeamSearchScorer / BeamHypotheses):
a beam's score is its summed token log-probabilities; a finished hypothesis (ended by EOS, or
running when max_tokens is reached) is scored sum_logprobs / generated_len ** length_penalty,
where generated_len counts its tokens, EOS included. Each step takes the best
max(2, 1 + len(eos)) * num_beams (beam, token) candidates: an EOS among the first num_beams
ends a hypothesis, the best num_beams others go on. The search stops when num_beams hypotheses
are finished and (early_stopping False) no running beam can still beat the worst of them.

The beams share the prompt's prefill and decode as one batch (generate.submit -> forward_batch);
a beam chosen twice forks its sequence (Sequence.fork: a copy of its cache, KVCache.fork)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

import numpy as np

from .generate import Completion, Sequence, Stats, leave, prefill, submit


@dataclass
class Hypothesis(Completion):
    """One result of `beam_search`: a Completion with its score (sum_logprobs / generated_len ** length_penalty)."""

    score: float


class Finished:
    """The best num_beams finished hypotheses so far (HF's BeamHypotheses)."""

    def __init__(self, num_beams: int, length_penalty: float, early_stopping: bool):
        self.num_beams, self.length_penalty, self.early_stopping = num_beams, length_penalty, early_stopping
        self.beams: list[tuple[float, list[int], str]] = []  # (score, tokens, finish_reason)
        self.worst = 1e9

    def add(self, tokens: list[int], sum_logprobs: float, generated_len: int, reason: str) -> None:
        score = sum_logprobs / generated_len ** self.length_penalty
        if len(self.beams) < self.num_beams or score > self.worst:
            self.beams.append((score, tokens, reason))
            if len(self.beams) > self.num_beams:
                ranked = sorted((s, i) for i, (s, _, _) in enumerate(self.beams))
                del self.beams[ranked[0][1]]
                self.worst = ranked[1][0]
            else:
                self.worst = min(score, self.worst)

    def done(self, best_sum_logprobs: float, generated_len: int) -> bool:
        """Whether no running beam can still enter (best_sum_logprobs: the step's best candidate)."""
        if len(self.beams) < self.num_beams:
            return False
        return self.early_stopping or self.worst >= best_sum_logprobs / generated_len ** self.length_penalty


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of float32 logits."""
    x = logits.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


def beam_search(llm, seq: Sequence, prompt_ids, *, num_beams: int, max_tokens: int, length_penalty: float = 1.0,
                early_stopping: bool = False, cancel: threading.Event | None = None) -> list[Hypothesis]:
    """The num_beams best hypotheses continuing prompt_ids (prefilled into seq), best first."""
    eos = llm.tokenizer.eot_ids
    first = Stats()
    finished = Finished(num_beams, length_penalty, early_stopping)
    seqs = [seq]
    try:
        logits = [prefill(llm, seq, prompt_ids, cancel, first)]  # per running beam
        t0 = time.perf_counter()
        beams = [(seq, [], 0.0)]  # running: (sequence, generated ids, sum of their log-probabilities)
        reason = "length"
        keep = max(2, 1 + len(eos)) * num_beams
        for step in range(1, max_tokens + 1):
            if logits[0] is None or (cancel is not None and cancel.is_set()):
                reason = "cancelled"
                break
            scores = np.concatenate([log_softmax(lg) + s for (_, _, s), lg in zip(beams, logits)])
            best = np.argsort(-scores, kind="stable")[:keep]  # ties: the lower beam, then the lower id
            going = []  # (beam, token, score)
            for rank, f in enumerate(best):
                b, tok = divmod(int(f), len(logits[0]))
                if tok in eos:
                    if rank < num_beams:
                        finished.add(beams[b][1], float(scores[f]), step, "stop")
                else:
                    going.append((b, tok, float(scores[f])))
                if len(going) == num_beams:
                    break
            if finished.done(float(scores[best[0]]), step):
                beams = []
                break
            # a beam chosen twice forks before anything is fed: each copy starts where it was
            taken: set[int] = set()
            nxt = []
            for b, tok, s in going:
                parent = beams[b][0]
                nxt.append((parent if b not in taken else parent.fork(), beams[b][1] + [tok], s))
                taken.add(b)
            leave(llm, [beams[b][0] for b in range(len(beams)) if b not in taken])
            beams = nxt
            seqs = [s for s, _, _ in beams]
            if step == max_tokens:
                break
            logits = submit(llm, seqs, [[toks[-1]] for _, toks, _ in beams])
        for _, toks, s in beams:  # still running at the end: finished as they are
            finished.add(toks, s, len(toks) if toks else 1, reason)
        first.decode_s = time.perf_counter() - t0
    finally:
        leave(llm, seqs)
    out = []
    for score, toks, why in sorted(finished.beams, key=lambda h: -h[0]):
        stats = replace(first, generated_tokens=len(toks))
        out.append(Hypothesis(llm.detokenize(toks), toks, why, stats, score))
    return out
