"""Drafters: the `Drafter` interface, its registry, and the built-in drafters."""
from drafters.base import DraftRequest, Drafter, Proposal, TargetHidden
from drafters.kinds import build_drafter, check_drafter, default_speculation
from drafters.registry import register_drafter

__all__ = ["DraftRequest", "Drafter", "Proposal", "TargetHidden", "build_drafter", "check_drafter",
           "default_speculation", "register_drafter"]
