"""The workarounds of ``hfexport-dynamo``, entries of :mod:`hfexport.registry`.

- :mod:`hfexport_dynamo.workarounds.patches`: patches under ``"dynamo"`` (installed around the
  capture) and ``"dynamo.load"`` (installed by :func:`hfexport_dynamo.load` for trusted files).
"""
