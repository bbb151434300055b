"""Precise prefix routing's data: what each endpoint's engine holds, from its KV events.

`sources` decides which streams to subscribe to (the discovered endpoints'),
`subscriber` reads one stream and repairs losses, `index` keeps the blocks under
our own keys within a memory budget, `request_keys` computes a request's keys the
same way, `speculative` remembers recent picks until their events arrive. The
scorer that reads them is `scheduling/scorers/precise_prefix.py`.
"""
