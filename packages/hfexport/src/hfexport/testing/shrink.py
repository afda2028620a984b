"""Moved to :mod:`hfexport.tiny.shrink` (the CLI's ``tiny:`` models use it); re-exported for tests."""

from hfexport.tiny.shrink import HEAD_DIM, HEADS, HIDDEN, VOCAB, shrink_overrides, special_token_ids

__all__ = ["HEADS", "HEAD_DIM", "HIDDEN", "VOCAB", "shrink_overrides", "special_token_ids"]
