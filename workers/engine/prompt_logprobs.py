"""vLLM's `prompt_logprobs`: each prompt position's log-probability of the next
prompt token (its rank, and the top k), from the logits the runner computes for
prompt positions of requests that ask for them."""
from __future__ import annotations

import torch

from .api import TokenLogprob
from .sequence import Sequence


def append_prompt_logprobs(seq: Sequence, first: int, logits: torch.Tensor) -> None:
    """Entries for positions first.. (`logits` [k, V] float32, each row predicting the
    next prompt token), appended in order to `seq.prompt_logprobs`; raw log_softmax,
    like the sampled tokens' logprobs."""
    entries = seq.prompt_logprobs
    if not entries:
        entries.append(None)             # the first token has nothing before it
    if first != len(entries) - 1:
        raise RuntimeError(f"prompt logits out of order: position {first}, "
                           f"{len(entries)} entries")
    lp = torch.log_softmax(logits, dim=-1)
    targets = seq.token_ids[first + 1:first + 1 + lp.shape[0]]
    chosen_t = lp.gather(1, torch.tensor(targets).unsqueeze(1))
    ranks = ((lp > chosen_t).sum(dim=1) + 1).tolist()  # vLLM's prompt_logprobs report it
    chosen = chosen_t.squeeze(1).tolist()
    k = seq.params.prompt_logprobs or 0
    top_v, top_i = lp.topk(k, dim=-1) if k else (None, None)
    for j, t in enumerate(targets):
        top = list(zip(top_i[j].tolist(), top_v[j].tolist())) if k else []
        entries.append(TokenLogprob(t, chosen[j], top, ranks[j]))
