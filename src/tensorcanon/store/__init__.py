"""A content-addressed, lossless, verifiable store of many checkpoints (docs/STORE.md).

``tensorcanon.Store(root)`` saves objects under tags, writing each distinct tensor once (named by
its tensor digest, compressed losslessly where that pays) and a small record per tag; a tag loads,
verifies and exports as the file ``tensorcanon.save`` writes for its object.
"""

from .store import Store

__all__ = ["Store"]
