"""Models built offline: the tiny Qwen2 policy and byte-level BPE tokenizer the quickstart, tests and benchmarks use
(its tokenizer corpus is package data, ``tokenizer_corpus.jsonl``).

Layer: at the bottom; imports nothing else of tslightning.
"""
