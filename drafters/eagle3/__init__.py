"""EAGLE-3: the head (`head`), its public file layouts (`format`, `config`), the drafter."""
from drafters.eagle3 import drafter  # noqa: F401  (registers "eagle3")
from drafters.eagle3.config import Eagle3Config
from drafters.eagle3.format import HeadMismatchError, load_head, save_head
from drafters.eagle3.head import Eagle3Head

__all__ = ["Eagle3Config", "Eagle3Head", "HeadMismatchError", "load_head", "save_head"]
