"""The workarounds of ``hfexport-executorch``, entries of :mod:`hfexport.registry`.

- :mod:`~hfexport_executorch.workarounds.patches`: patches under ``"executorch"`` and its backend
  scopes (``"executorch.xnnpack"``, ``"executorch.cuda"``), including the core's dense experts;
- :mod:`~hfexport_executorch.workarounds.fx_fixes`: FX program and node fixes of the captured
  program;
- :mod:`~hfexport_executorch.workarounds.edge_passes`: passes on the lowered edge program, run
  before ``to_executorch``.
"""
