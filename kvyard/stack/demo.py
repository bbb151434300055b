"""`make demo`'s second half: a few chat requests through the local gateway.

It uses the official `openai` client, unchanged, against the gateway URL from
`kvyard up`'s state file, to show that kvyard is a drop-in OpenAI endpoint.
All requests share one long system prompt, so after the first one the EPP
should keep sending them to the worker that already holds that prefix in its
KV cache; each line names the worker that answered (`x-kvyard-endpoint`).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

from kvyard.common.models import DEMO_ALIASES, DEMO_SERVED_NAME
from kvyard.common.wire import ENDPOINT_HEADER
from kvyard.stack.state import StackState
from kvyard.stack.rundir import add_run_dir, kvyard_command, run_dir

SYSTEM = (
    "You are the help desk of Yardley Garden Supplies, a family shop founded in 1962. "
    "Opening hours: Monday to Friday 8:00 to 18:00, Saturday 9:00 to 16:00, closed on Sunday. "
    "We sell seeds, bulbs, tools, compost, pots and outdoor furniture, and we deliver within "
    "twenty kilometres for a flat fee of five euros, free above sixty euros. Returns are "
    "accepted within thirty days with a receipt; plants are guaranteed for one season. "
    "Answer briefly and politely, in one or two sentences, and never invent products. "
) * 3
QUESTIONS = (
    "When are you open on Saturday?",
    "How much does delivery cost?",
    "Can I return a spade I bought last week?",
    "Do you sell tomato seeds?",
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=40)
    add_run_dir(p)
    args = p.parse_args(argv)
    state = StackState.load(run_dir(args))
    if state is None or not state.gateway_url:
        print("no local stack is running: start one with `kvyard up --workers 2`", file=sys.stderr)
        return 1
    from openai import OpenAI

    model = state.spec.get("model", "demo")
    model = DEMO_SERVED_NAME if model in DEMO_ALIASES else model
    client = OpenAI(base_url=state.gateway_url + "/v1", api_key="kvyard-local", timeout=300,
                    max_retries=0)
    print(f"gateway {state.gateway_url}, workers {', '.join(state.endpoints)}")
    print(f"{len(QUESTIONS)} questions sharing a {len(SYSTEM)}-character system prompt\n")
    served: list[str] = []
    for q in QUESTIONS:
        t0 = time.monotonic()
        raw = client.chat.completions.with_raw_response.create(
            model=model, max_tokens=args.max_tokens, temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        took = time.monotonic() - t0
        who = raw.headers.get(ENDPOINT_HEADER, "?")
        served.append(who)
        answer = (raw.parse().choices[0].message.content or "").strip().replace("\n", " ")
        print(f"Q: {q}\nA: {answer}\n   served by {who} in {took:.2f} s\n")
    first, later = served[0], served[1:]
    same = sum(1 for w in later if w == first)
    print(f"served by: {dict(Counter(served))}")
    print(f"{same} of {len(later)} later requests landed on {first}, the worker that already "
          "had the shared system prompt in its KV cache (prefix-aware routing).")
    k = kvyard_command()
    print(f"\nSee the EPP's view with `{k} status`; stop everything with `{k} down`.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
