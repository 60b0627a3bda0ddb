"""threefs: the Fire-Flyer File System (3FS) design, rebuilt in Python over plain TCP."""

__version__ = "0.1.0"


def connect(config=None, **kwargs):
    """Connect to a cluster and return a `threefs.client.Client` (see its docstring)."""
    from threefs.client.client import Client

    return Client.connect(config, **kwargs)
