"""Moved to :mod:`hfexport.tiny.presets` (the CLI's ``tiny:`` models use it); re-exported for tests."""

from hfexport.tiny.presets import PRESETS, Preset

__all__ = ["PRESETS", "Preset"]
