"""Token trees for speculative verification: `from tree import TokenTree, dynamic_tree`."""
from tree.builders import DynamicTreeConfig, StaticTreeShape, best_first_tree, dynamic_tree, merge_trees
from tree.token_tree import TokenTree

__all__ = ["TokenTree", "merge_trees", "StaticTreeShape", "DynamicTreeConfig", "dynamic_tree", "best_first_tree"]
