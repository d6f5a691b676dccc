"""The format: every rule of docs/FORMAT.md, decided once (the lowest layer: imports no other).

The container and the manifest, tensor names, key order, dtypes and devices, digests, the
tree's tags and the registry of user types, the built-in codecs, limits and the exceptions.
docs/ARCHITECTURE.md names the module that owns each rule.
"""
