"""``stagingloader.dali``: the DALI backend (``pip install 'stagingloader[dali]'``).

``DALILoader(staged, batch_size=..., shuffle=..., device="cuda")`` is what
``stagingloader.DataLoader(..., backend="dali")`` builds; see :mod:`stagingloader.backends.dali`.
"""

from .backends.dali import DALILoader

__all__ = ["DALILoader"]
