"""Turn sample forward kwargs into inputs that ``torch.export`` can trace (see :mod:`.prepare`)."""

from hfexport.inputs.prepare import *  # noqa: F403
from hfexport.inputs.prepare import __all__  # noqa: F401
