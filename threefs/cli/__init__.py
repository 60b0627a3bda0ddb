"""The `threefs` command (cli/main.py) and its sub-commands, one module each."""


def client_for(args):
    """The Client of the cluster that a command's `--config` names (or the default client.toml)."""
    from threefs.client.client import Client

    return Client.connect(args.config)
