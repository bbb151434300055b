"""What two components must agree on, and nothing else.

Tokenization and chat templates (`tokenizer`), block hashing (`hashing`), wire
names (`wire`) and where models come from (`models`). Imported by the EPP, the
workers and the kvstore alike, so it must never import torch or any
component's internals.
"""
