"""Sampling: the request's parameters, the logits transform and the sampler, logprobs, and
grammar-constrained decoding (xgrammar masks, in a worker where they could hang)."""
