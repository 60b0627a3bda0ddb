"""threefs: the Fire-Flyer File System (3FS) design, rebuilt in Python over plain TCP."""

__version__ = "0.1.0"


def connect(config=None, **overrides):
    """Connect to a cluster and return a `threefs.client.Client` (see `Client.connect`: keywords override
    fields of the client config, e.g. `timeout_s=60`)."""
    from threefs.client.client import Client

    return Client.connect(config, **overrides)
