"""Tools built on the library: the command line, diff, lockfiles, progress output, test helpers.

Above the format, files, training state and sharded checkpoints (docs/ARCHITECTURE.md).
"""
