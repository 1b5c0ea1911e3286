"""Subcommands of the `cartridges` CLI, one module each (see cartridges.cli)."""
