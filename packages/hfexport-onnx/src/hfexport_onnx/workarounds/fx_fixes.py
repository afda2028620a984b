"""FX fixes applied to the captured program before translation (``register_fx_node_fix("onnx")``).

Each fix ``(gm, node) -> bool`` rewrites one node of the captured graph (True = consumed) and
names the upstream issue it works around and the version range it is needed for.
"""

from __future__ import annotations
