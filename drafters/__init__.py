"""Drafters: the `Drafter` interface, its registry, and the built-in drafters."""
from drafters import datastore, eagle3, ngram, small, suffix, tree_merge  # noqa: F401  (registration side effects)
from drafters.base import DraftRequest, Drafter, Proposal, TargetHidden, build_drafter, register_drafter

__all__ = ["DraftRequest", "Drafter", "Proposal", "TargetHidden", "build_drafter", "register_drafter"]
